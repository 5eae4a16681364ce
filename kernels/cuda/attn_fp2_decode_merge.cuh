// Part of attn_fp2_decode.cu, included after its configuration macros and attn_fp2_decode_stage.cuh
// (not a standalone header): the two jobs of a decode row (one sequence, one KV head) besides its
// FP2 splits. The row's bf16 CTA (after all the splits in the grid) attends over the sinks and the
// not yet quantized tail and writes its partial like a split; the last of the row's CTAs to finish
// merges every partial and normalises. docs/fp2-kernel.md, "Split plan and merge".
//
// Shape legend as in attn_fp2_decode.cu; n_run = FP2 CTAs of the row that have work, S = the
// grid's FP2 splits; the row's partials sit in slots 0..n_run-1 (FP2) and S (bf16) of o_part /
// ml_part. Everything is in the stored space of the cache and in log2 units (q times q_scale).
#pragma once
#include <cuda_bf16.h>

#include "attn_fp2_decode_stage.cuh"

namespace {

using namespace zd;

constexpr int kThreads = NUM_WARPS * 32;
constexpr int kHpChunk = 64;  // bf16 tokens staged per round (bf16_partial)

// Where a row's partials are: o_part [B, Hq, max_splits, D] and ml_part [B, Hq, max_splits, 2].
struct RowPartials {
  float* o;        // o_part + row of (b, first query head of kvh) * max_splits * D
  float* ml;       // ml_part likewise
  int max_splits;  // slot stride of a head
  ZD_DEVICE float* o_at(int head, int slot) const { return o + (size_t(head) * max_splits + slot) * D; }
  ZD_DEVICE float* ml_at(int head, int slot) const { return ml + (size_t(head) * max_splits + slot) * 2; }
};

// A step's new token not yet in its bf16 region (the engine writes it after the decode, beside the
// step: docs/fp2-kernel.md, "Codes at arrival"): bf16_partial's last token comes from k / v
// ([D] bf16 each), and the region's tail rows from row `sinks` on are read `drop` rows further on
// (1 where the step flushes the oldest tail row, which the splits attend as FP2: its codes were
// written when it arrived). k null: the region holds every token.
struct PendingRow {
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  int sinks, drop;
};

// The bf16 tokens of row (b, kvh) as one more partial, in slot `slot`: for each head, the max m of
// its logits, l = sum of 2^(logit - m) and o = sum of 2^(logit - m) v (unnormalised), like a split.
// This CTA runs beside the FP2 splits on loaded SMs, where every dependent global round trip takes
// microseconds, so it makes few: the query, then each round's keys and values (kHpChunk tokens, any
// number of rounds with an online rescale) all in flight at once into shared memory. A thread per
// (head, token) takes the logit walking the channel pairs from its token's skew (the lanes of a
// warp hit distinct banks), one warp per head folds the round's weights into (m, l), and a thread
// per (head, channel) the values into o. No token at all: m = -inf, l = 0, o = 0 (weighs 0).
ZD_DEVICE void bf16_partial(const float* __restrict__ q, float q_scale, const __nv_bfloat16* __restrict__ kb,
                            const __nv_bfloat16* __restrict__ vb, int n_hp, const RowPartials& rp, int slot,
                            float* smem, const PendingRow& pending) {
  constexpr int kItems = (GROUP * D + kThreads - 1) / kThreads;  // (head, channel) outputs per thread
  constexpr int kRowChunks = D / 8;                                // 16-byte pieces of a bf16 row
  float* qs = smem;                     // [G, D] q in log2 units
  float* wts = qs + GROUP * D;          // [G, kHpChunk] logits, then weights
  float* run = wts + GROUP * kHpChunk;  // [G, 3] running m, l, and the round's rescale factor
  __nv_bfloat162* k_rows = reinterpret_cast<__nv_bfloat162*>(run + ((3 * GROUP + 3) & ~3));  // [kHpChunk, D/2]
  const __nv_bfloat16* v_rows = reinterpret_cast<const __nv_bfloat16*>(k_rows + kHpChunk * D / 2);  // [kHpChunk, D]
  const uint32_t k_dst = smem_addr(k_rows), v_dst = smem_addr(v_rows);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < GROUP * D; i += kThreads) qs[i] = q[i] * q_scale;
  if (threadIdx.x < GROUP) {
    run[3 * threadIdx.x] = ZD_NEG_INF;
    run[3 * threadIdx.x + 1] = 0.f;
  }
  float o[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) o[k] = 0.f;
  for (int j0 = 0; j0 < n_hp; j0 += kHpChunk) {
    const int cn = min(kHpChunk, n_hp - j0);
    __syncthreads();  // the previous round's keys, values and weights are used up
    for (int i = threadIdx.x; i < cn * kRowChunks; i += kThreads) {
      const int j = j0 + i / kRowChunks, piece = 8 * (i % kRowChunks);  // token j's 16-byte piece
      if (pending.k != nullptr && j == n_hp - 1) {
        cp_async16(k_dst + 16 * i, pending.k + piece, 16);
        cp_async16(v_dst + 16 * i, pending.v + piece, 16);
      } else {
        const size_t at = size_t(j < pending.sinks ? j : j + pending.drop) * D + piece;
        cp_async16(k_dst + 16 * i, kb + at, 16);
        cp_async16(v_dst + 16 * i, vb + at, 16);
      }
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // q, run (first round) and this round's rows are in place
    for (int i = threadIdx.x; i < GROUP * cn; i += kThreads) {
      const int h = i / cn, j = i % cn;
      float acc = 0.f;
#pragma unroll 8
      for (int c = 0; c < D / 2; ++c) {
        const int cc = (c + j) & (D / 2 - 1);
        const float2 kv = __bfloat1622float2(k_rows[j * (D / 2) + cc]);
        const float2 qv = *reinterpret_cast<const float2*>(qs + h * D + 2 * cc);
        acc = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, acc));
      }
      wts[h * kHpChunk + j] = acc;
    }
    __syncthreads();
    for (int h = warp; h < GROUP; h += NUM_WARPS) {
      float* w_h = wts + h * kHpChunk;
      float mx = ZD_NEG_INF;
#pragma unroll
      for (int j = lane; j < kHpChunk; j += 32) mx = fmaxf(mx, j < cn ? w_h[j] : ZD_NEG_INF);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = run[3 * h], m_new = fmaxf(m_old, mx);  // finite: the round has a token
      float l = 0.f;
#pragma unroll
      for (int j = lane; j < kHpChunk; j += 32) {
        const float w = j < cn ? ex2(w_h[j] - m_new) : 0.f;
        w_h[j] = w;  // zero past cn: the value loop below reads whole rounds
        l += w;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (lane == 0) {
        const float alpha = ex2(m_old - m_new);  // 0 on the first round (m_old = -inf)
        run[3 * h] = m_new;
        run[3 * h + 1] = run[3 * h + 1] * alpha + l;
        run[3 * h + 2] = alpha;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int i = threadIdx.x + k * kThreads;
      if (i < GROUP * D) {
        const int h = i / D, c = i % D;
        float acc = o[k] * run[3 * h + 2];
#pragma unroll 8
        for (int j = 0; j < cn; ++j) acc = fmaf(wts[h * kHpChunk + j], __bfloat162float(v_rows[j * D + c]), acc);
        o[k] = acc;
      }
    }
  }
  __syncthreads();  // run[] is final
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int i = threadIdx.x + k * kThreads;
    if (i < GROUP * D) rp.o_at(i / D, slot)[i % D] = o[k];
  }
  if (threadIdx.x < GROUP) {
    rp.ml_at(threadIdx.x, slot)[0] = run[3 * threadIdx.x];
    rp.ml_at(threadIdx.x, slot)[1] = run[3 * threadIdx.x + 1];
  }
}

// Called by every CTA of the row that has written its partial (all threads). Counts it in
// row_done; the CTA that brings the count to n_run + 1 (the FP2 CTAs with work and the bf16 CTA)
// merges: M = max of the partials' m, weights 2^(m - M), out = sum of weighted o / sum of weighted l,
// and resets the count for the next launch (a captured graph replays the same counter). A sequence
// longer than the grid covers (overflow) gets NaN. The partials are read through L2 (ld.cg): other
// CTAs wrote them during this kernel.
ZD_DEVICE void finish_row(int* row_done, int n_run, bool overflow, int num_splits, const RowPartials& rp,
                          float* __restrict__ out, float* smem, unsigned long long* __restrict__ timeline) {
  __shared__ int last;
  __syncthreads();  // every thread's partial stores are issued
  if (threadIdx.x == 0) {
    // Release: this CTA's partial (every thread's stores, ordered before by the barrier) before its
    // count. Acquire: for the CTA that merges, the other CTAs' partials after their counts. One
    // acq_rel atomic, not __threadfence's fence.sc (MEMBAR.SC and an L1 invalidation, twice).
    int done;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(done) : "l"(row_done) : "memory");
    last = done == n_run;
    if (last) *row_done = 0;  // for the next launch (nothing else in this one reads it)
  }
  __syncthreads();
  ZD_STAMP(8, globaltimer());
  if (!last) return;
  if (overflow) {
    // fp2_len beyond the bound the grid was sized for (max_len): its last tokens were never read.
    // Fail loudly: NaN, never a quiet answer over part of the sequence.
    for (int i = threadIdx.x; i < GROUP * D; i += kThreads) out[i] = __int_as_float(0x7fc00000);
    return;
  }
  const int n = n_run + 1;  // partial i: slot i for i < n_run, the bf16 slot num_splits last
  float* wts = smem;               // [G, n] the partials' m, then their weights
  float* ls = wts + GROUP * n;     // [G, n] the partials' l
  float* inv_l = ls + GROUP * n;   // [G]
  // The first n_early partials' outputs, as many as the launch's shared memory holds after the
  // above (the launch gives this kernel all it can without costing a resident CTA, and room for
  // every partial where the grid is at most two CTAs an SM: Fp2Kernels.decode_launch_smem and
  // .decode), start copying into shared memory now, beside the (m, l) round trip rather
  // than after it: a thread per (head, 4 channels) copies its own columns, which it alone reads back
  // (no barrier for them). cp.async holds no registers while in flight, so this is the cheap place
  // for as many partials as fit; the rest come through registers below, a round trip per chunk.
  const int early_at = (2 * GROUP * n + GROUP + 3) & ~3;  // floats: 16-byte aligned
  float* early = smem + early_at;                         // [n_early, G * D]
  const int n_early = max(0, min(n, (int(dynamic_smem_bytes() / 4) - early_at) / (GROUP * D)));
  for (int item = threadIdx.x; item < GROUP * D / 4; item += kThreads) {
    const int h = item / (D / 4), c = 4 * (item % (D / 4));
    for (int i = 0; i < n_early; ++i)
      cp_async16(smem_addr(early + i * GROUP * D + 4 * item), rp.o_at(h, i < n_run ? i : num_splits) + c, 16);
  }
  cp_async_commit();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int h = warp; h < GROUP; h += NUM_WARPS) {
    // One round trip for (m, l) up to 64 partials (two loads a lane in flight), kept in shared memory
    // for the weights (each lane reads back only what it wrote): the merge is on the kernel's
    // critical path, and every L2 round trip of it counts at B = 1 (48 splits a row on 132 SMs).
    float mx = ZD_NEG_INF;
    for (int i0 = lane; i0 < n; i0 += 64) {
      float2 ml[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = i0 + 32 * u;
        ml[u] = i < n ? __ldcg(reinterpret_cast<const float2*>(rp.ml_at(h, i < n_run ? i : num_splits)))
                      : make_float2(ZD_NEG_INF, 0.f);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = i0 + 32 * u;
        if (i < n) wts[h * n + i] = ml[u].x, ls[h * n + i] = ml[u].y;
        mx = fmaxf(mx, ml[u].x);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float l = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float m = wts[h * n + i];
      const float w = m == ZD_NEG_INF ? 0.f : ex2(m - mx);  // a partial without tokens weighs 0
      wts[h * n + i] = w;
      l += w * ls[h * n + i];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) inv_l[h] = l > 0.f ? 1.f / l : 0.f;  // a sequence with no token at all: zeros
  }
  __syncthreads();
  cp_async_wait<0>();
  ZD_STAMP(9, globaltimer());
  // A thread per (head, 4 channels) sums the early partials from shared memory, then walks the
  // rest in chunks of kMergeChunk float4 loads, all of a chunk in flight whatever n is (predicated:
  // a partial past n is not read and weighs 0; an unrolled loop over n would run a short row's
  // partials through its remainder, one at a time).
  // (A chunk of 28 or 32, one round trip less at B = 1, took the kernel to 180 / 200 registers.)
  constexpr int kMergeChunk = 16;
  for (int item = threadIdx.x; item < GROUP * D / 4; item += kThreads) {
    const int h = item / (D / 4), c = 4 * (item % (D / 4));
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i = 0; i < n_early; ++i) {
      const float w = wts[h * n + i];
      const float4 p = *reinterpret_cast<const float4*>(early + i * GROUP * D + 4 * item);
      acc.x = fmaf(w, p.x, acc.x), acc.y = fmaf(w, p.y, acc.y), acc.z = fmaf(w, p.z, acc.z), acc.w = fmaf(w, p.w, acc.w);
    }
    ZD_STAMP(10, globaltimer());
    for (int i0 = n_early; i0 < n; i0 += kMergeChunk) {
      float4 p[kMergeChunk];
#pragma unroll
      for (int j = 0; j < kMergeChunk; ++j) {
        const int i = i0 + j;
        p[j] = i < n ? __ldcg(reinterpret_cast<const float4*>(rp.o_at(h, i < n_run ? i : num_splits) + c))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kMergeChunk; ++j) {
        const float w = i0 + j < n ? wts[h * n + i0 + j] : 0.f;
        acc.x = fmaf(w, p[j].x, acc.x), acc.y = fmaf(w, p[j].y, acc.y), acc.z = fmaf(w, p[j].z, acc.z);
        acc.w = fmaf(w, p[j].w, acc.w);
      }
    }
    const float il = inv_l[h];
    *reinterpret_cast<float4*>(out + h * D + c) = make_float4(acc.x * il, acc.y * il, acc.z * il, acc.w * il);
  }
}

}  // namespace
