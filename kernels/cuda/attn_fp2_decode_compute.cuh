// Part of attn_fp2_decode.cu, included after its configuration macros and attn_fp2_decode_stage.cuh
// (not a standalone header): the work of one stage. Expanding the key codes and the score MMAs,
// the online softmax with lazy rescaling, and the output MMAs over the expanded values.
// docs/fp2-kernel.md, "Decode kernel", "Int8 keys", "Paired query terms" and "Issue costs".
#pragma once
#include "attn_fp2_decode_stage.cuh"

namespace {

using namespace zd;

// What the score MMAs need besides the stage: the query as B fragments and the key level table.
// int8 keys with G <= 4: both query terms in one IMMA, a head per lane (below)
constexpr bool kPairTerms = KEY_S8 && GROUP <= 4;
#if KEY_S8
// Keys are their levels times f as int8, f = 64 if every |L| < 2 else 32 (integers for e5m2-exact
// codebooks whose inner levels are >= 1/16, resp. 1/8; check_tables verifies), and the MMA is
// m16n8k32 int8 x int8 -> int32. Each head's query is scaled by a power of two c (largest |q c| in [32, 64))
// and split into two int8 terms, q c ~ hi + lo / 128, so q c * 128 is an integer of up to 13 bits
// (fp16 q has 11): two IMMAs per k32 step, combined in int32 (hi * 128 + lo), converted once and
// multiplied by the block's key scale; the softmax applies 1 / (c * f * 128) (Softmax::inv).
// Lane t supplies word 4j + t of its rows for k32 steps 2j (codes 0,2,.. / 8,10,..) and 2j + 1
// (codes 1,3,.. / 9,11,..): k32 step ks, k index kk (0..31) is channel k8_channel(ks, kk).
// With GROUP <= 4 the two query terms share one IMMA (kPairTerms), a head per lane: B column 2h is
// head h's hi term and 2h + 1 its lo term, so lane (g, t) holds both terms of head t for its two
// token rows and adds them itself; half the IMMAs, Q registers and integer accumulators, and each
// lane runs the softmax of one head (4 scores a stage, no lane repeating another's). After the
// transpose, lane (g, t)'s P^T column g is head g / 2 for the tile's token rows 0..7 (g even) or
// 8..15 (g odd) and the other register of its B pair is zero: output column 2h accumulates head h's
// rows 0..7 of each tile, column 2h + 1 its rows 8..15, under the head's one running max, and the
// CTA's combine adds the two columns. docs/fp2-kernel.md, "Head per lane".
constexpr int KS8 = D / 32;  // k32 steps
constexpr int WPJ = D / 64;  // words per lane per token row (one per pair of k32 steps)
constexpr int NTERM = kPairTerms ? 1 : 2;  // IMMAs per k32 step
constexpr int kScoreMagic = 0x4B400000;    // the bits of 1.5 * 2^23 (kPairTerms accumulators start there)
struct KeyOps {
  uint32_t qf[KS8][NTERM][2];  // [k32 step][hi, lo (kPairTerms: the lane's column's term)][b0, b1]
  uint32_t table;              // f L0..L3 as int8, bytes 0..3
  uint32_t magic[4];  // kScoreMagic (kept_constant): the C operand of each score chain's first IMMA
};
// The key scales of one token row (its NBK blocks) as fp32.
ZD_DEVICE void key_scales(const uint8_t* row, float (&sc)[NBK]) {
  if constexpr (SCALE_FMT == kScaleE4M3 && NBK == 2) {
    const uint32_t h2 = scales_to_half2<kScaleE4M3>(*reinterpret_cast<const uint16_t*>(row));  // one load, one cvt
    sc[0] = __low2float(u32_as_h2(h2));
    sc[1] = __high2float(u32_as_h2(h2));
  } else {
#pragma unroll
    for (int b = 0; b < NBK; ++b) sc[b] = scale_to_float<SCALE_FMT>(row[b]);
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
  float m[2], l[2];  // running max (log2 domain) and this lane's partial sum: heads 2t, 2t + 1
                     // (kPairTerms: [0] only, head t)
#if KEY_S8
  float inv[2];  // per head as m: 1 / (c_h * f * 128), turning the integer scores into log2 units
#endif
};

// The value side's loop constants: expand_word_e5m2's level table and its 0x04040404 (kept_constant).
struct ValueOps {
  uint32_t table, fours;
};

template <bool PARTIAL>
ZD_DEVICE void compute_stage(const Stage* st, int g, int t, uint32_t valid, const KeyOps& key, const ValueOps& val,
                             Softmax& sm, float (&oacc)[NKS][4]) {
  // ---- scores^T = K Q^T for NT tiles ------------------------------------------------------------
  float sacc[NT][4];
#if KEY_S8
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    uint32_t a[2][WPJ][4];  // [row half][word][register], expand_word_bytes' order
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = tok_of_row(g) + kRowStep8 * r;  // in tile 0
#pragma unroll
      for (int j = 0; j < WPJ; ++j) expand_word_bytes(*key_words(st, tok, 4 * j + t, i), key.table, a[r][j]);
    }
    int acc[NBK][NTERM][4];  // partial dot products per key scale block and query term
#pragma unroll
    for (int b = 0; b < NBK; ++b)
#pragma unroll
      for (int u = 0; u < NTERM; ++u)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[b][u][c] = kPairTerms ? int(key.magic[c]) : 0;
#pragma unroll
    for (int ks = 0; ks < KS8; ++ks) {
      const int j = ks >> 1, o = 2 * (ks & 1), b = 64 * j / K_BLOCK;
#pragma unroll
      for (int u = 0; u < NTERM; ++u)
        mma_s8(acc[b][u], a[0][j][o], a[1][j][o], a[0][j][o + 1], a[1][j][o + 1], key.qf[ks][u][0], key.qf[ks][u][1]);
    }
    // The column's 1 / (c f 128) is applied in the softmax (Softmax::inv).
    if constexpr (kPairTerms) {
      // c[2r], c[2r+1]: token row g + 8r, head t's hi and lo terms. Both started at kScoreMagic's
      // bits, so read as fp32 they are F = M + the partial, exactly (M = 1.5 * 2^23; |partial| <
      // 2^20 < 2^22). Per block, F_hi - (M + M / 128) = hi - M / 128 exactly (an integer below 2^21;
      // the constant, 12681216, is exact), and one fma with 128 and F_lo gives 128 hi - M + M + lo
      // = 128 hi + lo, rounded once (|.| < 2^27, as the two-IMMA path below), with no int-to-float
      // conversion on the ALU pipe and both constants immediates (a register constant is rebuilt
      // every stage); then times the block's scale.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sc[NBK];
        key_scales(st->ks + (tok_of_row(g) + 16 * i + kRowStep8 * r) * NBK, sc);
        float v = 0.f;
#pragma unroll
        for (int b = 0; b < NBK; ++b) {
          const float hi = __int_as_float(acc[b][0][2 * r]) - 12681216.f;
          const float x = fmaf(hi, 128.f, __int_as_float(acc[b][0][2 * r + 1]));
          v = b ? fmaf(x, sc[b], v) : x * sc[b];
        }
        sacc[i][r] = v;
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // c[2r], c[2r+1]: token row g + 8r, score columns 2t, 2t+1
        float sc[NBK];
        key_scales(st->ks + (tok_of_row(g) + 16 * i + kRowStep8 * r) * NBK, sc);
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
    if constexpr (PARTIAL) {
      const int tok0 = tok_of_row(g) + 16 * i, tok1 = tok0 + kRowStep8;
      if constexpr (kPairTerms) {  // sacc[i][r]: token row g + 8r
        if (!((valid >> tok0) & 1u)) sacc[i][0] = ZD_NEG_INF;
        if (!((valid >> tok1) & 1u)) sacc[i][1] = ZD_NEG_INF;
      } else {
        if (!((valid >> tok0) & 1u)) sacc[i][0] = sacc[i][1] = ZD_NEG_INF;
        if (!((valid >> tok1) & 1u)) sacc[i][2] = sacc[i][3] = ZD_NEG_INF;
      }
    }
  }
#else
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    uint32_t a[NKS][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = tok_of_row(g) + 16 * i + kRowStep8 * r;
      const uint32_t sbyte = st->ks[tok * NBK + (16 * t * WPL) / K_BLOCK];
      const __half2 s2 = u32_as_h2(scales_to_half2<SCALE_FMT>(sbyte * 0x0101u));
      const uint32_t t01 = h2_as_u32(__hmul2(u32_as_h2(key.kl01), s2));
      const uint32_t t23 = h2_as_u32(__hmul2(u32_as_h2(key.kl23), s2));
      const uint32_t* row = key_words(st, tok - 16 * i, t * WPL, i);  // WPL <= 2 words: one chunk
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
      const int tok0 = tok_of_row(g) + 16 * i, tok1 = tok0 + kRowStep8;
      if (!((valid >> tok0) & 1u)) sacc[i][0] = sacc[i][1] = ZD_NEG_INF;
      if (!((valid >> tok1) & 1u)) sacc[i][2] = sacc[i][3] = ZD_NEG_INF;
    }
  }
#endif

  // ---- online softmax (per head: lanes with equal t hold the same heads) -------------------------
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
  // pb[i][h]: P^T of tile i at token rows 2t + 8h, 2t + 8h + 1 of column g (the output MMA's B
  // registers). kPairTerms: one register holds rows 8 (g % 2) + 2t, + 1 of head g / 2 (both entries;
  // the output MMA's B pair is it and a zero, by g % 2, below).
  uint32_t pb[NT][2];
  static_assert(NT == 2, "two tiles a stage");
  if constexpr (kPairTerms) {
    float mx = fmaxf(fmaxf(sacc[0][0], sacc[0][1]), fmaxf(sacc[1][0], sacc[1][1]));
    // The first stage always votes (m = -inf); a stage always holds a valid token, so m is finite
    // from then on.
    if (__any_sync(0xffffffffu, mx * u[0] > sm.m[0] + kRescaleSlack)) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m0 = fmaxf(sm.m[0], mx * u[0]);
      const float al = ex2(sm.m[0] - m0);  // 0 on the first stage
      sm.l[0] *= al;
#pragma unroll
      for (int m = 0; m < NKS; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) oacc[m][c] *= al;
      sm.m[0] = m0;
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const float p0 = ex2(fmaf(sacc[i][0], u[0], -sm.m[0])), p1 = ex2(fmaf(sacc[i][1], u[0], -sm.m[0]));
      sm.l[0] += p0 + p1;
      pb[i][0] = pb[i][1] = movmatrix_trans(pack_half2(p0, p1));  // P^T[rows 8 (g % 2) + 2t, + 1][head g / 2]
    }
  } else {
    float mx[2] = {fmaxf(fmaxf(sacc[0][0], sacc[0][2]), fmaxf(sacc[1][0], sacc[1][2])),
                   fmaxf(fmaxf(sacc[0][1], sacc[0][3]), fmaxf(sacc[1][1], sacc[1][3]))};
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
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const float p0 = ex2(fmaf(sacc[i][0], u[0], -sm.m[0])), p1 = ex2(fmaf(sacc[i][1], u[1], -sm.m[1]));
      const float p2 = ex2(fmaf(sacc[i][2], u[0], -sm.m[0])), p3 = ex2(fmaf(sacc[i][3], u[1], -sm.m[1]));
      sm.l[0] += p0 + p2;
      sm.l[1] += p1 + p3;
      pb[i][0] = movmatrix_trans(pack_half2(p0, p1));  // P^T[rows 2t, 2t+1][head g]
      pb[i][1] = movmatrix_trans(pack_half2(p2, p3));  // P^T[rows 2t+8, 2t+9][head g]
    }
  }

#if V_QUAD
  // ---- out^T += V^T (P^T times the value scales) ----------------------------------------------
  // Quad layout (runtime/kv/pack.py): lane (g, t) reads the 16 (D = 64: 8) bytes of quad 4i + t that
  // hold its rows g and g + 8 of every M-tile for the quad's 4 tokens, and one expansion per word
  // gives the A registers directly (no byte interleave, no per-register scale multiply). The value
  // scales ride on P^T instead: pb[i][h] holds P^T at tokens 4t + 2h, 4t + 2h + 1 of the tile for
  // head g, times each value block's scales of those tokens (one HMUL2 per block and register);
  // M-tile m takes block 16m / V_BLOCK's copy.
  // pv[b][h]: P^T pair h of quad q times value block b's scales of its two tokens. The scale bytes
  // of quad q start at byte 4 NBV q of the stage's run (token j, block b at byte j * NBV + b).
  auto scaled_p = [&](const uint8_t* qbytes, int q, const uint32_t (&p)[2], uint32_t (&pv)[NBV][2]) {
    uint32_t qs[NBV];
#pragma unroll
    for (int x = 0; x < NBV; ++x) qs[x] = reinterpret_cast<const uint32_t*>(qbytes)[x];
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
        pv[0][h] = h2_as_u32(__hmul2(u32_as_h2(p[h]), u32_as_h2(e4m3x2_lo(both) & keep)));
        pv[1][h] = h2_as_u32(__hmul2(u32_as_h2(p[h]), u32_as_h2(e4m3x2_hi(both) & keep)));
      } else {
#pragma unroll
        for (int b = 0; b < NBV; ++b) {
          const int i0 = 2 * h * NBV + b, i1 = i0 + NBV;  // bytes of tokens 2h, 2h + 1 of the quad
          const uint32_t pair = prmt(qs[i0 >> 2], qs[i1 >> 2], (i0 & 3) | (((i1 & 3) + 4) << 4));
          const uint32_t s2 = value_scales_to_half2<SCALE_FMT>(pair) & keep;
          pv[b][h] = h2_as_u32(__hmul2(u32_as_h2(p[h]), u32_as_h2(s2)));
        }
      }
    }
  };
  // kPairTerms: the B pair of the output MMA is (x, 0) for even g, (0, x) for odd g: x times the
  // lane's half2 masks (1 or 0), HMUL2 on the FMA pipes rather than selects on the ALU pipe.
  const uint32_t keep0 = (g & 1) ? 0u : 0x3c003c00u, keep1 = 0x3c003c00u ^ keep0;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    uint32_t pv[NBV][2];
    if constexpr (kPairTerms) {
      // x holds quad t's tokens 2 (g % 2), 2 (g % 2) + 1: only their scales are read and converted.
      const int hs = g & 1;
      const uint8_t* pair = st->vs + 4 * NBV * t + 16 * NBV * i + 2 * NBV * hs;  // token 2 hs, then 2 hs + 1
      uint32_t keep = 0xffffffffu;
      if constexpr (PARTIAL) {  // as in scaled_p
        const int ta = 4 * (4 * i + t) + 2 * hs;
        keep = (((valid >> ta) & 1u) ? 0x0000ffffu : 0u) | (((valid >> (ta + 1)) & 1u) ? 0xffff0000u : 0u);
      }
      uint32_t s2[NBV];
      if constexpr (SCALE_FMT == kScaleE4M3 && NBV == 2) {
        const uint32_t both = prmt(*reinterpret_cast<const uint32_t*>(pair), 0u, 0x3120);
        s2[0] = e4m3x2_lo(both) & keep;
        s2[1] = e4m3x2_hi(both) & keep;
      } else {
        constexpr int NW = (2 * NBV + 3) / 4;  // words holding the pair's 2 NBV bytes
        uint32_t qs[NW];
        if constexpr (NBV == 1) {
          qs[0] = *reinterpret_cast<const uint16_t*>(pair);
        } else {
#pragma unroll
          for (int x = 0; x < NW; ++x) qs[x] = reinterpret_cast<const uint32_t*>(pair)[x];
        }
#pragma unroll
        for (int b = 0; b < NBV; ++b) {
          const int i0 = b, i1 = NBV + b;
          s2[b] = value_scales_to_half2<SCALE_FMT>(prmt(qs[i0 >> 2], qs[i1 >> 2], (i0 & 3) | (((i1 & 3) + 4) << 4))) & keep;
        }
      }
#pragma unroll
      for (int b = 0; b < NBV; ++b) {
        const __half2 y = __hmul2(u32_as_h2(pb[i][0]), u32_as_h2(s2[b]));
        pv[b][0] = h2_as_u32(__hmul2(y, u32_as_h2(keep0)));
        pv[b][1] = h2_as_u32(__hmul2(y, u32_as_h2(keep1)));
      }
    } else {
      // offsets written as the lane's part plus tile i's, which then is an immediate
      scaled_p(st->vs + 4 * NBV * t + 16 * NBV * i, 4 * i + t, pb[i], pv);
    }
    uint32_t w[D / 32];  // the lane's words of the quad (chunk moved by v_chunk)
    if constexpr (D == 128) {
      const uint4 x = *reinterpret_cast<const uint4*>(st->vc + 4 * (8 * t + (g ^ (2 * t))) + 128 * i);  // chunk 8q + (g ^ 2t)
      w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(st->vc + 4 * (4 * t + ((g >> 1) ^ (t & 2))) + 2 * (g & 1) + 64 * i);
      w[0] = x.x, w[1] = x.y;
    }
#pragma unroll
    for (int k = 0; k < D / 32; ++k) {
      // word k, field f: M-tile 2k + f / 2, row g + 8 (f % 2); bytes 0-1 are k pair (2t, 2t+1),
      // bytes 2-3 k pair (2t+8, 2t+9), and expand_word_e5m2 gives field f of bytes 0-1 at e[2f],
      // of bytes 2-3 at e[2f + 1]. Each word's two M-tiles are multiplied right after it is expanded.
      uint32_t e[8];
      expand_word_e5m2(w[k], val.table, val.fours, e);
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
    uint32_t pt[2];  // P^T of tile i (kPairTerms: the lane's register and a zero, by g % 2)
    if constexpr (kPairTerms) {
      const uint32_t keep0 = (g & 1) ? 0u : 0x3c003c00u, keep1 = 0x3c003c00u ^ keep0;
      pt[0] = h2_as_u32(__hmul2(u32_as_h2(pb[i][0]), u32_as_h2(keep0)));
      pt[1] = h2_as_u32(__hmul2(u32_as_h2(pb[i][0]), u32_as_h2(keep1)));
    } else {
      pt[0] = pb[i][0];
      pt[1] = pb[i][1];
    }
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
        expand_word_e5m2(prmt(wa, wb, 0x5140), val.table, val.fours, e);  // word channels 0..7
#pragma unroll
        for (int j = 0; j < 8; ++j) v[pr][0][j] = h2_as_u32(__hmul2(u32_as_h2(e[j]), s2));
        expand_word_e5m2(prmt(wa, wb, 0x7362), val.table, val.fours, e);  // word channels 8..15
#pragma unroll
        for (int j = 0; j < 8; ++j) v[pr][1][j] = h2_as_u32(__hmul2(u32_as_h2(e[j]), s2));
      } else {
        const uint32_t wa = st->vc[ta * WPR + (g >> 1)], wb = st->vc[tb * WPR + (g >> 1)];
        uint32_t e[8];
        expand_word_e5m2(prmt(wa, wb, (g & 1) ? 0x7362 : 0x5140), val.table, val.fours, e);
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
      mma_f16(oacc[m], a, pt[0], pt[1]);
    }
  }
#endif
}

}  // namespace
