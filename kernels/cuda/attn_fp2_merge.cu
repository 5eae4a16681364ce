// Second pass of FP2 decode attention: attention over the bf16 tokens (sinks and the not yet
// quantized tail) of each sequence, merged with the FP2 split partials of attn_fp2_decode, then
// normalised.
//
// Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv (<= 8), D head dim, S splits
// (max_splits slots, the first n_splits(b) of them written), HP bf16 tokens per sequence (<= hp_max).
//
// grid (Hkv, B), 128 threads. Everything here is in the stored (rotated, anchor-divided) space of
// the cache and log2 units: q was multiplied by softmax_scale * log2(e) once, for both passes.
#include <cuda_bf16.h>

#include "attn_fp2_common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif

namespace {
constexpr int D = HEAD_DIM;
constexpr int kThreads = 128;
constexpr int TOK = 32;  // stage size of attn_fp2_decode: split boundaries are counted the same way
}  // namespace

// o_part [B, Hq, max_splits, D], ml_part [B, Hq, max_splits, 2]: from attn_fp2_decode
// fp2_lo / fp2_hi [B]: the FP2 token range given to attn_fp2_decode
// q [B, Hq, D] fp16 (the decode kernel's query)
// hp_k / hp_v: bf16, token j of seq b, kv head h at + hp_slot[b] * hp_b_stride + h * hp_h_stride + j * D
// hp_len [B]: bf16 tokens of each sequence (rows 0..hp_len-1, <= hp_max); hp_slot [B]: its row
// out [B, Hq, D] fp32, normalised
// shared memory: (G * (max_splits + hp_max) + G * D + G) floats
extern "C" __global__ void __launch_bounds__(kThreads)
    attn_fp2_merge(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                   const int32_t* __restrict__ fp2_lo, const int32_t* __restrict__ fp2_hi, int split_tokens,
                   int max_splits, const __half* __restrict__ q, const __nv_bfloat16* __restrict__ hp_k,
                   const __nv_bfloat16* __restrict__ hp_v, const int32_t* __restrict__ hp_len,
                   const int32_t* __restrict__ hp_slot, long long hp_b_stride, long long hp_h_stride, int hp_max, float* __restrict__ out) {
  extern __shared__ float smem[];
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int num_q_heads = gridDim.x * GROUP;
  const int lo = fp2_lo[b], hi = fp2_hi[b];
  const int n_splits = hi > lo ? (hi - (lo & ~(TOK - 1)) + split_tokens - 1) / split_tokens : 0;
  const int n_hp = min(hp_len[b], hp_max);
  const int width = max_splits + hp_max;
  float* wts = smem;                       // [G, max_splits + hp_max]: split then hp logits -> weights
  float* qs = wts + GROUP * width;         // [G, D]
  float* inv_l = qs + GROUP * D;           // [G]

  for (int i = threadIdx.x; i < GROUP * D; i += kThreads)
    qs[i] = __half2float(q[(size_t(b) * num_q_heads + kvh * GROUP) * D + i]);
  __syncthreads();

  // Logits of the bf16 tokens: one warp per (head, token), lanes over channels, so that a key row
  // is one coalesced read and a warp has several rows in flight (a thread per row would walk its
  // row with one dependent global load per step: tens of microseconds at HP = 36).
  const long long slot = hp_slot[b];
  const __nv_bfloat16* kb = hp_k + slot * hp_b_stride + kvh * hp_h_stride;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < GROUP * n_hp; i += kThreads / 32) {
    const int h = i / n_hp, j = i % n_hp;
    const __nv_bfloat162* krow = reinterpret_cast<const __nv_bfloat162*>(kb + size_t(j) * D);
    float acc = 0.f;
#pragma unroll
    for (int c = lane; c < D / 2; c += 32) {
      const float2 kv = __bfloat1622float2(krow[c]);
      acc = fmaf(qs[h * D + 2 * c], kv.x, fmaf(qs[h * D + 2 * c + 1], kv.y, acc));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) wts[h * width + max_splits + j] = acc;
  }
  __syncthreads();

  // One warp per head, lanes over splits and bf16 tokens: global max, the weight of every split
  // and token, 1 / sum (at B = 1 there are ~66 splits: a serial walk would dominate the kernel).
  for (int h = warp; h < GROUP; h += kThreads / 32) {
    const size_t row = (size_t(b) * num_q_heads + kvh * GROUP + h) * max_splits;
    float mx = ZD_NEG_INF;
    for (int s = lane; s < n_splits; s += 32) mx = fmaxf(mx, ml_part[(row + s) * 2]);
    for (int j = lane; j < n_hp; j += 32) mx = fmaxf(mx, wts[h * width + max_splits + j]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float l = 0.f;
    for (int s = lane; s < n_splits; s += 32) {
      const float w = zd::ex2(ml_part[(row + s) * 2] - mx);
      wts[h * width + s] = w;
      l += w * ml_part[(row + s) * 2 + 1];
    }
    for (int j = lane; j < n_hp; j += 32) {
      const float w = zd::ex2(wts[h * width + max_splits + j] - mx);
      wts[h * width + max_splits + j] = w;
      l += w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) inv_l[h] = l > 0.f ? 1.f / l : 0.f;  // a sequence with no token at all: zeros
  }
  __syncthreads();

  const __nv_bfloat16* vb = hp_v + slot * hp_b_stride + kvh * hp_h_stride;
  for (int i = threadIdx.x; i < GROUP * D; i += kThreads) {
    const int h = i / D, c = i % D;
    const size_t row = (size_t(b) * num_q_heads + kvh * GROUP + h) * max_splits;
    float o = 0.f;
    // Unrolled so that several splits' loads are in flight at once: at B = 1 this kernel has only
    // Hkv CTAs and a serial chain of dependent loads would dominate the whole attention.
#pragma unroll 8
    for (int s = 0; s < n_splits; ++s) o = fmaf(wts[h * width + s], o_part[(row + s) * D + c], o);
#pragma unroll 8
    for (int j = 0; j < n_hp; ++j)
      o = fmaf(wts[h * width + max_splits + j], __bfloat162float(vb[size_t(j) * D + c]), o);
    out[(size_t(b) * num_q_heads + kvh * GROUP + h) * D + c] = o * inv_l[h];
  }
}
