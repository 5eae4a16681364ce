// Error-feedback rounding of FP2 codes: runtime/kv/feedback.py's `feedback_codes` on the GPU.
//
// Shape legend: T tokens, H KV heads, D head dim (HEAD_DIM), PER = ceil(D / 32) channels per lane.
//
// One warp per (token, KV head), NUM_WARPS of them per CTA. Lane l holds channels l, l + 32, ...
// (slot i = channel 32 i + l) in registers: the running value, its scale, offset and keep flag.
// Channel c (owner: lane c % 32, slot c / 32) is rounded in turn: every lane computes a code and an
// error for its own slot-(c / 32) value (only the owner's is kept), the owner's error goes to all
// lanes with one shuffle, and every lane subtracts rows[c, j] * err from its channels j, where
// rows[c, :] = factor[h, c, :] / factor[h, c, c]. Channels j <= c are updated too: they are never
// read again, and skipping them would cost a branch per element for nothing.
//
// Bit-exact with the torch loop on a CUDA device, operation for operation: IEEE division for x / s
// and for the factor row over its diagonal (recomputed at each use: no workspace, off the critical
// path), the product rounded before the subtraction (torch's CUDA addcmul with value = -1 is
// fma(-1, round(r * err), y) = y - round(r * err)), and no FMA contraction anywhere (explicit
// __f*_rn). Each channel receives its updates in channel order, as in the reference loop. On the
// CPU torch's addcmul rounds differently, so only the CUDA reference is matched bit for bit.
//
// Hazard: the chain c -> c + 1 is sequential (D steps, each a division and a shuffle deep), so the
// kernel is latency bound; the next factor row is loaded one step ahead to keep the L2 latency
// off that chain. The factor ([H, D, D] fp32, 64 KB per head at D = 128) is read through the
// read-only cache, not staged in shared memory: every warp of a head reads the same rows.
#include <cuda/std/cstdint>

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif

namespace {
constexpr int D = HEAD_DIM;
constexpr int PER = (D + 31) / 32;
constexpr unsigned FULL = 0xffffffffu;
static_assert(D >= 1 && D <= 256, "head dim 1..256 (PER <= 8 registers per array)");

// Row c of the head's factor, this lane's columns, and its diagonal entry.
__device__ __forceinline__ void load_row(const float* __restrict__ f, int c, int lane, float (&row)[PER],
                                         float& diag) {
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int j = 32 * i + lane;
    row[i] = j < D ? __ldg(f + c * D + j) : 0.f;
  }
  diag = __ldg(f + c * D + c);
}
}  // namespace

// y        [T, H, D] fp32 stored-space values, element strides (y_st, y_sh, y_sd)
// scales   [T, H, D] fp32 per element (block values broadcast: stride 0 allowed)
// offsets  [T, H, D] fp32 or null (symmetric)
// exact    [T, H, D] bool (1 byte) or null: elements kept exactly (their error is not fed forward)
// levels   [4] fp32 sorted; factor [H, D, D] fp32 contiguous, from `feedback_factor`
// codes    [T, H, D] uint8 contiguous (output)
extern "C" __global__ void __launch_bounds__(32 * NUM_WARPS)
    fp2_feedback(const float* __restrict__ y, long long y_st, long long y_sh, long long y_sd,
                 const float* __restrict__ scales, long long s_st, long long s_sh, long long s_sd,
                 const float* __restrict__ offsets, long long o_st, long long o_sh, long long o_sd,
                 const uint8_t* __restrict__ exact, long long e_st, long long e_sh, long long e_sd,
                 const float* __restrict__ levels, const float* __restrict__ factor,
                 uint8_t* __restrict__ codes, int num_tokens, int num_heads) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long pair = (long long)blockIdx.x * NUM_WARPS + warp;
  if (pair >= (long long)num_tokens * num_heads) return;  // whole warp: the shuffles stay full
  const long long t = pair / num_heads, h = pair % num_heads;
  const bool has_off = offsets != nullptr, has_exact = exact != nullptr;

  const float lv0 = __ldg(levels), lv1 = __ldg(levels + 1), lv2 = __ldg(levels + 2), lv3 = __ldg(levels + 3);
  // midpoints(): (L[i + 1] + L[i]) / 2, a halving being exact either way
  const float m0 = __fmul_rn(__fadd_rn(lv1, lv0), 0.5f);
  const float m1 = __fmul_rn(__fadd_rn(lv2, lv1), 0.5f);
  const float m2 = __fmul_rn(__fadd_rn(lv3, lv2), 0.5f);

  float v[PER], s[PER], o[PER], keep[PER];  // running value, scale, offset, 0 where kept exactly
  int code[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const long long j = 32 * i + lane;
    const bool in = j < D;
    v[i] = in ? y[t * y_st + h * y_sh + j * y_sd] : 0.f;
    s[i] = in ? scales[t * s_st + h * s_sh + j * s_sd] : 1.f;
    o[i] = in && has_off ? offsets[t * o_st + h * o_sh + j * o_sd] : 0.f;
    keep[i] = in && has_exact && exact[t * e_st + h * e_sh + j * e_sd] ? 0.f : 1.f;
    code[i] = 0;
  }

  const float* f = factor + h * D * D;  // this head's [D, D]
  float next[PER], next_diag;
  load_row(f, 0, lane, next, next_diag);

#pragma unroll
  for (int i0 = 0; i0 < PER; ++i0) {
    const int owners = D - 32 * i0 < 32 ? D - 32 * i0 : 32;  // lanes owning a channel in slot i0
    for (int src = 0; src < owners; ++src) {
      const int c = 32 * i0 + src;
      float row[PER];
#pragma unroll
      for (int i = 0; i < PER; ++i) row[i] = next[i];
      const float diag = next_diag;
      if (c + 1 < D) load_row(f, c + 1, lane, next, next_diag);

      const float x = has_off ? __fsub_rn(v[i0], o[i0]) : v[i0];  // offsets cancel in the error
      const float z = __fdiv_rn(x, s[i0]);
      // bucketize(z, mids, right=True): the number of midpoints m with !(z < m) (an upper-bound search)
      const int k = int(!(z < m0)) + int(!(z < m1)) + int(!(z < m2));
      if (lane == src) code[i0] = k;
      const float lvl = k == 0 ? lv0 : k == 1 ? lv1 : k == 2 ? lv2 : lv3;
      float err = __fsub_rn(x, __fmul_rn(lvl, s[i0]));
      if (has_exact) err = __fmul_rn(err, keep[i0]);
      err = __shfl_sync(FULL, err, src);
#pragma unroll
      for (int i = i0; i < PER; ++i) v[i] = __fsub_rn(v[i], __fmul_rn(__fdiv_rn(row[i], diag), err));
    }
  }

  uint8_t* dst = codes + pair * D;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int j = 32 * i + lane;
    if (j < D) dst[j] = uint8_t(code[i]);
  }
}
