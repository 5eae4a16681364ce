// Second pass of FP2 decode attention: attention over the bf16 tokens (sinks and the not yet
// quantized tail) of each sequence, merged with the FP2 split partials of attn_fp2_decode, then
// normalised.
//
// Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv (<= 8), D head dim, S splits
// (max_splits slots, the first n_splits(b) of them written), HP bf16 tokens per sequence (<= hp_max).
//
// grid (Hkv, B, D / 32), 128 threads; CTA z writes output channels [32 z, 32 z + 32) (the logits and
// weights, cheap, are computed by each of them). Everything here is in the stored (rotated, anchor-divided) space of
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
constexpr int kChanPerCta = 32;  // output channels per CTA (grid.z = D / kChanPerCta)
static_assert(GROUP * (kChanPerCta / 4) * 8 % 32 == 0, "whole warps per pass: the shuffles need all lanes");
constexpr int TOK = 32;  // stage size of attn_fp2_decode: split boundaries are counted the same way
}  // namespace

// o_part [B, Hq, max_splits, D], ml_part [B, Hq, max_splits, 2]: from attn_fp2_decode
// fp2_lo / fp2_hi [B]: the FP2 token range given to attn_fp2_decode; num_splits: its grid's splits
// q [B, Hq, D] fp16 (the decode kernel's query)
// hp_k / hp_v: bf16, token j of seq b, kv head h at + hp_slot[b] * hp_b_stride + h * hp_h_stride + j * D
// hp_len [B]: bf16 tokens of each sequence (rows 0..hp_len-1, <= hp_max); hp_slot [B]: its row
// out [B, Hq, D] fp32, normalised
// shared memory: (G * (max_splits + hp_max) + G * D + G) floats rounded up to 4, then hp_max * D bf16
extern "C" __global__ void __launch_bounds__(kThreads)
    attn_fp2_merge(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                   const int32_t* __restrict__ fp2_lo, const int32_t* __restrict__ fp2_hi, int split_tokens,
                   int num_splits, int max_splits, const __half* __restrict__ q, const __nv_bfloat16* __restrict__ hp_k,
                   const __nv_bfloat16* __restrict__ hp_v, const int32_t* __restrict__ hp_len,
                   const int32_t* __restrict__ hp_slot, long long hp_b_stride, long long hp_h_stride, int hp_max, float* __restrict__ out) {
  extern __shared__ float smem[];
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int num_q_heads = gridDim.x * GROUP;
  const int lo = fp2_lo[b], hi = fp2_hi[b];
  const int n_splits = hi > lo ? (hi - (lo & ~(TOK - 1)) + split_tokens - 1) / split_tokens : 0;
  if (n_splits > num_splits) {
    // fp2_hi beyond the bound the decode grid was sized for (max_len): its last tokens were never
    // read and the split slots past num_splits hold stale data. Fail loudly: NaN, never a quiet
    // answer over part of the sequence.
    for (int i = threadIdx.x; i < GROUP * D; i += kThreads)
      out[(size_t(b) * gridDim.x * GROUP + kvh * GROUP) * D + i] = __int_as_float(0x7fc00000);
    return;
  }
  const int n_hp = min(hp_len[b], hp_max);
  const int width = max_splits + hp_max;
  float* wts = smem;                       // [G, max_splits + hp_max]: split then hp logits -> weights
  float* qs = wts + GROUP * width;         // [G, D]
  float* inv_l = qs + GROUP * D;           // [G]
  // [hp_max, D / 2] bf16 pairs, 16-byte aligned after the floats
  __nv_bfloat162* k_rows = reinterpret_cast<__nv_bfloat162*>(smem + ((GROUP * (width + D + 1) + 3) & ~3));

  for (int i = threadIdx.x; i < GROUP * D; i += kThreads)
    qs[i] = __half2float(q[(size_t(b) * num_q_heads + kvh * GROUP) * D + i]);
  __syncthreads();

  // Logits of the bf16 tokens. Their keys (rows of one slot and head: contiguous) are first staged
  // in shared memory with every 16-byte load in flight at once: walked from global memory, the rows
  // cost one round trip each (tens of microseconds at B = 1, where this kernel has few CTAs). Then
  // a thread per (head, token) walks the channel pairs starting at its token's skew, so that the
  // lanes of a warp read 32 distinct banks.
  const long long slot = hp_slot[b];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const __nv_bfloat16* kb = hp_k + slot * hp_b_stride + kvh * hp_h_stride;
  for (int i = threadIdx.x; i < n_hp * D / 8; i += kThreads)
    reinterpret_cast<uint4*>(k_rows)[i] = __ldg(reinterpret_cast<const uint4*>(kb) + i);
  __syncthreads();
  for (int i = threadIdx.x; i < GROUP * n_hp; i += kThreads) {
    const int h = i / n_hp, j = i % n_hp;
    float acc = 0.f;
#pragma unroll 8
    for (int c = 0; c < D / 2; ++c) {
      const int cc = (c + j) & (D / 2 - 1);
      const float2 kv = __bfloat1622float2(k_rows[j * (D / 2) + cc]);
      const float2 qv = *reinterpret_cast<const float2*>(qs + h * D + 2 * cc);
      acc = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, acc));
    }
    wts[h * width + max_splits + j] = acc;
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

  // The weighted sum over splits and bf16 tokens, this CTA's channels [c0, c0 + kChanPerCta) only.
  // Reading the partials is the kernel's bulk (at B = 1, L = 128k: 32 heads x 66 splits x D fp32, 1
  // MB) and a latency problem, not a bandwidth one: with few CTAs, what limits it is the bytes in
  // flight. So the grid also spans channel chunks, each thread reads float4s, and the 8 lanes of
  // an item walk interleaved splits (8 x 4 independent loads per item), reduced by shuffles.
  const __nv_bfloat16* vb = hp_v + slot * hp_b_stride + kvh * hp_h_stride;
  const int c0 = blockIdx.z * kChanPerCta;
  constexpr int kGroups = kChanPerCta / 4;  // float4 channel groups per head
  for (int i = threadIdx.x; i < GROUP * kGroups * 8; i += kThreads) {
    const int sl = i & 7, grp = (i >> 3) % kGroups, h = (i >> 3) / kGroups;  // sl == lane & 7
    const int c = c0 + 4 * grp;
    const size_t row = (size_t(b) * num_q_heads + kvh * GROUP + h) * max_splits;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = sl; s < n_splits; s += 8) {
      const float w = wts[h * width + s];
      const float4 p = *reinterpret_cast<const float4*>(o_part + (row + s) * D + c);
      o.x = fmaf(w, p.x, o.x), o.y = fmaf(w, p.y, o.y), o.z = fmaf(w, p.z, o.z), o.w = fmaf(w, p.w, o.w);
    }
#pragma unroll 4
    for (int j = sl; j < n_hp; j += 8) {
      const float w = wts[h * width + max_splits + j];
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(vb + size_t(j) * D + c);
      const float2 a = __bfloat1622float2(v2[0]), z = __bfloat1622float2(v2[1]);
      o.x = fmaf(w, a.x, o.x), o.y = fmaf(w, a.y, o.y), o.z = fmaf(w, z.x, o.z), o.w = fmaf(w, z.y, o.w);
    }
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) {
      o.x += __shfl_xor_sync(0xffffffffu, o.x, off);
      o.y += __shfl_xor_sync(0xffffffffu, o.y, off);
      o.z += __shfl_xor_sync(0xffffffffu, o.z, off);
      o.w += __shfl_xor_sync(0xffffffffu, o.w, off);
    }
    if (sl == 0) {
      const float il = inv_l[h];
      *reinterpret_cast<float4*>(out + (size_t(b) * num_q_heads + kvh * GROUP + h) * D + c) =
          make_float4(o.x * il, o.y * il, o.z * il, o.w * il);
    }
  }
}
