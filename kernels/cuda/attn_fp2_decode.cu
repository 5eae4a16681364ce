// Split-KV FP2 decode attention: one query token per sequence, all query heads of a KV-head group
// in one CTA, codes expanded in registers right before tensor-core MMA: values to fp16 (mma.sync
// m16n8k16), keys to fp16 or, with KEY_S8, to int8 (mma.sync m16n8k32 s8, scales after the MMA).
//
// Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv query heads per kv head (<= 8),
// D head dim (64 | 128), P page size (tokens, multiple of 32), S splits per sequence,
// NBK / NBV = D / K_BLOCK / D / V_BLOCK scale blocks per token.
//
// grid (S, Hkv, B), NUM_WARPS warps. CTA (s, h, b) covers FP2 tokens [lo + s * split_tokens, ...)
// of sequence b (lo aligned down to 32), in stages of 32 tokens (never across a page: P % 32 == 0);
// warp w takes stages w, w + NUM_WARPS, ... through its own STAGES-deep cp.async ring, so the main
// loop needs no block barrier. Each warp keeps an online softmax per head; at the end the warps
// are combined through shared memory and the CTA writes its unnormalised partial output and
// (max, sum) to the split workspace; attn_fp2_merge adds the bf16 sinks/tail and normalises.
//
// The MMAs are "swapped" (tokens and channels on M, heads on N = 8), so a group of <= 8 heads
// wastes at most N padding, never 16-row M padding:
//   scores^T [16 tok, 8 heads] = K [16 tok, D] . Q^T [D, 8 heads]       (A = dequantised K)
//   out^T    [16 ch, 8 heads]  += V^T [16 ch, 16 tok] . P^T [16 tok, 8]  (A = dequantised V)
// P^T comes from the score accumulators by one movmatrix.trans per 8x8 block.
//
// Element order inside an MMA is free as long as both operands agree: K channels are permuted so
// that each lane's 32 (D=128) or 16 (D=64) channels of a token are whole code words of one scale
// block (one scaled lookup table per lane and token); Q is loaded in the same order. Token order
// in a 16-token tile is permuted (tok_of_row) so that the shared-memory reads of K and V are free
// of bank conflicts: by position alone for token-layout values, with the chunks of the stage's runs
// permuted for quad-layout values (V_QUAD: one 16-byte V load per tile, value scales on P^T). V
// channels land in a known permuted order that the epilogue undoes. See docs/fp2-kernel.md.
#include "attn_fp2_common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4  // query heads per kv head, 1..8
#endif
#ifndef K_BLOCK
#define K_BLOCK 64  // channels per key scale block
#endif
#ifndef V_BLOCK
#define V_BLOCK 64  // channels per value scale block
#endif
#ifndef SCALE_FMT
#define SCALE_FMT 0  // 0: E4M3, 1: E8M0
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef KEY_S8
#define KEY_S8 0  // 1: keys as int8 in m16n8k32 IMMAs, key scales applied to the scores (K_BLOCK >= 64)
#endif
#ifndef V_QUAD
#define V_QUAD 0  // 1: value pages in the quad layout, value scales folded into P (docs/fp2-kernel.md)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // CTAs per SM the register allocation must allow (__launch_bounds__)
#endif

namespace {

using namespace zd;

constexpr int D = HEAD_DIM;
constexpr int NKS = D / 16;       // k-steps of the score MMA == M-tiles of the output MMA
constexpr int WPR = D / 16;       // code words per token row
constexpr int WPL = D / 64;       // key code words per lane per token (32 or 16 channels)
constexpr int NBK = D / K_BLOCK;  // key scale bytes per token
constexpr int NBV = D / V_BLOCK;  // value scale bytes per token
constexpr int TOK = 32;           // tokens per pipeline stage
constexpr int NT = TOK / 16;      // MMA tiles per stage

static_assert(D == 64 || D == 128, "head dim must be 64 or 128");
static_assert(GROUP >= 1 && GROUP <= 8, "1..8 query heads per kv head");
// A lane's key channels (16 * WPL consecutive stored channels) and value channels (D / 8) must sit
// inside one scale block.
static_assert(K_BLOCK >= 16 * WPL && D % K_BLOCK == 0, "key block must cover a lane's channels");
static_assert(V_BLOCK >= D / 8 && D % V_BLOCK == 0, "value block must cover a lane's channels");
// KEY_S8: a k32 step must lie in one key scale block (its partial scores get that block's scale).
static_assert(!KEY_S8 || K_BLOCK >= 64, "KEY_S8 needs key blocks of at least 64 channels");
// V_QUAD: an output M-tile (16 channels) must lie in one value scale block (its P^T carries that
// block's scales).
static_assert(!V_QUAD || V_BLOCK >= 16, "the quad value layout needs value blocks of at least 16 channels");
static_assert(TOK * NBK % 16 == 0 && TOK * NBV % 16 == 0, "scale rows of a stage copy in 16 B");

struct __align__(16) Stage {
  uint32_t kc[TOK * WPR];  // [TOK, D/16] key code words, token-major (V_QUAD: chunks by k_chunk)
  uint32_t vc[TOK * WPR];  // value code words as in the page (V_QUAD: quads, chunks by v_chunk)
  uint8_t ks[TOK * NBK];  // [TOK, NBK] key scale bytes
  uint8_t vs[TOK * NBV];
};
static_assert(sizeof(Stage) % 16 == 0, "stages stay 16-byte aligned");

// Position p (0..7) of an 8-row MMA half-tile -> token row in the stage. Rows 4a+b go to 4a +
// (a+b)%4: the four rows read by one 8-byte K load of a half warp (p = 0..3 or 4..7) and the four
// rows read by one 4-byte V load (p = 0,2,4,6 or 1,3,5,7) then fall in distinct 32-byte bank
// groups.
ZD_DEVICE int tok_of_pos8(int p) { return (p & 4) | (((p & 3) + (p >> 2)) & 3); }

// Score row r (0..15) of a 16-token tile -> its token in the tile. With V_QUAD, rows 2t, 2t+1,
// 2t+8, 2t+9 are tokens 4t..4t+3 (quad t): the output MMA's k pairs (2t, 2t+1) and (2t+8, 2t+9) of
// lane t are then bytes 0-1 and 2-3 of quad t's words, which one expansion yields as half2 pairs.
ZD_DEVICE int tok_of_row(int r) {
  if constexpr (V_QUAD) return 4 * ((r & 7) >> 1) + (r & 1) + 2 * (r >> 3);
  return 8 * (r >> 3) + tok_of_pos8(r & 7);
}

// Shared-memory place of 16-byte chunk c of a stage's key run (token-major rows of WPR words). The
// quad row order has the 8 rows of an MMA half-tile at only two values of tok % 4, i.e. in two
// bank groups of plain rows; V_QUAD permutes the chunks inside each 128-byte group of rows so that
// those rows (4- and 8-byte loads alike) fall in distinct bank groups.
ZD_DEVICE int k_chunk(int c) {
  if constexpr (!V_QUAD) return c;
  if constexpr (D == 128) {
    const int x = (c >> 3) & 3;  // rows 4x..4x+3 of an 16-row tile: chunk XOR 0, 4, 1, 5
    return c ^ (((x & 1) << 2) | (x >> 1));
  }
  return c ^ (((c >> 3) & 1) << 1);  // D = 64: one chunk per row
}
// Shared-memory index of key code word w of stage token tok.
ZD_DEVICE int k_word(int tok, int w) { return 4 * k_chunk(tok * (WPR / 4) + (w >> 2)) + (w & 3); }

// Shared-memory place of 16-byte chunk c of a stage's value run. V_QUAD: quad q's chunk k (lane
// group g's words: k = g at D = 128, g / 2 at D = 64) moves to k ^ 2(q % 4) (D = 64: k ^ (q & 2)),
// so that the lanes of one load phase, which read the same k of four quads, hit distinct banks.
ZD_DEVICE int v_chunk(int c) {
  if constexpr (!V_QUAD) return c;
  constexpr int CPQ = D / 16;  // chunks per quad
  const int q = c / CPQ, k = c % CPQ;
  return q * CPQ + (k ^ (D == 128 ? 2 * (q & 3) : (q & 2)));
}

// The K channel held in k-step ks, k index kk (0..15) by the lanes with t = (kk % 8) / 2.
ZD_DEVICE int k_channel(int ks, int kk) {
  const int t = (kk & 7) >> 1, e = kk & 1, hi = kk >> 3;
  return 16 * (t * WPL + ks / 4) + 8 * hi + 4 * e + (ks & 3);
}
// The V channel of output row (m-tile m, half r) for lane group g.
ZD_DEVICE int v_channel(int g, int r, int m) {
  if constexpr (V_QUAD) return 16 * m + 8 * r + g;  // runtime/kv/pack.py, quad_channel_order
  return g * (D / 8) + r * (D / 16) + m;
}

// What the score MMAs need besides the stage: the query as B fragments and the key level table.
constexpr bool kPairTerms = KEY_S8 && GROUP <= 4;  // int8 keys: both query terms in one IMMA (below)
#if KEY_S8
// Keys are their levels times f as int8, f = 64 if every |L| < 2 else 32 (integers for e5m2-exact
// codebooks whose inner levels are >= 1/16, resp. 1/8; check_tables verifies), and the MMA is
// m16n8k32 int8 x int8 -> int32. Each head's query is scaled by a power of two c (largest |q c| in [32, 64))
// and split into two int8 terms, q c ~ hi + lo / 128, so q c * 128 is an integer of up to 13 bits
// (fp16 q has 11): two IMMAs per k32 step, combined in int32 (hi * 128 + lo), converted once, and
// multiplied by the block's key scale / (c * f * 128).
// Lane t supplies word 4j + t of its rows for k32 steps 2j (codes 0,2,.. / 8,10,..) and 2j + 1
// (codes 1,3,.. / 9,11,..): k32 step ks, k index kk (0..31) is channel k8_channel(ks, kk).
// With GROUP <= 4 the two query terms share one IMMA (kPairTerms): columns 0..3 of the B operand
// are the heads' hi terms, columns 4..7 their lo terms (the padding columns otherwise), so a lane
// with t < 2 accumulates hi partials of heads 2t, 2t+1 and its partner t + 2 the lo partials of the
// same heads; each scales its own part and one shuffle adds them. Half the IMMAs, Q registers and
// integer accumulators; lanes t >= 2 then carry copies of heads 0..3 in the softmax and the output
// (columns the combine drops, as it dropped the padding heads).
constexpr int KS8 = D / 32;  // k32 steps
constexpr int WPJ = D / 64;  // words per lane per token row (one per pair of k32 steps)
constexpr int NTERM = kPairTerms ? 1 : 2;  // IMMAs per k32 step
constexpr int kScoreMagic = 0x4B400000;    // the bits of 1.5 * 2^23 (kPairTerms accumulators start there)
struct KeyOps {
  uint32_t qf[KS8][NTERM][2];  // [k32 step][hi, lo (or the lane's column's term)][b0, b1]
  uint32_t table;              // f L0..L3 as int8, bytes 0..3
  uint32_t term;               // half2: 128 for lanes summing hi terms (kPairTerms, t < 2), else 1
};
// The key scales of one token row (its NBK blocks) as fp32, times the lane's term (a power of two
// <= 2^7: exact, and E4M3 * 2^7 <= 57344 stays inside fp16).
ZD_DEVICE void key_scales(const uint8_t* row, uint32_t term, float (&sc)[NBK]) {
  if constexpr (SCALE_FMT == kScaleE4M3 && NBK == 2) {
    uint32_t h2 = scales_to_half2<kScaleE4M3>(*reinterpret_cast<const uint16_t*>(row));  // one load, one cvt
    if constexpr (kPairTerms) h2 = h2_as_u32(__hmul2(u32_as_h2(h2), u32_as_h2(term)));
    sc[0] = __low2float(u32_as_h2(h2));
    sc[1] = __high2float(u32_as_h2(h2));
  } else {
#pragma unroll
    for (int b = 0; b < NBK; ++b) {
      sc[b] = scale_to_float<SCALE_FMT>(row[b]);
      if constexpr (kPairTerms) sc[b] *= __low2float(u32_as_h2(term));
    }
  }
}
ZD_DEVICE int k8_channel(int ks, int kk) {
  const int t = (kk & 15) >> 2, e = kk & 3, hi = kk >> 4;
  return 16 * (4 * (ks >> 1) + t) + 8 * hi + 2 * e + (ks & 1);
}
#else
struct KeyOps {
  uint32_t qf[NKS][2];  // Q^T B fragments, channels in k_channel order
  uint32_t kl01, kl23;  // half2(L0, L1), half2(L2, L3)
};
#endif

struct Softmax {
  float m[2], l[2];  // running max (log2 domain) and this lane's partial sum, heads 2t, 2t+1
#if KEY_S8
  float inv[2];  // per score column: 1 / (c_h * f * 128), turning the integer scores into log2 units
#endif
};

// Byte offsets of a stage's parts (the layout of Stage).
constexpr uint32_t kOffKc = 0, kOffVc = 4 * TOK * WPR, kOffKs = 8 * TOK * WPR, kOffVs = kOffKs + TOK * NBK;
constexpr int kCodeChunks = TOK * WPR / 4 / 32;  // 16-byte chunks of each code run per lane (2, or 1 at D = 64)
static_assert(kOffVs + TOK * NBV == sizeof(Stage), "Stage layout");

// Where a lane's copies land in a stage: chunks lane + 32x of the key and value code runs, placed by
// k_chunk / v_chunk; fixed for the CTA.
struct CopyPlan {
  uint32_t kc[kCodeChunks], vc[kCodeChunks];  // byte offsets in a Stage
};
ZD_DEVICE CopyPlan copy_plan(int lane) {
  CopyPlan cp;
#pragma unroll
  for (int x = 0; x < kCodeChunks; ++x) {
    cp.kc[x] = kOffKc + 16 * k_chunk(lane + 32 * x);
    cp.vc[x] = kOffVc + 16 * v_chunk(lane + 32 * x);
  }
  return cp;
}

// Fill one stage: 32 tokens of K and V codes plus their scales (a page holds whole stages). `dst`
// is the stage's shared address; kc / vc point at the lane's first chunk (chunk `lane`) of the
// stage's code runs, ks / vs at chunk `lane` of its scale runs (copied by the lanes that have one).
ZD_DEVICE void load_stage(uint32_t dst, int lane, const CopyPlan& cp, const uint32_t* kc, const uint32_t* vc,
                          const uint8_t* ks, const uint8_t* vs) {
#pragma unroll
  for (int x = 0; x < kCodeChunks; ++x) {
    cp_async16(dst + cp.kc[x], kc + 128 * x, 16);  // chunk lane + 32x: 512 bytes further
    cp_async16(dst + cp.vc[x], vc + 128 * x, 16);
  }
  if (lane < TOK * NBK / 16) cp_async16(dst + kOffKs + 16 * lane, ks, 16);
  if (lane < TOK * NBV / 16) cp_async16(dst + kOffVs + 16 * lane, vs, 16);
}

template <bool PARTIAL>
ZD_DEVICE void compute_stage(const Stage* st, int g, int t, uint32_t valid, const KeyOps& key, uint32_t vlt,
                             Softmax& sm, float (&oacc)[NKS][4]) {
  // ---- scores^T = K Q^T for NT tiles ------------------------------------------------------------
  float sacc[NT][4];
#if KEY_S8
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    uint32_t a[2][WPJ][4];  // [row half][word][register], expand_word_bytes' order
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = 16 * i + tok_of_row(g + 8 * r);
#pragma unroll
      for (int j = 0; j < WPJ; ++j) expand_word_bytes(st->kc[k_word(tok, 4 * j + t)], key.table, a[r][j]);
    }
    int acc[NBK][NTERM][4];  // partial dot products per key scale block and query term
#pragma unroll
    for (int b = 0; b < NBK; ++b)
#pragma unroll
      for (int u = 0; u < NTERM; ++u)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[b][u][c] = kPairTerms ? kScoreMagic : 0;
#pragma unroll
    for (int ks = 0; ks < KS8; ++ks) {
      const int j = ks >> 1, o = 2 * (ks & 1), b = 64 * j / K_BLOCK;
#pragma unroll
      for (int u = 0; u < NTERM; ++u)
        mma_s8(acc[b][u], a[0][j][o], a[1][j][o], a[0][j][o + 1], a[1][j][o + 1], key.qf[ks][u][0], key.qf[ks][u][1]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // c[2r], c[2r+1]: token row g + 8r, score columns 2t, 2t+1
      float sc[NBK];
      key_scales(st->ks + (16 * i + tok_of_row(g + 8 * r)) * NBK, key.term, sc);
#pragma unroll
      // The column's 1 / (c f 128) is applied in the softmax (Softmax::inv).
      if constexpr (kPairTerms) {
        // The accumulators started at kScoreMagic's bits, so each is, read as fp32, exactly
        // 1.5 * 2^23 + the lane's partial (|partial| < 2^20 < 2^22): F * sc - 1.5 * 2^23 * sc is
        // the partial times the scale, rounded once (no int-to-float conversion on the ALU pipe).
        float msc[NBK];
#pragma unroll
        for (int b = 0; b < NBK; ++b) msc[b] = -12582912.f * sc[b];  // exact: sc has <= 8 significant bits
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v = fmaf(__int_as_float(acc[0][0][2 * r + h]), sc[0], msc[0]);
#pragma unroll
          for (int b = 1; b < NBK; ++b) v += fmaf(__int_as_float(acc[b][0][2 * r + h]), sc[b], msc[b]);
          sacc[i][2 * r + h] = v;
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int b = 0; b < NBK; ++b) {
            // hi * 128 + lo: |.| < 2^27, exact in int32 and rounded once to fp32 (2^-24 relative)
            const float v = float(acc[b][0][2 * r + h] * 128 + acc[b][NTERM - 1][2 * r + h]);
            sacc[i][2 * r + h] = b ? fmaf(v, sc[b], sacc[i][2 * r + h]) : v * sc[b];
          }
        }
      }
    }
    if constexpr (kPairTerms) {
#pragma unroll
      for (int c = 0; c < 4; ++c) sacc[i][c] += __shfl_xor_sync(0xffffffffu, sacc[i][c], 2);  // hi + lo
    }
    if constexpr (PARTIAL) {
      const int tok0 = 16 * i + tok_of_row(g), tok1 = 16 * i + tok_of_row(g + 8);
      if (!((valid >> tok0) & 1u)) sacc[i][0] = sacc[i][1] = ZD_NEG_INF;
      if (!((valid >> tok1) & 1u)) sacc[i][2] = sacc[i][3] = ZD_NEG_INF;
    }
  }
#else
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    uint32_t a[NKS][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = 16 * i + tok_of_row(g + 8 * r);
      const uint32_t sbyte = st->ks[tok * NBK + (16 * t * WPL) / K_BLOCK];
      const __half2 s2 = u32_as_h2(scales_to_half2<SCALE_FMT>(sbyte * 0x0101u));
      const uint32_t t01 = h2_as_u32(__hmul2(u32_as_h2(key.kl01), s2));
      const uint32_t t23 = h2_as_u32(__hmul2(u32_as_h2(key.kl23), s2));
      const uint32_t* row = st->kc + k_word(tok, t * WPL);  // WPL <= 2 words: one chunk
#pragma unroll
      for (int w = 0; w < WPL; ++w) {
        uint32_t e[8];
        expand_word_f16(row[w], t01, t23, e);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          a[4 * w + s][r] = e[2 * s];          // k 2t, 2t+1 of k-step 4w+s
          a[4 * w + s][2 + r] = e[2 * s + 1];  // k 2t+8, 2t+9
        }
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) sacc[i][c] = 0.f;
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks) mma_f16(sacc[i], a[ks], key.qf[ks][0], key.qf[ks][1]);
    if constexpr (PARTIAL) {
      const int tok0 = 16 * i + tok_of_row(g), tok1 = 16 * i + tok_of_row(g + 8);
      if (!((valid >> tok0) & 1u)) sacc[i][0] = sacc[i][1] = ZD_NEG_INF;
      if (!((valid >> tok1) & 1u)) sacc[i][2] = sacc[i][3] = ZD_NEG_INF;
    }
  }
#endif

  // ---- online softmax (per head: lanes with equal t hold the same two heads) --------------------
  // Lazy rescaling: the running max m only has to bound the scores well enough that 2^(s - m)
  // stays small in fp16 (P) and fp32 (sums), not to be the exact max. While no score of the stage
  // exceeds m + kRescaleSlack (one vote, no shuffles), m is kept and nothing is rescaled; the
  // exact max over the warp (a 3-level shuffle chain, the longest dependency of a stage) is taken
  // only when some score does, which after the first stages is rare. P <= 2^8 (2^7) fits fp16 easily.
  // V_QUAD: 7, so that P^T times a value scale (<= 448) stays inside fp16 (2^7 * 448 < 65504).
  constexpr float kRescaleSlack = V_QUAD ? 7.f : 8.f;
  // KEY_S8 scores are in integer units until multiplied by the column's inv; the max and the vote
  // work on them as they are (inv > 0) and the weight takes inv in its one FFMA.
#if KEY_S8
  const float u[2] = {sm.inv[0], sm.inv[1]};
#else
  constexpr float u[2] = {1.f, 1.f};
#endif
  float mx[2] = {fmaxf(sacc[0][0], sacc[0][2]), fmaxf(sacc[0][1], sacc[0][3])};
#pragma unroll
  for (int i = 1; i < NT; ++i) {
    mx[0] = fmaxf(mx[0], fmaxf(sacc[i][0], sacc[i][2]));
    mx[1] = fmaxf(mx[1], fmaxf(sacc[i][1], sacc[i][3]));
  }
  // The first stage always votes (m = -inf); a stage always holds a valid token, so m is finite
  // from then on.
  if (__any_sync(0xffffffffu, mx[0] * u[0] > sm.m[0] + kRescaleSlack || mx[1] * u[1] > sm.m[1] + kRescaleSlack)) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], off));
      mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], off));
    }
    const float m0 = fmaxf(sm.m[0], mx[0] * u[0]), m1 = fmaxf(sm.m[1], mx[1] * u[1]);
    const float al0 = ex2(sm.m[0] - m0), al1 = ex2(sm.m[1] - m1);  // 0 on the first stage
    sm.l[0] *= al0;
    sm.l[1] *= al1;
#pragma unroll
    for (int m = 0; m < NKS; ++m) {
      oacc[m][0] *= al0;
      oacc[m][1] *= al1;
      oacc[m][2] *= al0;
      oacc[m][3] *= al1;
    }
    sm.m[0] = m0;
    sm.m[1] = m1;
  }
  uint32_t pb[NT][2];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const float p0 = ex2(fmaf(sacc[i][0], u[0], -sm.m[0])), p1 = ex2(fmaf(sacc[i][1], u[1], -sm.m[1]));
    const float p2 = ex2(fmaf(sacc[i][2], u[0], -sm.m[0])), p3 = ex2(fmaf(sacc[i][3], u[1], -sm.m[1]));
    sm.l[0] += p0 + p2;
    sm.l[1] += p1 + p3;
    pb[i][0] = movmatrix_trans(pack_half2(p0, p1));  // P^T[rows 2t, 2t+1][head g]
    pb[i][1] = movmatrix_trans(pack_half2(p2, p3));  // P^T[rows 2t+8, 2t+9][head g]
  }

#if V_QUAD
  // ---- out^T += V^T (P^T times the value scales) ----------------------------------------------
  // Quad layout (runtime/kv/pack.py): lane (g, t) reads the 16 (D = 64: 8) bytes of quad 4i + t that
  // hold its rows g and g + 8 of every M-tile for the quad's 4 tokens, and one expansion per word
  // gives the A registers directly (no byte interleave, no per-register scale multiply). The value
  // scales ride on P^T instead: pb[i][h] holds P^T at tokens 4t + 2h, 4t + 2h + 1 of the tile for
  // head g, times each value block's scales of those tokens (one HMUL2 per block and register);
  // M-tile m takes block 16m / V_BLOCK's copy.
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int q = 4 * i + t;  // the lane's quad in the stage
    uint32_t qs[NBV];         // the quad's scale bytes: token j, block b at byte j * NBV + b
#pragma unroll
    for (int x = 0; x < NBV; ++x) qs[x] = reinterpret_cast<const uint32_t*>(st->vs + q * 4 * NBV)[x];
    uint32_t pv[NBV][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t keep = 0xffffffffu;
      if constexpr (PARTIAL) {
        // Unwritten slots may hold any scale byte (E4M3 0x7f is NaN) and 0 * NaN is NaN: zero them.
        const int ta = 4 * q + 2 * h;
        keep = (((valid >> ta) & 1u) ? 0x0000ffffu : 0u) | (((valid >> (ta + 1)) & 1u) ? 0xffff0000u : 0u);
      }
      if constexpr (SCALE_FMT == kScaleE4M3 && NBV == 2) {
        // qs[h] holds tokens 2h, 2h + 1 (bytes 0-1, 2-3); one permute pairs them per block and
        // the two conversions read its halves
        const uint32_t both = prmt(qs[h], 0u, 0x3120);
        pv[0][h] = h2_as_u32(__hmul2(u32_as_h2(pb[i][h]), u32_as_h2(e4m3x2_lo(both) & keep)));
        pv[1][h] = h2_as_u32(__hmul2(u32_as_h2(pb[i][h]), u32_as_h2(e4m3x2_hi(both) & keep)));
      } else {
#pragma unroll
        for (int b = 0; b < NBV; ++b) {
          const int i0 = 2 * h * NBV + b, i1 = i0 + NBV;  // bytes of tokens 2h, 2h + 1 of the quad
          const uint32_t pair = prmt(qs[i0 >> 2], qs[i1 >> 2], (i0 & 3) | (((i1 & 3) + 4) << 4));
          const uint32_t s2 = value_scales_to_half2<SCALE_FMT>(pair) & keep;
          pv[b][h] = h2_as_u32(__hmul2(u32_as_h2(pb[i][h]), u32_as_h2(s2)));
        }
      }
    }
    uint32_t w[D / 32];  // the lane's words of the quad (chunk moved by v_chunk)
    if constexpr (D == 128) {
      const uint4 x = *reinterpret_cast<const uint4*>(st->vc + 4 * ((q << 3) | (g ^ (2 * t))));
      w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(st->vc + 4 * ((q << 2) | ((g >> 1) ^ (t & 2))) + 2 * (g & 1));
      w[0] = x.x, w[1] = x.y;
    }
#pragma unroll
    for (int k = 0; k < D / 32; ++k) {
      // word k, field f: M-tile 2k + f / 2, row g + 8 (f % 2); bytes 0-1 are k pair (2t, 2t+1),
      // bytes 2-3 k pair (2t+8, 2t+9), and expand_word_e5m2 gives field f of bytes 0-1 at e[2f],
      // of bytes 2-3 at e[2f + 1]. Each word's two M-tiles are multiplied right after it is expanded.
      uint32_t e[8];
      expand_word_e5m2(w[k], vlt, e);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = 2 * k + h;
        const uint32_t a[4] = {e[4 * h], e[4 * h + 2], e[4 * h + 1], e[4 * h + 3]};
        mma_f16(oacc[m], a, pv[16 * m / V_BLOCK][0], pv[16 * m / V_BLOCK][1]);
      }
    }
  }
#else
  // ---- out^T += V^T P^T ----------------------------------------------------------------------
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    // Lane (g, t) feeds token pairs at positions (2t, 2t+1) and (2t+8, 2t+9).
    uint32_t v[2][2][8];  // [pair][half r][m-tile % 8 mapping] expanded, scaled half2 (tokA, tokB)
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const int ta = 16 * i + 8 * pr + tok_of_pos8(2 * t), tb = 16 * i + 8 * pr + tok_of_pos8(2 * t + 1);
      const int vblk = (g * (D / 8)) / V_BLOCK;
      uint32_t spair = st->vs[ta * NBV + vblk] | (uint32_t(st->vs[tb * NBV + vblk]) << 8);
      __half2 s2 = u32_as_h2(scales_to_half2<SCALE_FMT>(spair));
      if constexpr (PARTIAL) {
        // Unwritten slots may hold any byte (E4M3 0x7f is NaN): zero their scale so that the
        // value is 0 and 0 * p stays 0.
        uint32_t keep = (((valid >> ta) & 1u) ? 0x0000ffffu : 0u) | (((valid >> tb) & 1u) ? 0xffff0000u : 0u);
        s2 = u32_as_h2(h2_as_u32(s2) & keep);
      }
      if constexpr (D == 128) {
        const uint32_t wa = st->vc[ta * WPR + g], wb = st->vc[tb * WPR + g];
        uint32_t e[8];
        expand_word_e5m2(prmt(wa, wb, 0x5140), vlt, e);  // word channels 0..7
#pragma unroll
        for (int j = 0; j < 8; ++j) v[pr][0][j] = h2_as_u32(__hmul2(u32_as_h2(e[j]), s2));
        expand_word_e5m2(prmt(wa, wb, 0x7362), vlt, e);  // word channels 8..15
#pragma unroll
        for (int j = 0; j < 8; ++j) v[pr][1][j] = h2_as_u32(__hmul2(u32_as_h2(e[j]), s2));
      } else {
        const uint32_t wa = st->vc[ta * WPR + (g >> 1)], wb = st->vc[tb * WPR + (g >> 1)];
        uint32_t e[8];
        expand_word_e5m2(prmt(wa, wb, (g & 1) ? 0x7362 : 0x5140), vlt, e);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[pr][j & 1][j >> 1] = h2_as_u32(__hmul2(u32_as_h2(e[j]), s2));
      }
    }
#pragma unroll
    for (int m = 0; m < NKS; ++m) {
      // D=128: row half r, m-tile m -> word channel 8r + m; expand_word gives channel s at e[2s]
      // and 4+s at e[2s+1], so m < 4 -> e[2m], m >= 4 -> e[2(m-4)+1].
      // D=64: row half r, m-tile m -> channel 8*(g%2) + 4r + m of the word -> e[2m + r].
      uint32_t a[4];
      if constexpr (D == 128) {
        const int j = m < 4 ? 2 * m : 2 * (m - 4) + 1;
        a[0] = v[0][0][j];
        a[1] = v[0][1][j];
        a[2] = v[1][0][j];
        a[3] = v[1][1][j];
      } else {
        a[0] = v[0][0][m];
        a[1] = v[0][1][m];
        a[2] = v[1][0][m];
        a[3] = v[1][1][m];
      }
      mma_f16(oacc[m], a, pb[i][0], pb[i][1]);
    }
  }
#endif
}

}  // namespace

// q        [B, Hq, D] fp16: rotated, anchor-folded, times softmax_scale * log2(e)
// k_codes  page pool of key code words: page p, kv head h, slot j at
//          k_codes + p * code_page_stride + h * code_head_stride + j * D/16 (words)
// k_scales key scale bytes at k_scales + p * ks_page_stride + h * ks_head_stride + j * NBK
// v_codes / v_scales: the same for values (same code strides; own scale strides)
// levels   [8] fp32: 4 key levels then 4 value levels (fp16-exact)
// block_table [B, bt_stride] int32 page ids over FP2 token index (token f in page f / P, slot f % P)
// fp2_lo / fp2_hi [B] int32: the FP2 tokens [lo, hi) to attend to
// o_part   [B, Hq, max_splits, D] fp32 unnormalised partial outputs (V channels in stored order)
// ml_part  [B, Hq, max_splits, 2] fp32 (running max in log2 units, sum of exponentials)
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
    attn_fp2_decode(const __half* __restrict__ q, const uint32_t* __restrict__ k_codes,
                    const uint8_t* __restrict__ k_scales, const uint32_t* __restrict__ v_codes,
                    const uint8_t* __restrict__ v_scales, uint32_t code_page_stride,
                    uint32_t code_head_stride, uint32_t ks_page_stride, uint32_t ks_head_stride,
                    uint32_t vs_page_stride, uint32_t vs_head_stride, const float* __restrict__ levels,
                    const int32_t* __restrict__ block_table, int bt_stride, int page_size,
                    const int32_t* __restrict__ fp2_lo, const int32_t* __restrict__ fp2_hi, int split_tokens,
                    int max_splits, float* __restrict__ o_part, float* __restrict__ ml_part) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int num_kv_heads = gridDim.y, num_q_heads = num_kv_heads * GROUP;
  const int lo = fp2_lo[b], hi = fp2_hi[b];
  const int base = lo & ~(TOK - 1);
  const int r_lo = base + split * split_tokens;
  const int r_hi = min(hi, r_lo + split_tokens);
  if (r_lo >= r_hi || lo >= hi) return;  // the merge kernel counts splits the same way
  const int num_stages = (r_hi - r_lo + TOK - 1) / TOK;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  Stage* ring = reinterpret_cast<Stage*>(smem_raw) + warp * STAGES;

  // Q^T fragments (B operand): head g (lanes g >= GROUP multiply zeros; kPairTerms below), channels in the permuted
  // K order.
  KeyOps key;
  float score_inv[2] = {1.f, 1.f};  // KEY_S8: Softmax::inv
  {
    // B column g: head g, or with kPairTerms head g % 4's hi (g < 4) or lo (g >= 4) term
    const int qhead = kPairTerms ? (g & 3) : g;
    const __half* qh = q + (size_t(b) * num_q_heads + kvh * GROUP + min(qhead, GROUP - 1)) * D;
    const bool live = qhead < GROUP;
#if KEY_S8
    float x[KS8][2][4];
    float mx = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS8; ++ks)
#pragma unroll
      for (int hl = 0; hl < 2; ++hl)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[ks][hl][e] = live ? __half2float(qh[k8_channel(ks, 16 * hl + 4 * t + e)]) : 0.f;
          mx = fmaxf(mx, fabsf(x[ks][hl][e]));
        }
#pragma unroll
    // one scale per head (lanes 4g..4g+3 hold head g's channels): a head much smaller than the
    // group's largest keeps its own 13 bits
    for (int off = 1; off < 4; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    // c = 2^(5 - floor(log2 mx)); q arrives as fp16, so mx is 0 or a normal fp32 in [2^-24, 65504]
    const int ex = mx > 0.f ? int((__float_as_uint(mx) >> 23) & 0xFFu) - 127 : 0;
    const float c = __uint_as_float(uint32_t(127 + 5 - ex) << 23);
    const bool wide = fmaxf(fabsf(levels[0]), fabsf(levels[3])) >= 2.f;  // f = 32 instead of 64
    const float f = wide ? 32.f : 64.f;
    const float inv = __uint_as_float(uint32_t(127 - 5 - (wide ? 12 : 13) + ex) << 23);  // 1 / (c f 128)
    // score column 2t + h's head: lanes 4 * head hold its c (kPairTerms: column 2t + h is head
    // 2(t % 2) + h's hi term for t < 2, lo term for t >= 2)
    const int col_head = kPairTerms ? 2 * (t & 1) : 2 * t;
    key.term = kPairTerms && t < 2 ? 0x58005800u : 0x3c003c00u;  // half2(128, 128) : half2(1, 1)
    score_inv[0] = __shfl_sync(0xffffffffu, inv, 4 * col_head);
    score_inv[1] = __shfl_sync(0xffffffffu, inv, 4 * col_head + 4);
#pragma unroll
    for (int ks = 0; ks < KS8; ++ks)
#pragma unroll
      for (int hl = 0; hl < 2; ++hl) {
        uint32_t whi = 0, wlo = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float v = x[ks][hl][e] * c;  // exact: a power of two; |v| < 64
          const float h = rintf(v);
          whi |= s8_byte(h) << (8 * e);
          wlo |= s8_byte((v - h) * 128.f) << (8 * e);  // |v - h| <= 1/2: within [-64, 64]
        }
        if constexpr (kPairTerms) {
          key.qf[ks][0][hl] = g < 4 ? whi : wlo;
        } else {
          key.qf[ks][0][hl] = whi;
          key.qf[ks][NTERM - 1][hl] = wlo;
        }
      }
    key.table = s8_byte(levels[0] * f) | (s8_byte(levels[1] * f) << 8) | (s8_byte(levels[2] * f) << 16) |
                (s8_byte(levels[3] * f) << 24);
#else
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks) {
#pragma unroll
      for (int hl = 0; hl < 2; ++hl) {
        const __half x0 = live ? qh[k_channel(ks, 8 * hl + 2 * t)] : __float2half(0.f);
        const __half x1 = live ? qh[k_channel(ks, 8 * hl + 2 * t + 1)] : __float2half(0.f);
        key.qf[ks][hl] = h2_as_u32(__halves2half2(x0, x1));
      }
    }
    key.kl01 = pack_half2(levels[0], levels[1]);
    key.kl23 = pack_half2(levels[2], levels[3]);
#endif
  }
  // Value levels as the high bytes of their fp16 (e5m2-exact by the format).
  const uint32_t vl01 = pack_half2(levels[4], levels[5]), vl23 = pack_half2(levels[6], levels[7]);
  const uint32_t vlt = prmt(vl01, vl23, 0x7531);

  // Page ids of the warp's stages, prefetched 32 stages at a time: lane l of `pages_cur` holds the
  // page of the warp's local stage 32c + l (chunk c), `pages_next` those of chunk c + 1, and
  // `slots_*` the stage's first slot in that page. Reading the block table right before each
  // cp.async would stall the warp on a dependent global load (an L2 round trip) every stage, and
  // the integer division by page_size costs ~25 instructions: both now happen once per chunk.
  const int32_t* bt = block_table + size_t(b) * bt_stride;
  auto load_pages = [&](int chunk, int& page, int& slot) {
    const int si = warp + (32 * chunk + lane) * NUM_WARPS;
    const int f = r_lo + si * TOK;  // first token of the stage
    page = si < num_stages ? bt[f / page_size] : 0;
    slot = f % page_size;
  };
  int pages_cur, slots_cur, pages_next, slots_next;
  load_pages(0, pages_cur, slots_cur);
  load_pages(1, pages_next, slots_next);
  // Issue the copies of the warp's local stage j (global stage warp + j * NUM_WARPS) into `slot`.
  // Called by the whole warp with the same j, in increasing order (the page chunks advance here).
  // The lane's part of every stage's copies: its chunks' places in a stage, and its offsets inside
  // a page (the strides are 32-bit, checked on the host, so a stage's global offsets are one wide
  // multiply-add per run).
  const CopyPlan plan = copy_plan(lane);
  const uint32_t ring_addr = smem_addr(ring);
  const uint32_t code_in_page = kvh * code_head_stride + 4 * lane;
  const uint32_t ks_in_page = kvh * ks_head_stride + 16 * lane, vs_in_page = kvh * vs_head_stride + 16 * lane;
  auto issue = [&](int j, int slot) {
    if (j > 0 && (j & 31) == 0) {
      pages_cur = pages_next;
      slots_cur = slots_next;
      load_pages((j >> 5) + 1, pages_next, slots_next);
    }
    const uint32_t page = __shfl_sync(0xffffffffu, pages_cur, j & 31);
    const uint32_t pos = __shfl_sync(0xffffffffu, slots_cur, j & 31);  // slot of the stage's first token
    if (warp + j * NUM_WARPS < num_stages) {
      const uint64_t cw = uint64_t(page) * code_page_stride + (code_in_page + pos * WPR);  // code words
      load_stage(ring_addr + slot * uint32_t(sizeof(Stage)), lane, plan, k_codes + cw, v_codes + cw,
                 k_scales + (uint64_t(page) * ks_page_stride + (ks_in_page + pos * NBK)),
                 v_scales + (uint64_t(page) * vs_page_stride + (vs_in_page + pos * NBV)));
    }
    cp_async_commit();  // empty groups keep the wait count uniform
  };

  Softmax sm;
  sm.m[0] = sm.m[1] = ZD_NEG_INF;
  sm.l[0] = sm.l[1] = 0.f;
#if KEY_S8
  sm.inv[0] = score_inv[0];
  sm.inv[1] = score_inv[1];
#endif
  float oacc[NKS][4];
#pragma unroll
  for (int m = 0; m < NKS; ++m) oacc[m][0] = oacc[m][1] = oacc[m][2] = oacc[m][3] = 0.f;

  // Warp w handles stages w, w + NUM_WARPS, ...; its k-th stage sits in ring slot k % STAGES.
#pragma unroll
  static_assert(STAGES <= 32, "the prologue stays inside the first page chunk");
  for (int k = 0; k < STAGES - 1; ++k) issue(k, k);
  int k = 0;
  for (int si = warp; si < num_stages; si += NUM_WARPS, ++k) {
    cp_async_wait<STAGES - 2>();  // stage k has landed (this lane's copies) ...
    __syncwarp();                 // ... and every lane's; slot (k-1) % STAGES is free again
    issue(k + STAGES - 1, (k + STAGES - 1) % STAGES);
    const Stage* st = ring + k % STAGES;
    const int f0 = r_lo + si * TOK;
    if (f0 >= lo && f0 + TOK <= r_hi) {
      compute_stage<false>(st, g, t, 0xffffffffu, key, vlt, sm, oacc);
    } else {
      const int a = max(lo - f0, 0), z = min(r_hi - f0, TOK);  // valid tokens [a, z) of the stage
      const uint32_t valid = (z >= 32 ? 0xffffffffu : ((1u << z) - 1u)) & ~((1u << a) - 1u);
      compute_stage<true>(st, g, t, valid, key, vlt, sm, oacc);
    }
  }
  cp_async_wait<0>();

  // ---- combine the warps of the CTA ---------------------------------------------------------
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    sm.l[0] += __shfl_xor_sync(0xffffffffu, sm.l[0], off);
    sm.l[1] += __shfl_xor_sync(0xffffffffu, sm.l[1], off);
  }
  __syncthreads();  // every warp is done with its ring: reuse the shared memory
  float* red_m = reinterpret_cast<float*>(smem_raw);  // [NUM_WARPS, 8]
  float* red_l = red_m + NUM_WARPS * 8;              // [NUM_WARPS, 8]
  float* red_o = red_l + NUM_WARPS * 8;              // [NUM_WARPS, 8, D]
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      red_m[warp * 8 + 2 * t + c] = sm.m[c];
      red_l[warp * 8 + 2 * t + c] = sm.l[c];
    }
  }
#pragma unroll
  for (int m = 0; m < NKS; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int head = 2 * t + (c & 1), ch = v_channel(g, c >> 1, m);
      red_o[(warp * 8 + head) * D + ch] = oacc[m][c];
    }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GROUP * D; idx += NUM_WARPS * 32) {
    const int head = idx / D, ch = idx % D;
    float mx = ZD_NEG_INF;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, red_m[w * 8 + head]);
    float o = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float wt = ex2(red_m[w * 8 + head] - mx);  // 0 for warps that saw no stage
      o += wt * red_o[(w * 8 + head) * D + ch];
      l += wt * red_l[w * 8 + head];
    }
    const size_t row = (size_t(b) * num_q_heads + kvh * GROUP + head) * max_splits + split;
    o_part[row * D + ch] = o;
    if (ch == 0) {
      ml_part[row * 2] = mx;
      ml_part[row * 2 + 1] = l;
    }
  }
}
