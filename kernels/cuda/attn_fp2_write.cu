// FP2 write path: quantize tokens (already in the stored space: rotated, divided by the anchor)
// into the paged FP2 cache, one scale block per warp, following runtime/kv/quantize.py
// (`quantize_blocks` with channel blocks, symmetric, no outliers).
//
// Shape legend: N tokens to write, Hkv kv heads, D head dim, BS channels per scale block,
// NB = D / BS blocks per token, C = 33 candidate scales of the MSE search, P page size.
//
// grid (N, Hkv, 2 sides: K then V), NB warps; lane l holds channels l, l + 32, ... of its warp's
// block in registers. Scale rule (per side): absmax: s = round(absmax / max|L|); mse: the
// candidate s_c = round(absmax / max|L| * frac_c) of least squared error, first on ties. The search
// places codes as the CPU search does, y >= s_c * m_i (products, not divisions), so the two agree
// wherever the errors are not equal within rounding. Each candidate's error is a warp sum (an xor
// butterfly: every lane ends with bitwise the same sum, so every lane picks the same winner), and
// the 33 candidates are independent, so a decode write of a few tokens is a short latency chain
// instead of one lane walking 2 x 64 divisions. Rounding is the reference's (E4M3
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

namespace {
constexpr int D = HEAD_DIM;
constexpr int MAX_BS = K_BLOCK > V_BLOCK ? K_BLOCK : V_BLOCK;
constexpr int MAX_NB = D / (K_BLOCK < V_BLOCK ? K_BLOCK : V_BLOCK);
static_assert(K_BLOCK % 16 == 0 && V_BLOCK % 16 == 0 && D % K_BLOCK == 0 && D % V_BLOCK == 0, "blocks");
constexpr int PER_LANE = (MAX_BS + 31) / 32;  // channels of a block each lane holds
constexpr unsigned kFull = 0xffffffffu;
static_assert(NUM_CAND <= 64, "two candidates per lane at most");

__device__ int nearest_code(float z, float m0, float m1, float m2) {
  return int(z >= m0) + int(z >= m1) + int(z >= m2);  // bucketize(right=True) over the midpoints
}
}  // namespace

// y        [N, Hkv, 2, D] fp32 stored-space values (side 0 = K, 1 = V)
// seq_idx  [N] int32 row of the block table; fp2_idx [N] int32 FP2 token index (page f / P, slot f % P)
// k_codes / v_codes, k_scales / v_scales: the page pools (same layout and strides as attn_fp2_decode)
// levels   [8] fp32 (K then V, sorted); fracs [NUM_CAND] fp32 candidate fractions (MSE rule)
// rules    0 absmax, 1 mse; bit 0 keys, bit 1 values
extern "C" __global__ void __launch_bounds__(32 * MAX_NB)
    attn_fp2_write(const float* __restrict__ y, const int32_t* __restrict__ seq_idx,
                   const int32_t* __restrict__ fp2_idx, const int32_t* __restrict__ block_table, int bt_stride,
                   int page_size, uint32_t* __restrict__ k_codes, uint8_t* __restrict__ k_scales,
                   uint32_t* __restrict__ v_codes, uint8_t* __restrict__ v_scales, long long code_page_stride,
                   long long code_head_stride, long long ks_page_stride, long long ks_head_stride,
                   long long vs_page_stride, long long vs_head_stride, const float* __restrict__ levels,
                   const float* __restrict__ fracs, int rules) {
  __shared__ uint8_t cs[MAX_NB][MAX_BS];
  const int n = blockIdx.x, kvh = blockIdx.y, side = blockIdx.z;
  const int num_kv_heads = gridDim.y;
  const int bs = side == 0 ? K_BLOCK : V_BLOCK, nb = D / bs;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= nb) return;
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
  const bool mse = (rules >> side) & 1;

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
    // Lane l rounds candidates l and l + 32 once; the loop takes candidate c from lane c % 32.
    const float cand_lo = lane < NUM_CAND ? zd::round_scale<SCALE_FMT>(__fmul_rn(s0, fracs[lane])) : 0.f;
    const float cand_hi = lane + 32 < NUM_CAND ? zd::round_scale<SCALE_FMT>(__fmul_rn(s0, fracs[lane + 32])) : 0.f;
    float best_err = __int_as_float(0x7f800000);
    scale = __shfl_sync(kFull, cand_lo, 0);  // candidate 0, should every error overflow to inf
#pragma unroll
    for (int c = 0; c < NUM_CAND; ++c) {
      const float cand = __shfl_sync(kFull, c < 32 ? cand_lo : cand_hi, c & 31);
      const float t0 = __fmul_rn(cand, m0), t1 = __fmul_rn(cand, m1), t2 = __fmul_rn(cand, m2);
      const float q0 = __fmul_rn(l0, cand), q1 = __fmul_rn(l1, cand);
      const float q2 = __fmul_rn(l2, cand), q3 = __fmul_rn(l3, cand);
      float err = 0.f;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        const float v = yv[i];
        const float q = v >= t1 ? (v >= t2 ? q3 : q2) : (v >= t0 ? q1 : q0);
        const float d = lane + 32 * i < bs ? __fsub_rn(v, q) : 0.f;
        err = __fmaf_rn(d, d, err);
      }
#pragma unroll
      for (int off = 16; off; off >>= 1) err = __fadd_rn(err, __shfl_xor_sync(kFull, err, off));
      if (err < best_err) best_err = err, scale = cand;
    }
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
    // barrier (the other warps have left) and share the block codes in `cs`.
    asm volatile("bar.sync 1, %0;" ::"r"(32 * nb) : "memory");
    uint8_t* qb = reinterpret_cast<uint8_t*>(codes + page * code_page_stride + kvh * code_head_stride +
                                             (long long)(j & ~3) * (D / 16));
    for (int w = threadIdx.x; w < D / 4; w += 32 * nb) {
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
