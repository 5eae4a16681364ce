// A probe, not a runtime kernel: the warpgroup MMA forms a warpgroup decode kernel would build on
// (docs/fp2-kernel.md, "An FP8 value product"), each checked against torch by
// tests/test_wgmma_probe_gpu.py before any kernel relies on them.
// arch: sm_90a
//
// One warpgroup (128 threads) computes D [64, 8] = A [64, K] . B [8, K]^T, A from registers (the
// "RS" form: each warp holds 16 rows), B from shared memory through a matrix descriptor, K-major,
// no swizzle. Every operand row is 32 bytes: K = 16 halves (f16) or K = 32 bytes (fp8, int8).
// What the probe asserts, by passing:
// - A fragment of lane (g, t) of warp w: registers (row 16w + g, bytes 4t..4t+3), (row 16w + g + 8,
//   the same bytes), (row 16w + g, bytes 16 + 4t..), (row 16w + g + 8, bytes 16 + 4t..): the
//   mma.sync m16n8k16 / m16n8k32 A layout, per warp.
// - D fragment of lane (g, t) of warp w: (row 16w + g, cols 2t, 2t + 1), (row 16w + g + 8, the same).
// - B in shared memory as two core matrices of 8 rows x 16 bytes, K bytes 0-15 at offset 0 and 16-31
//   at offset 128 (row n of a core matrix at 16n): leading byte offset 128, stride byte offset
//   unused for 8 rows (256).
// Shape legend: M = 64 rows of A and D, N = 8 columns of D (rows of B), K as above.
#include <cuda/std/cstdint>

using cuda::std::int32_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uint8_t;

namespace {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The 64-bit shared-memory matrix descriptor: start address, leading and stride byte offsets, all
// in 16-byte units (bits 0-13, 16-29, 32-45); base offset 0, swizzle mode 0 (none).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32);
}

// B [8, 32 bytes] (global, row-major) into the two core matrices above, then made visible to the
// tensor core's (async) proxy and to every thread.
__device__ void stage_b(const uint8_t* __restrict__ b, uint8_t* sb) {
  for (int x = threadIdx.x; x < 256; x += 128) {
    const int n = x >> 5, k = x & 31;
    sb[(k >> 4) * 128 + n * 16 + (k & 15)] = b[x];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
}

__device__ void load_a(const uint8_t* __restrict__ a, uint32_t (&r)[4]) {
  const int w = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = 16 * w + g + 8 * (j & 1), byte = 16 * (j >> 1) + 4 * t;
    r[j] = *reinterpret_cast<const uint32_t*>(a + row * 32 + byte);
  }
}

template <typename T>
__device__ void store_d(T* __restrict__ d, const T (&v)[4]) {
  const int w = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j) d[(16 * w + g + 8 * (j >> 1)) * 8 + 2 * t + (j & 1)] = v[j];
}

// The three forms, one MMA each: D = A B (accumulators from zero, scale-d 1 on zeros).
struct F16 {
  using T = float;
  static __device__ void mma(float (&d)[4], const uint32_t (&r)[4], uint64_t desc) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "l"(desc));
  }
};
struct E5m2E4m3 {
  using T = float;
  static __device__ void mma(float (&d)[4], const uint32_t (&r)[4], uint64_t desc) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e5m2.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "l"(desc));
  }
};
struct S8 {
  using T = int32_t;
  static __device__ void mma(int32_t (&d)[4], const uint32_t (&r)[4], uint64_t desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k32.s32.s8.s8 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1;"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "l"(desc));
  }
};

template <class Form>
__device__ void probe(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b, typename Form::T* __restrict__ d) {
  __shared__ __align__(128) uint8_t sb[256];
  stage_b(b, sb);
  uint32_t r[4];
  load_a(a, r);
  typename Form::T acc[4] = {0, 0, 0, 0};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  Form::mma(acc, r, smem_desc(smem_u32(sb), 128, 256));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  store_d(d, acc);
}

}  // namespace

// a [64, 16] f16, b [8, 16] f16 -> d [64, 8] fp32
extern "C" __global__ void __launch_bounds__(128) probe_wgmma_f16(const uint8_t* a, const uint8_t* b, float* d) {
  probe<F16>(a, b, d);
}

// a [64, 32] e5m2, b [8, 32] e4m3 -> d [64, 8] fp32 (the FP8 value product: e5m2 levels times
// e4m3 weights)
extern "C" __global__ void __launch_bounds__(128) probe_wgmma_e5m2_e4m3(const uint8_t* a, const uint8_t* b, float* d) {
  probe<E5m2E4m3>(a, b, d);
}

// a [64, 32] s8, b [8, 32] s8 -> d [64, 8] s32 (the int8 key scores)
extern "C" __global__ void __launch_bounds__(128) probe_wgmma_s8(const uint8_t* a, const uint8_t* b, int32_t* d) {
  probe<S8>(a, b, d);
}
