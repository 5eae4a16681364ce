// Split-KV FP2 decode attention: one query token per sequence, all query heads of a KV-head group
// in one CTA, codes expanded in registers right before tensor-core MMA: values to fp16 (mma.sync
// m16n8k16), keys to fp16 or, with KEY_S8, to int8 (mma.sync m16n8k32 s8, scales after the MMA).
//
// Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv query heads per kv head (<= 8),
// D head dim (64 | 128), P page size (tokens, multiple of 32), S splits per sequence,
// NBK / NBV = D / K_BLOCK / D / V_BLOCK scale blocks per token.
//
// One launch does the whole attention. A row is one (sequence b, KV head h): S split CTAs over its
// FP2 tokens and one bf16 CTA over its sinks and tail each write a partial, and the last of them
// to finish merges the row's partials and normalises (attn_fp2_decode_merge.cuh). Split CTA s of
// the row covers FP2 tokens [s * split_tokens, ...) of its [0, fp2_len), in stages of 32
// tokens (never across a page: P % 32 == 0); warp w takes stages w, w + NUM_WARPS, ... through
// its own STAGES-deep cp.async ring, so the main loop needs no block barrier. Each warp keeps an
// online softmax per head; at the end the warps are combined through shared memory and the CTA
// writes its unnormalised partial output and (max, sum) to the split workspace.
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
#ifndef TIMELINE
#define TIMELINE 0  // 1: thread 0 of each CTA stamps %globaltimer into `timeline` (see below)
#endif

// TIMELINE builds (benchmarks/attention_timeline.py): row i of `timeline` [grid, 12] uint64 is CTA
// i's %globaltimer (ns) at start (0), stage 0 landed (1), main loop done (2), partial written (3),
// finish_row done (4, the merge included for the row's last CTA), its SM (5), its kind (6: 1 a
// split with work, 2 the bf16 CTA, 0 a split without work), the stages its warp 0 computed (7),
// its count done (8), and for the CTA that merges: the weights computed and the early partials
// landed (9), the early partials summed (10). Other builds never touch it.
#include "attn_fp2_common.cuh"
constexpr int kTimelineCols = 12;
#if TIMELINE
#define ZD_STAMP(i, v)                                                                \
  do {                                                                                \
    if (threadIdx.x == 0) timeline[size_t(blockIdx.x) * kTimelineCols + (i)] = (v);   \
  } while (0)
ZD_DEVICE unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
ZD_DEVICE unsigned long long sm_id() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}
#else
#define ZD_STAMP(i, v) \
  do {                 \
  } while (0)
#endif

// The stage (layout, permutations, copies) and its computation, split out for size.
#include "attn_fp2_decode_stage.cuh"
#include "attn_fp2_decode_compute.cuh"
#include "attn_fp2_decode_merge.cuh"

// q        [B, Hq, D] fp32 (stored key space: rotated, anchor-folded); q_scale = softmax_scale * log2(e)
// k_codes  page pool [NP, Hkv, P, D/16] of key code words, dense: page p, kv head h, slot j is pool
//          row (p * Hkv + h) * P + j, at k_codes + row * D/16 (words); NP * Hkv * P < 2^32
// k_scales [NP, Hkv, P, NBK] key scale bytes, dense: row's at k_scales + row * NBK
// v_codes / v_scales: the same for values
// levels   [8] fp32: 4 key levels then 4 value levels (fp16-exact)
// block_table [B, bt_stride] int32 page ids over FP2 token index (token f in page f / P, slot f % P)
// fp2_len  [B] int32: each sequence attends its FP2 tokens [0, fp2_len)
// o_part   [B, Hq, max_splits, D] fp32 unnormalised partial outputs (V channels in stored order);
//          slots 0..S-1 the FP2 splits, slot S the bf16 tokens (max_splits > S)
// ml_part  [B, Hq, max_splits, 2] fp32 (running max in log2 units, sum of exponentials)
// hp_k / hp_v: bf16, token j of seq b, kv head h at + hp_slot[b] * hp_b_stride + h * hp_h_stride + j * D
// hp_len   [B]: bf16 tokens of each sequence (rows 0..hp_len-1, at most hp_max); hp_slot [B]: its row
// row_done [B, Hkv] int32, zero between launches: partials counted per row (finish_row)
// out      [B, Hq, D] fp32, normalised (stored value space)
// timeline [grid, 12] uint64 or null: TIMELINE builds only (above)
// new_k, new_v  [B, Hkv, D] bf16 or null: the step's new tokens (stored space), which the engine
//          writes into the regions after this kernel (kernels/kv_write.py `PendingAppend`); then
//          hp_len counts them (the lengths after the write) and each row's bf16 CTA reads its new
//          token from here and its tail as the last step left it: new_index [5, B] int64
//          (StaticDecodeIndex) row 2 says where the write will flush, i.e. drop the oldest tail
//          row (attended as FP2 by the splits), new_sinks the sinks (PendingRow)
// grid ((S + 1) * Hkv * B) in one dimension, the FP2 CTAs first: CTA i < S * Hkv * B is split
// i % S of row i / S (row = b * Hkv + kvh), the rest are the rows' bf16 CTAs. CTAs start in index
// order, so the short bf16 CTAs take the slots the splits leave and never delay a split.
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32, MIN_BLOCKS)
    attn_fp2_decode(const float* __restrict__ q, float q_scale, const uint32_t* __restrict__ k_codes,
                    const uint8_t* __restrict__ k_scales, const uint32_t* __restrict__ v_codes,
                    const uint8_t* __restrict__ v_scales, const float* __restrict__ levels,
                    const int32_t* __restrict__ block_table, int bt_stride, int page_size,
                    const int32_t* __restrict__ fp2_len, int split_tokens,
                    int num_splits, int num_kv_heads, int max_splits, float* __restrict__ o_part,
                    float* __restrict__ ml_part, const __nv_bfloat16* __restrict__ hp_k,
                    const __nv_bfloat16* __restrict__ hp_v, const int32_t* __restrict__ hp_len,
                    const int32_t* __restrict__ hp_slot, long long hp_b_stride, long long hp_h_stride, int hp_max,
                    int* __restrict__ row_done, float* __restrict__ out, unsigned long long* __restrict__ timeline,
                    const __nv_bfloat16* __restrict__ new_k, const __nv_bfloat16* __restrict__ new_v,
                    const long long* __restrict__ new_index, int new_sinks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ZD_STAMP(0, globaltimer());
  ZD_STAMP(5, sm_id());
  const int num_q_heads = num_kv_heads * GROUP;
  const int fp2_ctas = gridDim.x / (num_splits + 1) * num_splits;  // S CTAs of each of the B * Hkv rows
  const bool bf16_cta = int(blockIdx.x) >= fp2_ctas;
  const int row = bf16_cta ? blockIdx.x - fp2_ctas : blockIdx.x / num_splits;
  const int kvh = row % num_kv_heads, b = row / num_kv_heads;
  const int hi = fp2_len[b];
  const size_t head0 = size_t(b) * num_q_heads + kvh * GROUP;  // the row's first query head
  // The row's bookkeeping for finish_row, derived again where it is used rather than kept in
  // registers across the main loop (the length is read again through L2, so the compiler cannot
  // keep the first read alive instead).
  auto finish = [&](int row) {
    const int hi = __ldcg(fp2_len + row / num_kv_heads);
    const size_t head0 = size_t(row) * GROUP;  // == b * Hq + kvh * G
    const int n_need = (hi + split_tokens - 1) / split_tokens;  // splits the sequence needs
    // the FP2 CTAs of the row with work (n_run) and its bf16 CTA count themselves; the last merges
    finish_row(row_done + row, min(n_need, num_splits), n_need > num_splits, num_splits,
               RowPartials{o_part + head0 * max_splits * D, ml_part + head0 * max_splits * 2, max_splits},
               out + head0 * D, reinterpret_cast<float*>(smem_raw), timeline);
  };
  if (bf16_cta) {
    const long long slot = hp_slot[b];
    const int n_hp = hp_len[b];
    PendingRow pending{nullptr, nullptr, 0, 0};
    if (new_k != nullptr) {
      const int B = gridDim.x / ((num_splits + 1) * num_kv_heads);
      const size_t tok = (size_t(b) * num_kv_heads + kvh) * D;
      pending = PendingRow{new_k + tok, new_v + tok, new_sinks, new_index[2 * B + b] != 0};
    }
    bf16_partial(q + head0 * D, q_scale, hp_k + slot * hp_b_stride + kvh * hp_h_stride,
                 hp_v + slot * hp_b_stride + kvh * hp_h_stride, min(n_hp, hp_max),
                 RowPartials{o_part + head0 * max_splits * D, ml_part + head0 * max_splits * 2, max_splits},
                 num_splits, reinterpret_cast<float*>(smem_raw), pending);
    ZD_STAMP(3, globaltimer());
    ZD_STAMP(6, 2);
    finish(row);
    ZD_STAMP(4, globaltimer());
    return;
  }
  const int split = blockIdx.x % num_splits;
  const int r_lo = split * split_tokens;
  const int r_hi = min(hi, r_lo + split_tokens);
  // The prologue's dependent loads: (fp2_len, the query, the levels) -> the block table's pool
  // rows -> the first stages' copies, three round trips to memory before the first stage is
  // computed. The query and the levels do not depend on the length, so they are read raw before
  // anything waits for it, and the test of an empty split comes after the block-table prefetch.
  // (Before stop 38, the query waited for the range the kernel read then, the levels for the
  // query's shuffles and the table for both: five round trips, by the SASS order. Reading the
  // table before the length, so that the two share a round trip, timed the same: docs/
  // benchmarks.md, stop 45.)
  const bool no_work = r_lo >= r_hi;  // not counted: split >= n_run
  const int num_stages = no_work ? 0 : (r_hi - r_lo + TOK - 1) / TOK;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  // The warp's ring at an offset the compiler cannot fold into the slot's (opaque): else NVVM
  // writes the key loads' stage address as ring + slot and the other loads' as smem_raw + (warp *
  // STAGES + slot) * sizeof(Stage), and ptxas computes both every stage.
  Stage* ring = reinterpret_cast<Stage*>(smem_raw + opaque(warp * STAGES * uint32_t(sizeof(Stage))));

  float lv[8];  // 4 key levels, then 4 value levels
#pragma unroll
  for (int i = 0; i < 8; ++i) lv[i] = levels[i];
  // The lane's query channels, raw, in the order the query block reads them: issued before the
  // block-table prefetch, whose addresses wait for fp2_len, so the two overlap. (Every lane
  // reads a real head's row; the padding columns are zeroed below.)
  // B column g: head g, or (kPairTerms) head g / 2's term g % 2 (hi, lo)
  const int qhead = kPairTerms ? (g >> 1) : g;
  const float* qh = q + (head0 + min(qhead, GROUP - 1)) * D;
#if KEY_S8
  float qraw[KS8][2][4];
#pragma unroll
  for (int ks = 0; ks < KS8; ++ks)
#pragma unroll
    for (int hl = 0; hl < 2; ++hl)
#pragma unroll
      for (int e = 0; e < 4; ++e) qraw[ks][hl][e] = qh[k8_channel(ks, 16 * hl + 4 * t + e)];
#else
  float qraw[NKS][2][2];
#pragma unroll
  for (int ks = 0; ks < NKS; ++ks)
#pragma unroll
    for (int hl = 0; hl < 2; ++hl)
#pragma unroll
      for (int e = 0; e < 2; ++e) qraw[ks][hl][e] = qh[k_channel(ks, 8 * hl + 2 * t + e)];
#endif
  // Pool rows of the warp's stages, prefetched 32 stages at a time: lane l of `rows_cur` holds the
  // pool row (page * Hkv + kvh) * P + slot of the first token of the warp's local stage 32c + l
  // (chunk c), `rows_next` those of chunk c + 1. Reading the block table right before each
  // cp.async would stall the warp on a dependent global load (an L2 round trip) every stage, and
  // the integer division by page_size costs ~25 instructions: both now happen once per chunk.
  const int32_t* bt = block_table + size_t(b) * bt_stride;
  const uint32_t head_rows = uint32_t(kvh) * page_size, page_rows = uint32_t(num_kv_heads) * page_size;
  auto load_rows = [&](int chunk) -> uint32_t {
    const int si = warp + (32 * chunk + lane) * NUM_WARPS;
    const int f = r_lo + si * TOK;  // first token of the stage
    return si < num_stages ? uint32_t(bt[f / page_size]) * page_rows + head_rows + f % page_size : 0u;
  };
  uint32_t rows_cur = load_rows(0), rows_next = load_rows(1);

  // Q^T fragments (B operand): column g's head `qhead` (columns of heads >= GROUP multiply zeros),
  // channels in the permuted K order.
  KeyOps key;
  Softmax sm;  // the query block below sets its inv (KEY_S8)
  sm.m[0] = sm.m[1] = ZD_NEG_INF;
  sm.l[0] = sm.l[1] = 0.f;
  {
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
          x[ks][hl][e] = live ? qraw[ks][hl][e] * q_scale : 0.f;
          mx = fmaxf(mx, fabsf(x[ks][hl][e]));
        }
#pragma unroll
    // one scale per head (lanes 4g..4g+3 hold column g's head's channels): a head much smaller than
    // the group's largest keeps its own 13 bits
    for (int off = 1; off < 4; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    // c = 2^(5 - floor(log2 mx)), the exponent held inside [-100, 100] so that c and 1 / (c f 128)
    // stay normal fp32 (a head below 2^-100 rounds to zero terms: it adds nothing to any score)
    const int ex = mx > 0.f ? min(max(int((__float_as_uint(mx) >> 23) & 0xFFu) - 127, -100), 100) : 0;
    const float c = __uint_as_float(uint32_t(127 + 5 - ex) << 23);
    const bool wide = fmaxf(fabsf(lv[0]), fabsf(lv[3])) >= 2.f;  // f = 32 instead of 64
    const float f = wide ? 32.f : 64.f;
    const float inv = __uint_as_float(uint32_t(127 - 5 - (wide ? 12 : 13) + ex) << 23);  // 1 / (c f 128)
    // The lane's softmax heads 2t, 2t + 1 (kPairTerms: head t, [0] only) have their c in lanes 8t
    // and 8t + 4 (column 2t, 2t + 1; with paired terms both head t's).
    sm.inv[0] = __shfl_sync(0xffffffffu, inv, 8 * t);
    sm.inv[1] = kPairTerms ? 0.f : __shfl_sync(0xffffffffu, inv, 8 * t + 4);
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
          key.qf[ks][0][hl] = g & 1 ? wlo : whi;
        } else {
          key.qf[ks][0][hl] = whi;
          key.qf[ks][NTERM - 1][hl] = wlo;
        }
      }
#pragma unroll
    for (int c = 0; c < 4; ++c) key.magic[c] = kept_constant(kScoreMagic, lv[c]);  // an IMMA's C: a register quad
    key.table = s8_byte(lv[0] * f) | (s8_byte(lv[1] * f) << 8) | (s8_byte(lv[2] * f) << 16) |
                (s8_byte(lv[3] * f) << 24);
#else
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks) {
#pragma unroll
      for (int hl = 0; hl < 2; ++hl) {
        const float x0 = live ? qraw[ks][hl][0] * q_scale : 0.f;
        const float x1 = live ? qraw[ks][hl][1] * q_scale : 0.f;
        key.qf[ks][hl] = pack_half2(x0, x1);
      }
    }
    key.kl01 = pack_half2(lv[0], lv[1]);
    key.kl23 = pack_half2(lv[2], lv[3]);
#endif
  }
  // Value levels as the high bytes of their fp16 (e5m2-exact by the format).
  const uint32_t vl01 = pack_half2(lv[4], lv[5]), vl23 = pack_half2(lv[6], lv[7]);
  const ValueOps val{prmt(vl01, vl23, 0x7531), kept_constant(0x04040404u, lv[4])};

  if (no_work) {  // the whole CTA: nothing above waits on another warp
    ZD_STAMP(6, 0);
    return;
  }
  // The warp's local stages: j = 0 .. my_stages - 1 is global stage warp + j * NUM_WARPS.
  const uint32_t my_stages = num_stages > warp ? uint32_t(num_stages - warp + NUM_WARPS - 1) / NUM_WARPS : 0u;
  // Issue the copies of local stage j into `slot` (none past the warp's last stage: the copies are
  // predicated). Its pool row is lane j % 32 of rows_cur: the caller keeps j inside the current chunk.
  // The pools are dense, so a stage's four runs start at its pool row times the row's words or
  // bytes: one wide multiply-add onto the lane's fixed pointer per run.
  const CopyPlan plan = copy_plan(lane);
  const uint32_t ring_addr = smem_addr(ring);
  const uint32_t* kc_lane = pinned(k_codes + 4 * lane);
  const uint32_t* vc_lane = pinned(v_codes + 4 * lane);
  // Equal scale rows (NBK == NBV): the lanes past the key scales' copy the value scales through
  // ks_lane (load_stage: one copy instruction a lane for both runs).
  constexpr int KSC = TOK * NBK / 16;  // lanes with a key scale chunk
  const uint8_t* ks_lane = pinned(NBK == NBV && lane >= KSC ? v_scales + 16 * (lane - KSC) : k_scales + 16 * lane);
  const uint8_t* vs_lane = pinned(v_scales + 16 * lane);
  auto issue = [&](uint32_t j, uint32_t slot) {
    const uint32_t row = __shfl_sync(0xffffffffu, rows_cur, j & 31);
    load_stage(j < my_stages, ring_addr + slot * uint32_t(sizeof(Stage)), lane, plan, kc_lane + size_t(row) * WPR,
               vc_lane + size_t(row) * WPR, ks_lane + size_t(row) * NBK, vs_lane + size_t(row) * NBV);
    cp_async_commit();  // empty groups keep the wait count uniform
  };

  float oacc[NKS][4];
#pragma unroll
  for (int m = 0; m < NKS; ++m) oacc[m][0] = oacc[m][1] = oacc[m][2] = oacc[m][3] = 0.f;

  // A stage is full (no token at or past r_hi) iff its first token f0 has f0 <= r_hi - TOK: one
  // unsigned compare against full_n (0: no full stage).
  const uint32_t full_n = uint32_t(max(r_hi - TOK + 1, 0));
  // Local stage k sits in ring slot k % STAGES. The prologue fills slots 0 .. STAGES - 2 from chunk
  // 0; then stage k is computed while stage k + STAGES - 1 is issued. The loop runs in pieces: piece
  // c computes the stages whose issue falls in chunk c (k + STAGES - 1 < 32 (c + 1)), so the row
  // chunks advance between pieces rather than by a test at every stage.
  static_assert(STAGES <= 32, "the prologue stays inside the first row chunk");
#pragma unroll
  for (uint32_t k = 0; k < STAGES - 1; ++k) issue(k, k);
  uint32_t k = 0;
  // Local stage k's first token, advanced with k rather than recomputed from it (three
  // instructions a stage fewer).
  uint32_t f0 = uint32_t(r_lo + warp * TOK);
  for (uint32_t chunk_end = 32;; chunk_end += 32) {
    const uint32_t piece_end = min(my_stages, chunk_end - (STAGES - 1));
    for (; k < piece_end; ++k, f0 += NUM_WARPS * TOK) {
      cp_async_wait<STAGES - 2>();  // stage k has landed (this lane's copies) ...
      __syncwarp();                 // ... and every lane's; slot (k-1) % STAGES is free again
      if (k == 0) ZD_STAMP(1, globaltimer());
      issue(k + STAGES - 1, (k + STAGES - 1) % STAGES);
      const Stage* st = ring + k % STAGES;
      if (f0 < full_n) {
        compute_stage<false>(st, g, t, 0xffffffffu, key, val, sm, oacc);
      } else {
        const int z = min(r_hi - int(f0), TOK);  // valid tokens [0, z) of the stage
        const uint32_t valid = z >= 32 ? 0xffffffffu : ((1u << z) - 1u);
        compute_stage<true>(st, g, t, valid, key, val, sm, oacc);
      }
    }
    if (k >= my_stages) break;
    rows_cur = rows_next;  // the next piece's issues are in the next chunk
    rows_next = load_rows(chunk_end / 32 + 1);
  }
  cp_async_wait<0>();
  ZD_STAMP(2, globaltimer());
  ZD_STAMP(7, k);

  // ---- combine the warps of the CTA ---------------------------------------------------------
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    sm.l[0] += __shfl_xor_sync(0xffffffffu, sm.l[0], off);
    if constexpr (!kPairTerms) sm.l[1] += __shfl_xor_sync(0xffffffffu, sm.l[1], off);  // kPairTerms: one head a lane
  }
  __syncthreads();  // every warp is done with its ring: reuse the shared memory
  float* red_m = reinterpret_cast<float*>(smem_raw);  // [NUM_WARPS, 8]
  float* red_l = red_m + NUM_WARPS * 8;              // [NUM_WARPS, 8]
  float* red_o = red_l + NUM_WARPS * 8;              // [NUM_WARPS, 8, D]
  if (g == 0) {  // kPairTerms: columns 2t and 2t + 1 are head t's, one (m, l), kept at column 2t
#pragma unroll
    for (int c = 0; c < (kPairTerms ? 1 : 2); ++c) {
      red_m[warp * 8 + 2 * t + c] = sm.m[c];
      red_l[warp * 8 + 2 * t + c] = sm.l[c];
    }
  }
#pragma unroll
  for (int m = 0; m < NKS; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int col = 2 * t + (c & 1), ch = v_channel(g, c >> 1, m);
      red_o[(warp * 8 + col) * D + ch] = oacc[m][c];
    }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GROUP * D; idx += NUM_WARPS * 32) {
    const int head = idx / D, ch = idx % D;
    const int col = kPairTerms ? 2 * head : head;  // kPairTerms: columns 2 head, 2 head + 1
    float mx = ZD_NEG_INF;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, red_m[w * 8 + col]);
    float o = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float wt = ex2(red_m[w * 8 + col] - mx);  // 0 for warps that saw no stage
      if constexpr (kPairTerms) {  // the head's token rows 0..7 and 8..15 of each tile, one max
        o += wt * (red_o[(w * 8 + col) * D + ch] + red_o[(w * 8 + col + 1) * D + ch]);
      } else {
        o += wt * red_o[(w * 8 + col) * D + ch];
      }
      l += wt * red_l[w * 8 + col];
    }
    const size_t slot = (size_t(blockIdx.x / num_splits) * GROUP + head) * max_splits + blockIdx.x % num_splits;
    o_part[slot * D + ch] = o;
    if (ch == 0) {
      ml_part[slot * 2] = mx;
      ml_part[slot * 2 + 1] = l;
    }
  }
  ZD_STAMP(3, globaltimer());
  ZD_STAMP(6, 1);
  finish(blockIdx.x / num_splits);
  ZD_STAMP(4, globaltimer());
}
