// Decode-sized SwiGLU experts: a grouped skinny GEMM that streams each active expert's weights from
// HBM once and puts the expert's few tokens on the tensor-core MMA's narrow (N = 8) side.
//
//     h = silu(x W_gateᵀ) * (x W_upᵀ)      experts_gate_up   [N, K=D] -> [N, R=F]
//     y = h W_downᵀ                          experts_down      [N, K=F] -> [N, R=D]
//
// Shape legend: N packed rows (expert-major, as a dispatch leaves them), El local experts, R weight
// rows (outputs), K reduction dim, n rows of one expert, TOK = 8 * NG tokens per pass.
//
// Why: at decode an expert sees a handful of rows (top-k * batch / experts, often 0-16), so the
// stage is a weight read: ~805 MB per seed-700b expert. cuBLAS / torch._grouped_mm tile for large N
// and reach 1.2-1.5x of the read floor there (docs/benchmarks.md). Here the weights are the MMA's
// M side, loaded straight from global memory into A fragments with 16-byte streaming loads; the
// tokens are the B side. The reduction index inside an m16n8k16 MMA may be permuted freely as long
// as A and B use the same permutation, so a lane loads 8 consecutive k of a weight row (one uint4)
// and 8 consecutive k of its token row, and two MMAs consume them (lane quad c holds logical k
// {2c, 2c+1, 2c+8, 2c+9} of each MMA = actual k {8c..8c+3}, then {8c+4..8c+7}). No shared memory,
// no layout change of the weights, and about 3 warp instructions per 1 KB of weights.
//
// grid (ceil(R / (16 * ROW_TILES)), El), block 32 * ROW_TILES * KSPLIT (x2 for gate+up): warp
// (mat, ks, rt) of CTA (bx, e) owns rows [16 (bx ROW_TILES + rt), +16) of expert e's matrix `mat`
// (gate or up; down has one), the ks-th of KSPLIT shares of K, and all of the expert's n rows, TOK
// at a time (n > TOK re-streams the weights once per pass: runtime/moe/experts.py sends steps that
// are not decode-sized to a grouped GEMM instead). Experts with at most min_rows rows are left to
// moe_experts_bulk.cu (faster where it fits: kernels/experts.py splits the experts between the two). Splitting K multiplies the warps streaming at
// once, which a step touching few experts (batch 1: 2 of 32) needs to keep enough bytes in flight;
// the shares are summed in a fixed order (deterministic). A CTA whose expert has no rows exits at
// once, so only the active experts' weights are read and no host sync is needed (capturable in a
// CUDA graph). Rows past the last expert's end are not written.
//
// Hazards: K % 32 == 0, R % 16 == 0 (both > 0), 16-byte aligned rows (checked by kernels/experts.py); x is read
// through the non-coherent path, so it must not be written while the kernel runs (it is an earlier
// kernel's output on the same stream). Accumulation is fp32 over the whole K; the SwiGLU product is
// formed in fp32 and rounded once to bf16 (torch rounds gate and up to bf16 first: the reference
// comparison allows for that).
#include <cuda_bf16.h>
#include <cuda/std/cstdint>

#include "moe_mma.cuh"

using cuda::std::int32_t;
using cuda::std::uint32_t;

#ifndef ROW_TILES
#define ROW_TILES 4  // warps along the weight rows, 16 rows each
#endif
#ifndef KSPLIT
#define KSPLIT 2  // warps along K sharing a row tile (their partial sums meet in shared memory)
#endif
#ifndef UNROLL
#define UNROLL 4  // k32 steps whose weight loads are issued before their MMAs
#endif
#ifndef NG
#define NG 4  // token groups of 8 per pass (TOK = 8 * NG)
#endif
// gate+up CTAs have twice the warps: one set streams W_gate, the other W_up (a warp streams one
// matrix: 16 rows, UNROLL * 64 contiguous bytes of each per iteration, as the down kernel does)
#define WARPS_DOWN (ROW_TILES * KSPLIT)
#define WARPS_GATE_UP (2 * ROW_TILES * KSPLIT)

namespace {

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  // weights: read once, keep them out of L1 and ask L2 to fetch the whole 256-byte segment
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ld_cached(const void* p) {
  // token rows: every warp of every CTA of the expert reads them; L1 / L2 hits after the first
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One k32 step of one weight matrix against NG token groups: lo = row g, hi = row g + 8.
__device__ __forceinline__ void step(float (&acc)[NG][4], const uint4& lo, const uint4& hi,
                                     const __nv_bfloat16* const (&xrow)[NG], int k, int groups) {
#pragma unroll
  for (int t = 0; t < NG; ++t) {
    if (t < groups) {  // warp-uniform
      const uint4 b = ld_cached(xrow[t] + k);
      mma_bf16(acc[t], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
      mma_bf16(acc[t], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
    }
  }
}

// kMats = 2: out = silu(x W0ᵀ) * (x W1ᵀ); kMats = 1: out = x W0ᵀ.
// Warp index = (mat * KSPLIT + ks) * ROW_TILES + rt: matrix, K share, row tile.
template <int kMats>
__device__ __forceinline__ void skinny(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ ends,
                                       const __nv_bfloat16* __restrict__ w0, const __nv_bfloat16* __restrict__ w1,
                                       __nv_bfloat16* __restrict__ out, int R, int K, int min_rows) {
  constexpr int kParts = kMats * KSPLIT;  // partial sums per output tile
  // partial sums of every warp but (mat 0, ks 0), per (part - 1, row tile, lane)
  __shared__ float red[kParts > 1 ? kParts - 1 : 1][ROW_TILES][32][NG * 4];

  const int e = blockIdx.y;
  const int start = e ? ends[e - 1] : 0;
  const int n = ends[e] - start;
  if (n <= min_rows) return;  // idle (min_rows >= 0), or left to moe_experts_bulk.cu (CTA-uniform)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rt = warp % ROW_TILES, part = warp / ROW_TILES;  // part = mat * KSPLIT + ks
  const int mat = part / KSPLIT, ks = part % KSPLIT;
  const int tile_row = (blockIdx.x * ROW_TILES + rt) * 16;
  const bool store = tile_row < R;  // a last CTA's spare row tiles redo the last tile, unstored
  const int r0 = store ? tile_row : R - 16;
  const int g = lane >> 2, c = lane & 3;
  // this warp's k32 steps: an even share of K / 32 (K need not divide by 32 * KSPLIT)
  const int steps = K / 32, k_begin = 32 * (ks * steps / KSPLIT), k_end = 32 * ((ks + 1) * steps / KSPLIT);

  const __nv_bfloat16* a = (mat ? w1 : w0) + (size_t(e) * R + r0 + g) * K + 8 * c;  // row g, k offset 8c
  const size_t hi = size_t(8) * K;                                                   // row g + 8

  for (int t0 = 0; t0 < n; t0 += 8 * NG) {
    const int groups = min(NG, (n - t0 + 7) / 8);
    const __nv_bfloat16* xrow[NG];
#pragma unroll
    for (int t = 0; t < NG; ++t) {  // token g of group t; rows past n repeat the last (never stored)
      xrow[t] = x + size_t(start + min(t0 + 8 * t + g, n - 1)) * K + 8 * c;
    }
    float acc[NG][4] = {};

    int k = k_begin;
    for (; k + 32 * UNROLL <= k_end; k += 32 * UNROLL) {
      uint4 lo[UNROLL], up[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {  // all loads first: UNROLL KB in flight per warp
        lo[u] = ld_stream(a + k + 32 * u);
        up[u] = ld_stream(a + hi + k + 32 * u);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) step(acc, lo[u], up[u], xrow, k + 32 * u, groups);
    }
    for (; k < k_end; k += 32) step(acc, ld_stream(a + k), ld_stream(a + hi + k), xrow, k, groups);

    float other[NG][4] = {};  // mat 1's sum (the up projection), gathered by the storing warp
    if constexpr (kParts > 1) {  // the parts meet: all but part 0 park their sums, part 0 adds them in order
      if (part > 0) {
#pragma unroll
        for (int t = 0; t < NG; ++t) {
#pragma unroll
          for (int i = 0; i < 4; ++i) red[part - 1][rt][lane][t * 4 + i] = acc[t][i];
        }
      }
      __syncthreads();
      if (part == 0) {
#pragma unroll
        for (int p = 1; p < kParts; ++p) {
#pragma unroll
          for (int t = 0; t < NG; ++t) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float v = red[p - 1][rt][lane][t * 4 + i];
              if (p < KSPLIT) acc[t][i] += v;  // mat 0, another K share
              else other[t][i] += v;           // mat 1
            }
          }
        }
      }
      __syncthreads();  // red is free for the next pass
    }

    // c0, c1: (row g, tokens 2c, 2c + 1); c2, c3: (row g + 8, same tokens)
    if (part == 0 && store) {
#pragma unroll
      for (int t = 0; t < NG; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = t0 + 8 * t + 2 * c + (i & 1);
          const int row = r0 + g + (i >> 1) * 8;
          if (tok < n) {
            float v = acc[t][i];
            if constexpr (kMats == 2) v = v / (1.f + __expf(-v)) * other[t][i];  // silu(gate) * up
            out[size_t(start + tok) * R + row] = __float2bfloat16_rn(v);
          }
        }
      }
    }
  }
}

}  // namespace

// x [N, K] bf16; ends [El] int32 cumulative row ends; w_gate, w_up [El, R, K] bf16; h [N, R] bf16
extern "C" __global__ void __launch_bounds__(32 * WARPS_GATE_UP)
    experts_gate_up(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ ends,
                    const __nv_bfloat16* __restrict__ w_gate, const __nv_bfloat16* __restrict__ w_up,
                    __nv_bfloat16* __restrict__ h, int R, int K, int min_rows) {
  skinny<2>(x, ends, w_gate, w_up, h, R, K, min_rows);
}

// h [N, K] bf16; ends [El] int32; w_down [El, R, K] bf16; y [N, R] bf16
extern "C" __global__ void __launch_bounds__(32 * WARPS_DOWN)
    experts_down(const __nv_bfloat16* __restrict__ h, const int32_t* __restrict__ ends,
                 const __nv_bfloat16* __restrict__ w_down, __nv_bfloat16* __restrict__ y, int R, int K,
                 int min_rows) {
  skinny<1>(h, ends, w_down, w_down, y, R, K, min_rows);
}
