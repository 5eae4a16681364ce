// The receive-side layout of one dispatch phase, mirrored from runtime/comm/layout.py.
//
// W world size, Tm max tokens per rank, Elm max local experts, K top-k, D hidden, B message bytes.
//
// One symmetric buffer per rank and phase (two alternate per communicator; the engine's layers share one), byte offsets
// passed by the host (runtime/comm/nvshmem_comm.py `SymmetricLayout`):
//     off_msg        recv rows      [Elm][W][Tm] x B     row (le, src, slot)
//     off_info       recv src_idx   [Elm][W][Tm] int32   t * K + k at the source
//     off_flag       recv flags     [Elm][W] int64       count + 1, written by src, zeroed by reader
//     off_comb       combine rows   [Tm * K] x D bf16    row src_idx, written by the expert's owner
//     off_comb_flag  combine flags  [W] int64            1 once rank w wrote all its rows for us
//     off_stage      send staging   [Tm * K] x B         (remote put path only: puts need symmetric sources)
// FP8 message: D e4m3 bytes, then D/128 fp32 scales (scale = max(amax, 1e-10) / 448).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace zd {

constexpr float kFp8Max = 448.0f;

__device__ __forceinline__ long long slab_row(int local_expert, int src_rank, int slot, int world_size,
                                              int max_tokens) {
  return (static_cast<long long>(local_expert) * world_size + src_rank) * max_tokens + slot;
}

// Rows are split into 128-channel FP8 groups of 16 threads x 8 channels (see quantize_row_fp8).

// Copy one bf16 row (D channels) with 16-byte vectors, all threads of the block.
__device__ __forceinline__ void copy_row_bf16(void* dst, const void* src, int hidden) {
  const int n16 = hidden / 8;
  for (int i = threadIdx.x; i < n16; i += blockDim.x) {
    reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
  }
}

// Quantize one bf16 row into an FP8 message. Each thread converts 8 channels; the 16 threads of a
// 128-channel group are 16 consecutive lanes (blockDim % 16 == 0), so the group max is a 16-lane
// shuffle. The loop bound is uniform across the block so every lane reaches every shuffle.
__device__ __forceinline__ void quantize_row_fp8(unsigned char* msg, const __nv_bfloat16* src, int hidden) {
  const int n8 = hidden / 8;
  float* scales = reinterpret_cast<float*>(msg + hidden);
  for (int base = 0; base < n8; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const bool active = i < n8;
    float v[8];
    float amax = 0.0f;
    if (active) {
      const int4 raw = reinterpret_cast<const int4*>(src)[i];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int m = 8; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    if (active) {
      const float scale = fmaxf(amax, 1e-10f) / kFp8Max;
      unsigned char q[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) q[j] = __nv_fp8_e4m3(v[j] / scale).__x;
      *reinterpret_cast<uint2*>(msg + 8 * i) = *reinterpret_cast<const uint2*>(q);
      if ((i & 15) == 0) scales[i / 16] = scale;
    }
  }
}

// The inverse: FP8 message -> bf16 row.
__device__ __forceinline__ void dequantize_row_fp8(__nv_bfloat16* dst, const unsigned char* msg, int hidden) {
  const float* scales = reinterpret_cast<const float*>(msg + hidden);
  for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
    const uint2 raw = *reinterpret_cast<const uint2*>(msg + 8 * i);
    const unsigned char* q = reinterpret_cast<const unsigned char*>(&raw);
    const float scale = scales[i / 16];
    __nv_bfloat162 out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      __nv_fp8_e4m3 a, b;
      a.__x = q[2 * j];
      b.__x = q[2 * j + 1];
      out[j] = __floats2bfloat162_rn(static_cast<float>(a) * scale, static_cast<float>(b) * scale);
    }
    *reinterpret_cast<int4*>(dst + 8 * i) = *reinterpret_cast<const int4*>(out);
  }
}

}  // namespace zd
