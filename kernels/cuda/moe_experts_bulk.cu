// Decode-sized SwiGLU experts, weights staged by the copy engine: a grouped skinny GEMM that streams
// each active expert's weights from HBM once through bulk asynchronous copies (TMA, cp.async.bulk)
// into a shared-memory ring, and puts the expert's few tokens on the tensor-core MMA's narrow side.
//
//     h = silu(x W_gateᵀ) * (x W_upᵀ)      experts_gate_up_bulk   [N, K=D] -> [N, R=F]
//     y = h W_downᵀ                          experts_down_bulk      [N, K=F] -> [N, R=D]
//
// Shape legend: N packed rows (expert-major, as a dispatch leaves them), El local experts, R weight
// rows (outputs), K reduction dim, n rows of one expert, TOK = 8 * NG tokens per pass, ROWS =
// kMats * MT * 16 weight rows per CTA, KC reduction elements per stage.
//
// Why: moe_experts.cu loads weights straight into registers; its reads stall at ~3.8 TB/s, short of
// what this HBM gives to long reads, because each warp's loads come in bursts it then waits on. Here
// one producer warp keeps STAGES chunks in flight, one bulk copy per row (KC * 2 contiguous bytes, no
// per-thread address work), completion counted in bytes on an mbarrier. A chunk is ROWS weight rows
// and the pass's TOK token rows (token rows read from global memory by the consumers instead were a
// dependent L2 round trip per chunk, which capped each CTA's rate). CW consumer warps read the landed
// chunk from shared memory (LDS.128, rows padded by 64 bytes so that a quarter warp's two rows fall
// in different banks) and run the MMAs. The reduction index inside an m16n8k16 MMA may be permuted as
// long as A and B agree (as in moe_experts.cu): a lane takes 8 consecutive k of a weight row and of
// its token row, and two MMAs consume them. Token rows past n hold stale bytes; an MMA column depends
// on its own token only, and those columns are never stored.
//
// grid (ceil(R / (16 MT)), El), block 32 (CW + 1): CTA (bx, e) owns rows [16 MT bx, +16 MT) of each of
// expert e's kMats matrices over all of K; consumer warp w takes the k32 steps w, w + CW, ... of every
// chunk, and their partial sums meet in shared memory in a fixed order (deterministic). Warp CW is the
// producer. A CTA whose expert has no rows, or more than max_rows (kernels/experts.py leaves those to
// moe_experts.cu, which takes 32 tokens a pass), exits at once: only active experts' weights are
// read, no host sync, capturable. An expert with n > TOK rows here re-streams its weights once per
// pass of TOK.
//
// Shape: the H200 sweeps (docs/benchmarks.md "Experts") favour 2 stages of 1 KB row copies and 2
// CTAs per SM; 3 or 4 stages of the same or smaller copies measured 25-60% slower, and 32 token rows
// per stage cost the second CTA per SM.
//
// Hazards: K % 32 == 0, R % 16 == 0, 16-byte aligned weights and x (checked by kernels/experts.py); x
// must not be written while the kernel runs. The producer warp returns after its last copy while
// copies are in flight; the consumers therefore synchronise with a named barrier over their own
// warps only, never __syncthreads. Dynamic shared memory above 48 KB: the launcher raises the
// kernel's limit (kernels/module.py).
#include <cuda_bf16.h>
#include <cuda/std/cstdint>

#include "moe_mma.cuh"

using cuda::std::int32_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;

#ifndef MT
#define MT 1  // 16-row tiles per matrix per CTA
#endif
#ifndef CW
#define CW 4  // consumer warps (they split each chunk's k32 steps)
#endif
#ifndef KC
#define KC 256  // reduction elements per stage (a multiple of 32)
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef NG
#define NG 4  // token groups of 8 per pass (TOK = 8 * NG)
#endif
#define ROW_PAD 64                                // bytes after each staged row (bank spread)
#define ROW_STRIDE (KC * 2 + ROW_PAD)             // bytes between staged rows
#define SPW ((KC / 32 + CW - 1) / CW)             // k32 steps per consumer warp per full chunk
#define TOK (8 * NG)                              // token rows per pass (and per stage)
static_assert(KC % 32 == 0, "KC must be a multiple of 32");
static_assert(16 * STAGES <= 128, "the full and empty barriers must fit the 128-byte header");

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void bar_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Waits for the completion of the barrier's phase of this parity. Intra-CTA: the copies it waits on
// are in flight from this CTA's own producer, so it cannot wait on another rank.
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}

// bytes (a multiple of 16) from global src to shared dst (both 16-byte aligned), counted on bar
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory");
}

// kMats = 2: out = silu(x W0ᵀ) * (x W1ᵀ); kMats = 1: out = x W0ᵀ.
template <int kMats>
__device__ __forceinline__ void skinny_bulk(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ ends,
                                            const __nv_bfloat16* __restrict__ w0,
                                            const __nv_bfloat16* __restrict__ w1, __nv_bfloat16* __restrict__ out,
                                            int R, int K, int max_rows) {
  constexpr int ROWS = kMats * MT * 16;       // weight rows per stage
  constexpr int STAGE_ROWS = ROWS + TOK;       // then the pass's token rows
  // dynamic shared memory (BulkShape.smem_bytes in kernels/experts.py computes the same size):
  // full[STAGES], empty[STAGES] barriers in the first 128 bytes, then the ring [STAGES][STAGE_ROWS]
  // [ROW_STRIDE], then one consumer warp's partial sums at a time, [ACC][32 lanes] fp32
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + STAGES;
  unsigned char* ring = smem + 128;
  float* red = reinterpret_cast<float*>(ring + STAGES * STAGE_ROWS * ROW_STRIDE);

  const int e = blockIdx.y;
  const int start = e ? ends[e - 1] : 0;
  const int n = ends[e] - start;
  if (n <= 0 || n > max_rows) return;  // idle expert, or one left to moe_experts.cu (CTA-uniform)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&full[s], 1);         // the producer's arrive, plus the bytes it announces
      bar_init(&empty[s], 32 * CW);  // every consumer lane, once it has read the slot
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the last block-wide barrier: the producer leaves early

  const int chunks = (K + KC - 1) / KC;
  const int passes = (n + 8 * NG - 1) / (8 * NG);
  // row tile m of this CTA starts at r0[m]; a last CTA's spare tiles redo the last tile, unstored
  auto tile_row = [&](int m) { return (blockIdx.x * MT + m) * 16; };

  if (warp == CW) {  // producer: one bulk copy per staged row, lane l takes rows l, l + 32, ...
    for (int it = 0; it < passes * chunks; ++it) {
      const int slot = it % STAGES, round = it / STAGES;
      if (round > 0) bar_wait(&empty[slot], (round - 1) & 1);
      const int k0 = (it % chunks) * KC, kc = min(KC, K - k0);
      const int t0 = (it / chunks) * TOK, xrows = min(TOK, n - t0);  // this pass's token rows
      if (lane == 0) bar_arrive_expect(&full[slot], uint32_t(ROWS + xrows) * kc * 2);
      __syncwarp();
      for (int r = lane; r < ROWS + xrows; r += 32) {
        const __nv_bfloat16* src;
        if (r < ROWS) {
          const int mat = r / (MT * 16), m = (r / 16) % MT, tr = tile_row(m);
          const int row = (tr < R ? tr : R - 16) + r % 16;
          src = (mat ? w1 : w0) + (size_t(e) * R + row) * K + k0;
        } else {
          src = x + size_t(start + t0 + r - ROWS) * K + k0;
        }
        bulk_copy(ring + (slot * STAGE_ROWS + r) * ROW_STRIDE, src, kc * 2, &full[slot]);
      }
    }
    return;
  }

  const int g = lane >> 2, c = lane & 3;
  int it = 0;
  for (int t0 = 0; t0 < n; t0 += TOK) {
    const int groups = min(NG, (n - t0 + 7) / 8);
    float acc[kMats][MT][NG][4] = {};

    for (int ch = 0; ch < chunks; ++ch, ++it) {
      const int slot = it % STAGES;
      const int steps = min(KC, K - ch * KC) / 32;
      bar_wait(&full[slot], (it / STAGES) & 1);
      // lane (g, c) reads 16 bytes at k 8c of rows g and g + 8 (weights) and of token row g (tokens)
      const unsigned char* stage = ring + slot * STAGE_ROWS * ROW_STRIDE + g * ROW_STRIDE + 16 * c;
      uint4 lo[SPW][kMats][MT], hi[SPW][kMats][MT], b[SPW][NG];
#pragma unroll
      for (int j = 0; j < SPW; ++j) {
        const int s = warp + CW * j;
        if (s < steps) {
#pragma unroll
          for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              const unsigned char* p = stage + ((mat * MT + m) * 16) * ROW_STRIDE + 64 * s;
              lo[j][mat][m] = *reinterpret_cast<const uint4*>(p);
              hi[j][mat][m] = *reinterpret_cast<const uint4*>(p + 8 * ROW_STRIDE);
            }
          }
#pragma unroll
          for (int t = 0; t < NG; ++t) {  // rows of tokens past n hold stale bytes: their columns are never stored
            if (t < groups) b[j][t] = *reinterpret_cast<const uint4*>(stage + (ROWS + 8 * t) * ROW_STRIDE + 64 * s);
          }
        }
      }
      bar_arrive(&empty[slot]);  // the slot's bytes are in registers: the producer may refill it
#pragma unroll
      for (int j = 0; j < SPW; ++j) {
        if (warp + CW * j < steps) {
#pragma unroll
          for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              const uint4& l = lo[j][mat][m];
              const uint4& h = hi[j][mat][m];
#pragma unroll
              for (int t = 0; t < NG; ++t) {
                if (t < groups) {
                  mma_bf16(acc[mat][m][t], l.x, h.x, l.y, h.y, b[j][t].x, b[j][t].y);
                  mma_bf16(acc[mat][m][t], l.z, h.z, l.w, h.w, b[j][t].z, b[j][t].w);
                }
              }
            }
          }
        }
      }
    }

    // the consumer warps' partial sums meet in warp 0, one warp at a time in a fixed order (deterministic)
    constexpr int ACC = kMats * MT * NG * 4;  // accumulators per lane, flat (constant indices: registers)
    float (&flat)[ACC] = reinterpret_cast<float (&)[ACC]>(acc);
    for (int w = 1; w < CW; ++w) {
      if (warp == w) {
#pragma unroll
        for (int j = 0; j < ACC; ++j) red[j * 32 + lane] = flat[j];
      }
      consumers_sync();
      if (warp == 0) {
#pragma unroll
        for (int j = 0; j < ACC; ++j) flat[j] += red[j * 32 + lane];
      }
      consumers_sync();  // red is free for the next warp
    }

    // c0, c1: (row g, tokens 2c, 2c + 1); c2, c3: (row g + 8, same tokens)
    if (warp == 0) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (tile_row(m) >= R) continue;
#pragma unroll
        for (int t = 0; t < NG; ++t) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int tok = t0 + 8 * t + 2 * c + (i & 1);
            const int row = tile_row(m) + g + (i >> 1) * 8;
            if (tok < n) {
              float v = acc[0][m][t][i];
              if constexpr (kMats == 2) v = v / (1.f + __expf(-v)) * acc[kMats - 1][m][t][i];  // silu(gate) * up
              out[size_t(start + tok) * R + row] = __float2bfloat16_rn(v);
            }
          }
        }
      }
    }
  }
}

}  // namespace

// x [N, K] bf16; ends [El] int32 cumulative row ends; w_gate, w_up [El, R, K] bf16; h [N, R] bf16
extern "C" __global__ void __launch_bounds__(32 * (CW + 1))
    experts_gate_up_bulk(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ ends,
                         const __nv_bfloat16* __restrict__ w_gate, const __nv_bfloat16* __restrict__ w_up,
                         __nv_bfloat16* __restrict__ h, int R, int K, int max_rows) {
  skinny_bulk<2>(x, ends, w_gate, w_up, h, R, K, max_rows);
}

// h [N, K] bf16; ends [El] int32; w_down [El, R, K] bf16; y [N, R] bf16
extern "C" __global__ void __launch_bounds__(32 * (CW + 1))
    experts_down_bulk(const __nv_bfloat16* __restrict__ h, const int32_t* __restrict__ ends,
                      const __nv_bfloat16* __restrict__ w_down, __nv_bfloat16* __restrict__ y, int R, int K,
                      int max_rows) {
  skinny_bulk<1>(h, ends, w_down, w_down, y, R, K, max_rows);
}
