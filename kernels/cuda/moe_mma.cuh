// The tensor-core step both decode expert kernels (moe_experts.cu, moe_experts_bulk.cu) are built
// on: weights on the MMA's 16-row A side, an expert's tokens on the 8-column B side.
#pragma once
#include <cuda/std/cstdint>

namespace {

// c += A (16x16 bf16, row) * B (16x8 bf16, col), fp32 accumulators
__device__ __forceinline__ void mma_bf16(float (&c)[4], cuda::std::uint32_t a0, cuda::std::uint32_t a1,
                                         cuda::std::uint32_t a2, cuda::std::uint32_t a3, cuda::std::uint32_t b0,
                                         cuda::std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace
