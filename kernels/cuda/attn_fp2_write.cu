// FP2 write path: quantize tokens (already in the stored space: rotated, divided by the anchor)
// into the paged FP2 cache, one scale block per warp, following runtime/kv/quantize.py
// (`quantize_blocks` with channel blocks, symmetric, no outliers).
//
// Shape legend: N tokens to write, Hkv kv heads, D head dim, BS channels per scale block,
// NB = D / BS blocks per token, C = 33 candidate scales of the MSE search, P page size.
//
// grid (N, Hkv, 2 sides: K then V), NB x CW warps: CW search warps per scale block (SEARCH_WARPS);
// lane l of each holds channels l, l + 32, ... of its block in registers. Scale rule (per side):
// absmax: s = round(absmax / max|L|), one warp per block; mse: the candidate
// s_c = round(absmax / max|L| * frac_c) of least squared error, first on ties. The search places
// codes as the CPU search does, y >= s_c * m_i (products, not divisions), so the two agree wherever
// the errors are not equal within rounding. Each candidate's error is a warp sum (an xor butterfly:
// every lane ends with bitwise the same sum). The candidates are independent, and a decode write
// (one token per sequence) is a latency chain, not a throughput job: so search warp w scores a
// contiguous share of CPW candidates, their butterflies interleaved round by round, and the block's
// first warp takes the least (error, candidate) over the shares from shared memory (H200: 1.1-1.3
// us off a 6.4-7.1 us one-token write). A long grid (a prefill chunk, a flush) is a throughput job:
// the caller launches a SEARCH_WARPS = 1 build there (kernels/attention.py). Rounding is the
// reference's (E4M3
// round-to-nearest-even clamped into [2^-9, 448]; E8M0 nearest power of two in log2, ties up);
// the final codes divide, y / s >= m_i, as `nearest_code` does (docs/fp2-kernel.md, "Write path").
#include "attn_fp2_common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef K_BLOCK
#define K_BLOCK 64
#endif
#ifndef V_BLOCK
#define V_BLOCK 64
#endif
#ifndef SCALE_FMT
#define SCALE_FMT 0  // 0: E4M3, 1: E8M0
#endif
#ifndef NUM_CAND
#define NUM_CAND 33
#endif
#ifndef V_QUAD
#define V_QUAD 0  // 1: value pages in the quad layout (runtime/kv/pack.py)
#endif
#ifndef SEARCH_WARPS
#define SEARCH_WARPS 4  // warps sharing one block's candidates (Fp2KernelConfig.write_search_warps)
#endif

namespace {
constexpr int D = HEAD_DIM;
constexpr int MAX_BS = K_BLOCK > V_BLOCK ? K_BLOCK : V_BLOCK;
constexpr int MAX_NB = D / (K_BLOCK < V_BLOCK ? K_BLOCK : V_BLOCK);
static_assert(K_BLOCK % 16 == 0 && V_BLOCK % 16 == 0 && D % K_BLOCK == 0 && D % V_BLOCK == 0, "blocks");
constexpr int PER_LANE = (MAX_BS + 31) / 32;  // channels of a block each lane holds
constexpr int CW = SEARCH_WARPS;
constexpr int CPW = (NUM_CAND + CW - 1) / CW;  // candidates per search warp
constexpr unsigned kFull = 0xffffffffu;
static_assert(CW >= 1 && MAX_NB * CW <= 32, "at most 1024 threads");

__device__ int nearest_code(float z, float m0, float m1, float m2) {
  return int(z >= m0) + int(z >= m1) + int(z >= m2);  // bucketize(right=True) over the midpoints
}
}  // namespace

// y        [N, Hkv, 2, D] fp32 stored-space values (side 0 = K, 1 = V)
// seq_idx  [N] int32 row of the block table; fp2_idx [N] int32 FP2 token index (page f / P, slot f % P)
// k_codes / v_codes, k_scales / v_scales: the page pools (same layout and strides as attn_fp2_decode)
// levels   [8] fp32 (K then V, sorted); fracs [NUM_CAND] fp32 candidate fractions (MSE rule)
// rules    0 absmax, 1 mse; bit 0 keys, bit 1 values
extern "C" __global__ void __launch_bounds__(32 * MAX_NB * CW)
    attn_fp2_write(const float* __restrict__ y, const int32_t* __restrict__ seq_idx,
                   const int32_t* __restrict__ fp2_idx, const int32_t* __restrict__ block_table, int bt_stride,
                   int page_size, uint32_t* __restrict__ k_codes, uint8_t* __restrict__ k_scales,
                   uint32_t* __restrict__ v_codes, uint8_t* __restrict__ v_scales, long long code_page_stride,
                   long long code_head_stride, long long ks_page_stride, long long ks_head_stride,
                   long long vs_page_stride, long long vs_head_stride, const float* __restrict__ levels,
                   const float* __restrict__ fracs, int rules) {
  __shared__ uint8_t cs[MAX_NB][MAX_BS];
  __shared__ float share_err[MAX_NB][CW], share_scale[MAX_NB][CW];  // each search warp's best
  const int n = blockIdx.x, kvh = blockIdx.y, side = blockIdx.z;
  const int num_kv_heads = gridDim.y;
  const int bs = side == 0 ? K_BLOCK : V_BLOCK, nb = D / bs;
  const int warp = (threadIdx.x >> 5) / CW, cw = (threadIdx.x >> 5) % CW, lane = threadIdx.x & 31;
  const bool mse = (rules >> side) & 1;  // the same for the whole CTA: the exits below are uniform per block
  if (warp >= nb || (cw != 0 && !mse)) return;
  // The destination first: its two dependent loads (the token's sequence and slot, then the block
  // table) then overlap the scale search instead of following it (__syncwarp below keeps the
  // compiler from hoisting them itself).
  const int b = seq_idx[n], f = fp2_idx[n];
  const long long page = block_table[size_t(b) * bt_stride + f / page_size];
  const int j = f % page_size;
  const float* lv = levels + 4 * side;
  const float l0 = lv[0], l1 = lv[1], l2 = lv[2], l3 = lv[3];
  const float m0 = (l0 + l1) * 0.5f, m1 = (l1 + l2) * 0.5f, m2 = (l2 + l3) * 0.5f;
  const float lmax = fmaxf(fmaxf(fabsf(l0), fabsf(l1)), fmaxf(fabsf(l2), fabsf(l3)));
  float frac[CPW];  // this warp's share of the candidate fractions, loaded beside y
#pragma unroll
  for (int k = 0; k < CPW; ++k) frac[k] = mse && cw * CPW + k < NUM_CAND ? fracs[cw * CPW + k] : 0.f;

  // yv[i] = channel lane + 32 i of the block; channels past bs (bs < 32 i + 32) hold 0 and are
  // masked out of the errors below.
  const float* src = y + ((size_t(n) * num_kv_heads + kvh) * 2 + side) * D + warp * bs;
  float yv[PER_LANE];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int c = lane + 32 * i;
    yv[i] = c < bs ? src[c] : 0.f;
    amax = fmaxf(amax, fabsf(yv[i]));
  }
#pragma unroll
  for (int off = 16; off; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
  const float s0 = __fdiv_rn(amax, lmax);

  float scale;
  if (!mse) {
    scale = zd::round_scale<SCALE_FMT>(s0);
  } else {
    // Candidates cw * CPW + k: every lane rounds them itself (the same bits on every lane), scores
    // its channels, then the butterflies run round by round over the share, CPW shuffles in flight.
    float cand[CPW], err[CPW];
#pragma unroll
    for (int k = 0; k < CPW; ++k) {
      cand[k] = zd::round_scale<SCALE_FMT>(__fmul_rn(s0, frac[k]));
      const float t0 = __fmul_rn(cand[k], m0), t1 = __fmul_rn(cand[k], m1), t2 = __fmul_rn(cand[k], m2);
      const float q0 = __fmul_rn(l0, cand[k]), q1 = __fmul_rn(l1, cand[k]);
      const float q2 = __fmul_rn(l2, cand[k]), q3 = __fmul_rn(l3, cand[k]);
      err[k] = 0.f;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        const float v = yv[i];
        const float q = v >= t1 ? (v >= t2 ? q3 : q2) : (v >= t0 ? q1 : q0);
        const float d = lane + 32 * i < bs ? __fsub_rn(v, q) : 0.f;
        err[k] = __fmaf_rn(d, d, err[k]);
      }
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) {
#pragma unroll
      for (int k = 0; k < CPW; ++k) err[k] = __fadd_rn(err[k], __shfl_xor_sync(kFull, err[k], off));
    }
    // The share's first least error; +inf (and the share's first candidate) where every error
    // overflows or is NaN, so that a block whose every error does falls back to candidate 0.
    float best_err = __int_as_float(0x7f800000);
    scale = cand[0];
#pragma unroll
    for (int k = 0; k < CPW; ++k)
      if (cw * CPW + k < NUM_CAND && err[k] < best_err) best_err = err[k], scale = cand[k];
    if (lane == 0) share_err[warp][cw] = best_err, share_scale[warp][cw] = scale;
    asm volatile("bar.sync 1, %0;" ::"r"(32 * CW * nb) : "memory");
    if (cw != 0) return;
    // Shares in candidate order, strict <: the first least error over all of them.
    best_err = share_err[warp][0];
    scale = share_scale[warp][0];
#pragma unroll
    for (int w = 1; w < CW; ++w)
      if (share_err[warp][w] < best_err) best_err = share_err[warp][w], scale = share_scale[warp][w];
  }

#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int c = lane + 32 * i;
    if (c < bs) cs[warp][c] = uint8_t(nearest_code(__fdiv_rn(yv[i], scale), m0, m1, m2));
  }
  __syncwarp();

  uint32_t* codes = side == 0 ? k_codes : v_codes;
  uint8_t* scales = side == 0 ? k_scales : v_scales;
  const long long sp = side == 0 ? ks_page_stride : vs_page_stride;
  const long long sh = side == 0 ? ks_head_stride : vs_head_stride;
  if (V_QUAD && side == 1) {
    // Quad layout: byte j % 4 of the quad's word w = g * D/32 + k holds channels 32k + 8f + g
    // (field f), which may lie in two blocks (16-channel blocks): the side's warps meet at a named
    // barrier (the other warps have left, the search warps too) and share the block codes in `cs`.
    asm volatile("bar.sync 2, %0;" ::"r"(32 * nb) : "memory");
    uint8_t* qb = reinterpret_cast<uint8_t*>(codes + page * code_page_stride + kvh * code_head_stride +
                                             (long long)(j & ~3) * (D / 16));
    for (int w = 32 * warp + lane; w < D / 4; w += 32 * nb) {
      const int g = w / (D / 32), k = w % (D / 32);
      uint32_t byte = 0;
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const int ch = 32 * k + 8 * f + g;
        byte |= uint32_t(cs[ch / bs][ch % bs]) << (2 * f);
      }
      qb[4 * w + (j & 3)] = uint8_t(byte);
    }
  } else {
    uint32_t* wdst = codes + page * code_page_stride + kvh * code_head_stride + (long long)j * (D / 16) + warp * (bs / 16);
    for (int w = lane; w < bs / 16; w += 32) {
      uint32_t word = 0;
#pragma unroll
      for (int e = 0; e < 16; ++e) word |= uint32_t(cs[warp][16 * w + e]) << (2 * e);
      wdst[w] = word;
    }
  }
  if (lane == 0) scales[page * sp + kvh * sh + (long long)j * nb + warp] = uint8_t(zd::encode_scale<SCALE_FMT>(scale));
}
