// Part of attn_fp2_decode.cu, included after its configuration macros (not a standalone header):
// what a pipeline stage is and where its bytes sit. The stage layout in shared memory, the token,
// chunk and channel permutations that keep the shared-memory reads free of bank conflicts, and
// the per-lane copies that fill a stage. docs/fp2-kernel.md, "Decode kernel" and "Quad value layout".
#pragma once
#include "attn_fp2_common.cuh"

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
// those rows (4- and 8-byte loads alike) fall in distinct bank groups. (A lane-major run for int8
// keys, conflict-free by construction and 8 instructions a stage shorter, measured 16% slower at
// L = 128k: docs/fp2-kernel.md, "Stage addressing and the half softmax".)
ZD_DEVICE constexpr int k_chunk(int c) {
  if constexpr (!V_QUAD) return c;
  if constexpr (D == 128) {
    const int x = (c >> 3) & 3;  // rows 4x..4x+3 of an 16-row tile: chunk XOR 0, 4, 1, 5
    return c ^ (((x & 1) << 2) | (x >> 1));
  }
  return c ^ (((c >> 3) & 1) << 1);  // D = 64: one chunk per row
}
// Shared-memory index of key code word w of stage token tok.
ZD_DEVICE constexpr int k_word(int tok, int w) { return 4 * k_chunk(tok * (WPR / 4) + (w >> 2)) + (w & 3); }
// k_chunk permutes chunks only inside each 16 rows' chunks, by bits below those that number the
// groups of 16 rows, so token tok + 16 i's words sit kTileWords * i after token tok's.
constexpr int kTileWords = 16 * WPR;
__device__ constexpr bool tiles_at_fixed_offsets() {
  for (int tok = 0; tok < 16; ++tok)
    for (int w = 0; w < WPR; ++w)
      for (int i = 0; i < TOK / 16; ++i)
        if (k_word(tok + 16 * i, w) != k_word(tok, w) + kTileWords * i) return false;
  return true;
}
static_assert(tiles_at_fixed_offsets(), "key_words reaches tile i by a fixed offset");

// Word w of stage token tok + 16 i in the key run (tok in the first 16 tokens): addressed in bytes
// from tok's word, so that the compiler keeps one lane offset per (tok, w) across the loop and
// reaches tile i by an immediate in the load (a word index scaled per load costs an IMAD each).
ZD_DEVICE const uint32_t* key_words(const Stage* st, int tok, int w, int i) {
  const char* run = reinterpret_cast<const char*>(st->kc);
  return reinterpret_cast<const uint32_t*>(run + 4 * k_word(tok, w) + 4 * kTileWords * i);
}

// Row step of an MMA half-tile: score row g + 8 is token tok_of_row(g) + kRowStep8 (both orders).
constexpr int kRowStep8 = V_QUAD ? 2 : 8;

// Shared-memory place of 16-byte chunk c of a stage's value run. V_QUAD: quad q's chunk k (lane
// group g's words: k = g at D = 128, g / 2 at D = 64) moves to k ^ 2(q % 4) (D = 64: k ^ (q & 2)),
// so that the lanes of one load phase, which read the same k of four quads, hit distinct banks.
ZD_DEVICE constexpr int v_chunk(int c) {
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


// Byte offsets of a stage's parts (the layout of Stage).
constexpr uint32_t kOffKc = 0, kOffVc = 4 * TOK * WPR, kOffKs = 8 * TOK * WPR, kOffVs = kOffKs + TOK * NBK;
constexpr int kCodeChunks = TOK * WPR / 4 / 32;  // 16-byte chunks of each code run per lane (2, or 1 at D = 64)
static_assert(kOffVs + TOK * NBV == sizeof(Stage), "Stage layout");

// Where a lane's copies land in a stage: chunks lane + 32x of the key and value code runs, placed by
// k_chunk / v_chunk, and chunk `lane` of the scale runs; fixed for the CTA. Both permutations move
// only the low bits of a chunk inside its own 32 chunks (k_chunk: bits 0-2 by bits 3-4; v_chunk:
// a quad's chunks by the quad's index mod 4), so chunk lane + 32x lands 512x bytes after chunk
// `lane`: one offset per run, and the other copies' places are immediates in the copy instruction.
__device__ constexpr bool copies_at_fixed_offsets() {
  for (int lane = 0; lane < 32; ++lane)
    for (int x = 0; x < kCodeChunks; ++x)
      if (k_chunk(lane + 32 * x) != k_chunk(lane) + 32 * x || v_chunk(lane + 32 * x) != v_chunk(lane) + 32 * x)
        return false;
  return true;
}
static_assert(copies_at_fixed_offsets(), "load_stage places chunk lane + 32x by a fixed offset");
struct CopyPlan {
  uint32_t kc, vc;  // byte offsets in a Stage of chunk `lane` of the key and value code runs
};
ZD_DEVICE CopyPlan copy_plan(int lane) {
  return CopyPlan{kOffKc + 16 * uint32_t(k_chunk(lane)), kOffVc + 16 * uint32_t(v_chunk(lane))};
}

// Fill one stage if `live`: 32 tokens of K and V codes plus their scales (a page holds whole
// stages). `dst` is the stage's shared address; kc / vc point at the lane's first chunk (chunk
// `lane`) of the stage's code runs, ks / vs at chunk `lane` of its scale runs (copied by the lanes
// that have one; with NBK == NBV, ks at the lane's chunk of the two runs back to back). The copies
// are predicated, not branched around: a branch costs the loop a reconvergence pair a stage.
ZD_DEVICE void load_stage(bool live, uint32_t dst, int lane, const CopyPlan& cp, const uint32_t* kc,
                          const uint32_t* vc, const uint8_t* ks, const uint8_t* vs) {
  const uint32_t k_dst = dst + cp.kc, v_dst = dst + cp.vc, s_dst = dst + 16 * lane;
#pragma unroll
  for (int x = 0; x < kCodeChunks; ++x) {
    cp_async16_ca_if(live, k_dst + 512 * x, kc + 128 * x);  // chunk lane + 32x: 512 bytes further
    cp_async16_ca_if(live, v_dst + 512 * x, vc + 128 * x);
  }
  if constexpr (NBK == NBV) {
    // One copy a lane: the first TOK NBK / 16 lanes a key scale chunk, the next as many a value
    // scale chunk (the caller points their ks there), which lands right after the key run's end.
    static_assert(kOffVs == kOffKs + TOK * NBK && 2 * (TOK * NBK / 16) <= 32, "scale runs in one copy");
    cp_async16_ca_if(live && lane < 2 * (TOK * NBK / 16), s_dst + kOffKs, ks);
  } else {
    cp_async16_ca_if(live && lane < TOK * NBK / 16, s_dst + kOffKs, ks);
    cp_async16_ca_if(live && lane < TOK * NBV / 16, s_dst + kOffVs, vs);
  }
}

}  // namespace
