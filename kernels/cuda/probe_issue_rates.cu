// A probe, not a runtime kernel: the issue rate of one instruction, or of two interleaved, per SM
// sub-partition (SMSP). benchmarks/issue_rates.py compiles it once per pair (OP_A, OP_B) and reads
// the cycles; the decode kernel's choice of instructions rests on what it measures
// (docs/fp2-kernel.md, "Issue costs").
//
// Each thread runs 8 independent chains (enough to cover latencies at 8 warps per SMSP), chain i
// executing OP_A for even i and OP_B for odd i, ITERS times. The CTA's time is the last warp's end
// minus the first warp's start (clock64), so the scheduler's preference for older warps does not
// bias it.
#include "attn_fp2_common.cuh"  // hi16 and e4m3x2_lo: the decode kernel's own helpers are measured

#ifndef OP_A
#define OP_A 0
#endif
#ifndef OP_B
#define OP_B OP_A
#endif
#ifndef ITERS
#define ITERS 2048
#endif

// The instructions (PTX; the SASS ptxas makes of each on sm_90 in the comment). Each one reads
// and writes its chain with operands unknown at compile time, so none can be folded away.
template <int OP>
__device__ __forceinline__ void op(uint32_t& x, uint32_t y, uint32_t k) {
  if constexpr (OP == 0) asm volatile("lop3.b32 %0, %0, %1, %2, 0x96;" : "+r"(x) : "r"(y), "r"(k));  // LOP3
  if constexpr (OP == 1) asm volatile("prmt.b32 %0, %0, %1, %2;" : "+r"(x) : "r"(k), "r"(y));  // PRMT
  if constexpr (OP == 2) asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(x) : "r"(k), "r"(y));  // IMAD
  if constexpr (OP == 3) asm volatile("mad.hi.u32 %0, %0, %1, %2;" : "+r"(x) : "r"(k), "r"(y));  // IMAD.HI
  if constexpr (OP == 4) x = zd::hi16(x);  // HADD2 R, R.H1_H1, -RZ
  if constexpr (OP == 5) asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+r"(x) : "r"(0x3f800001u), "r"(y));  // FFMA
  if constexpr (OP == 6) asm volatile("cvt.rn.f32.s32 %0, %0;" : "+r"(x));  // I2FP.F32.S32
  if constexpr (OP == 7) x = zd::e4m3x2_lo(x);  // F2FP.F16.E4M3.UNPACK_B
  if constexpr (OP == 8) asm volatile("max.f32 %0, %0, %1;" : "+r"(x) : "r"(y));  // FMNMX
  if constexpr (OP == 9) asm volatile("shf.r.wrap.b32 %0, %0, %1, %2;" : "+r"(x) : "r"(y), "r"(k));  // SHF.R.W
}

extern "C" __global__ void probe_issue_rates(uint32_t* out, uint32_t seed, long long* cycles) {
  __shared__ unsigned long long first, last;
  if (threadIdx.x == 0) first = ~0ull, last = 0;
  __syncthreads();
  uint32_t a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = (seed * (threadIdx.x + i)) | 0x3c003c00u;
  const long long t0 = clock64();
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (i & 1) op<OP_B>(a[i], a[(i + 3) & 7], seed);
      else op<OP_A>(a[i], a[(i + 3) & 7], seed);
    }
  }
  const long long t1 = clock64();
  uint32_t s = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += a[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if ((threadIdx.x & 31) == 0) {
    atomicMin(&first, static_cast<unsigned long long>(t0));
    atomicMax(&last, static_cast<unsigned long long>(t1));
  }
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = static_cast<long long>(last - first);
}
