// Temporary read-bandwidth probe (not committed).
#include <cuda/std/cstdint>
using cuda::std::uint32_t;
using cuda::std::uint16_t;
#ifndef U
#define U 4
#endif
#ifndef LPR
#define LPR 4  // lanes per row in one load instruction
#endif
#ifndef BPR
#define BPR 256  // bytes of each of the warp's 16 rows per iteration
#endif
#ifndef RT
#define RT 8
#endif
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
extern "C" __global__ void rd_contig(const uint4* buf, unsigned long long n16_per_warp, uint32_t* sink) {
  const unsigned long long gw = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const uint4* p = buf + gw * n16_per_warp + lane;
  uint32_t acc = 0;
  for (unsigned long long i = 0; i < n16_per_warp; i += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_stream(p + i + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
// [R, K] bf16 rows; warp owns 16 rows, walks K in BPR-byte steps per row; one instruction covers
// 32 / LPR rows x LPR * 16 bytes.
extern "C" __global__ void rd_rows(const uint16_t* w, int R, int K, uint32_t* sink) {
  constexpr int RPI = 32 / LPR;                 // rows per instruction
  constexpr int IPR = BPR / (LPR * 16);         // instructions per row group per iteration
  constexpr int NI = (16 / RPI) * IPR;          // instructions per iteration
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int lr = lane / LPR, lc = lane % LPR;
  uint32_t acc = 0;
  for (int tile = blockIdx.x; tile * RT * 16 < R; tile += gridDim.x) {
  const int r0 = (tile * RT + warp) * 16;
  const char* base = reinterpret_cast<const char*>(w) + (size_t)(r0 + lr) * K * 2 + lc * 16;
  for (int kb = 0; kb < K * 2; kb += BPR) {
    uint4 v[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int rg = i / IPR, ci = i % IPR;
      v[i] = ld_stream(base + (size_t)rg * RPI * K * 2 + kb + ci * LPR * 16);
    }
#pragma unroll
    for (int i = 0; i < NI; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
