// One FP2 decode write of one row and side, the pieces: the tail shift, the scale search, the
// error-feedback chain and the packing of runtime/kv/fp2_cache.py's `write_decode_static`, for
// fp2_decode_write.cu (whose header comment explains the steps and their hazards), run by CTAs of
// kRowThreads threads.
//
// Shape legend: D head dim (HEAD_DIM), PER = D / 32 channels per lane, BS channels per scale block
// (K_BLOCK / V_BLOCK), NB = D / BS, C = NUM_CAND candidate scales.
#pragma once
#include <cuda_bf16.h>

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
// 1: the head's factor rows staged whole in dynamic shared memory (D * D floats, which the launch
// provides: kernels/kv_write.py decides, D <= 128); 0: the chain's ring loads them from L2 after a
// prefetch
#ifndef STAGE_ROWS
#define STAGE_ROWS 0
#endif
#ifndef V_QUAD
#define V_QUAD 0  // 1: value pages in the quad layout
#endif
// Channels a rounding error reaches (the format's feedback blocks, `fbblk`); 0: the whole head.
// Below D the factor is block diagonal and the chain runs the D / FB_BLOCK blocks side by side.
#ifndef FB_BLOCK
#define FB_BLOCK 0
#endif

namespace fp2w {
constexpr int D = HEAD_DIM;
constexpr int PER = D / 32;
constexpr int kRowThreads = 128;  // the write kernel's CTA
constexpr int kRowWarps = kRowThreads / 32;
constexpr int PREFETCH = 8;
constexpr unsigned kFull = 0xffffffffu;
static_assert(D % 32 == 0 && D <= 256, "head dim a multiple of 32, at most 256");
static_assert(K_BLOCK % 32 == 0 && V_BLOCK % 32 == 0 && D % K_BLOCK == 0 && D % V_BLOCK == 0, "blocks");
static_assert(!STAGE_ROWS || D <= 128, "a staged factor of more than 64 KB (kernels/kv_write.py stages D <= 128)");

// Rows S + 1 .. S + W of one (slot, head) to rows S .. S + W - 1: a memmove of W * D bf16, in
// 16-byte words, by the whole CTA (see the hazards in fp2_decode_write.cu).
__device__ void shift_tail(__nv_bfloat16* row_s, int window) {
  // uint4 per thread per chunk: one chunk (one round trip to memory) for a window of up to 64 rows
  // at D = 128; the registers are free here, the search and the chain come after
  constexpr int WORDS = 64 * 128 / 8 / kRowThreads;
  const int n = window * D / 8;
  uint4* dst = reinterpret_cast<uint4*>(row_s);
  const uint4* src = reinterpret_cast<const uint4*>(row_s + D);
  for (int base = 0; base < n; base += kRowThreads * WORDS) {
    uint4 r[WORDS];
#pragma unroll
    for (int k = 0; k < WORDS; ++k) {
      const int i = base + k * kRowThreads + threadIdx.x;
      if (i < n) r[k] = src[i];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < WORDS; ++k) {
      const int i = base + k * kRowThreads + threadIdx.x;
      if (i < n) dst[i] = r[k];
    }
  }
}

// PER consecutive factor columns of one row, this lane's (lane-major: columns PER * lane + j); SMEM:
// the row is in shared memory (plain loads), else in global memory (through the read-only path)
template <bool SMEM = bool(STAGE_ROWS)>
__device__ __forceinline__ void load_cols(float (&dst)[PER], const float* __restrict__ src) {
  if constexpr (PER % 4 == 0) {
#pragma unroll
    for (int j = 0; j < PER; j += 4) {
      float4 x;
      if constexpr (SMEM) x = *reinterpret_cast<const float4*>(src + j);
      else x = __ldg(reinterpret_cast<const float4*>(src + j));
      dst[j] = x.x, dst[j + 1] = x.y, dst[j + 2] = x.z, dst[j + 3] = x.w;
    }
  } else if constexpr (PER == 2) {
    float2 x;
    if constexpr (SMEM) x = *reinterpret_cast<const float2*>(src);
    else x = __ldg(reinterpret_cast<const float2*>(src));
    dst[0] = x.x, dst[1] = x.y;
  } else {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      if constexpr (SMEM) dst[j] = src[j];
      else dst[j] = __ldg(src + j);
    }
  }
}

__host__ __device__ constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }
// Channels per pass of the chain's loop: whole lane groups (PER) and whole turns of the factor
// ring (PREFETCH), so that both indices are compile-time inside it.
constexpr int CHAIN_STEP = PER / gcd(PER, PREFETCH) * PREFETCH;
static_assert(D % CHAIN_STEP == 0, "the chain's loop covers D");
// The chain's blocks (FB_BLOCK): FBW channels each, LPB lanes each (a lane's PER channels lie in one
// block), inside one scale block of either side (the lane's scale is then one for the whole chain).
constexpr int FBW = FB_BLOCK ? FB_BLOCK : D;
constexpr int LPB = FBW / PER;
static_assert(D % FBW == 0 && FBW % CHAIN_STEP == 0 && FBW % PER == 0, "feedback blocks of whole chain steps");
static_assert(FBW == D || (K_BLOCK % FBW == 0 && V_BLOCK % FBW == 0), "feedback blocks inside scale blocks");

// Step 4's error-feedback codes, channel by channel as fp2_feedback.cu does, from the factor rows
// over their diagonal (`rows`, [D, D]), warp 0. The torch body divides, z = v / s, and counts the
// midpoints z reaches (bucketize, right=True). On the chain a division is ~40 cycles a channel, so
// the fast pass (!EXACT) tests r_i = v - s m_i instead: one fma, rounded once, so !(r_i < 0) says
// v / s >= m_i exactly, except where r_i underflows to -0. The rounded quotient differs from the
// exact one only where v / s lies just below m_i and rounds up onto it (within half an ulp of m_i,
// at most s |m_i| 2^-24; within s 2^-150 of 0 where m_i is 0 or subnormal: a tiny negative
// quotient rounds to -0, which counts). The fast pass flags any value whose r_i lies in
// (-tol_i, -0], tol_i = max(s |m_i| 2^-21, s 2^-148, 2^-125), a band four times or more the
// widest of these, and the caller then runs the exact pass, with the divisions. For the format's
// levels (e5m2) times its scales (e4m3, E8M0) the band holds no float beside m_i != 0, so the exact
// pass is for tiny values and for other levels. NaN counts either way (!(NaN < x)). The three
// tests are monotone (m ascending, s > 0), so the level comes from them directly.
//
// The chain as a loop, not unrolled over D: a warp runs it once, so its instructions come from
// memory, not the instruction cache; fully unrolled (D steps, ~16 k instructions in the kernel) it
// spent a third of its cycles waiting on instruction fetch (Nsight Compute, H200). Lane-major: lane
// o holds channels PER * o + j, so PER - 1 of every PER steps find the next channel in the same
// lane. Each lane keeps two copies: wt, every error applied as it is shuffled out (the true values,
// in the reference's order), and wf, the group owner's own errors applied without waiting for the
// shuffle (the chain: decide, error, update the next channel). At a group's start its owner's wf
// is its wt, whose last error came by shuffle: one shuffle on the chain per PER channels. sh_v:
// the row, lane-strided ([D], channel 32 i + lane at 32 i + lane); codes come back lane-strided.
//
// The chain carries only what the next channel needs: the level's product with the scale comes
// from a table made once a block (the same fmul), and the owner keeps the value it decided from
// (dec), from which every lane derives its own codes and band test after the loop, all lanes at
// once. In the loop, the codes, their packing, the band test and the level's product took 20 of
// 47 instructions a channel (NVRTC 13.0; 27 without them), and a write's CTA 1.5 us more on an
// H100 (docs/fp2-kernel.md, "The chain without its codes").
template <int BS, bool EXACT>
__device__ __forceinline__ bool feedback_codes(const float* __restrict__ sh_v, int (&code)[PER], int lane,
                                               const float* __restrict__ rows, const float (&scale)[D / BS],
                                               const float (&m)[3], const float (&l)[4]) {
  constexpr int NB = D / BS;
  float wt[PER], wf[PER], dec[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) wt[j] = sh_v[PER * lane + j];
  float ring[PREFETCH][PER];  // ring[c % PREFETCH]: row c of the factor, this lane's columns
  // Per block: its scale, the current block's first; the loop moves them down one at each block
  // boundary (an index by the loop's channel would put them in local memory). ls: the current
  // block's levels times its scale, as the reference's error takes them.
  float sb[NB], ls[4];
#pragma unroll
  for (int b = 0; b < NB; ++b) sb[b] = scale[b];
  // x / s >= m_i, the one test the chain decides by and the codes are read back with after it
  auto at_or_above = [&](float x, float s, int i) {
    return EXACT ? !(__fdiv_rn(x, s) < m[i]) : !(__fmaf_rn(-s, m[i], x) < 0.f);
  };
  auto next_block = [&]() {
#pragma unroll
    for (int b = 0; b + 1 < NB; ++b) sb[b] = sb[b + 1];
  };
  auto block_levels = [&]() {
#pragma unroll
    for (int k = 0; k < 4; ++k) ls[k] = __fmul_rn(l[k], sb[0]);
  };
  // One step: lane o decides its channel j (at scale s) and every lane takes the error through the
  // factor's row r, its own columns. Both chains below run it; j, o and the ring slot are
  // compile-time after unrolling.
  auto chain_step = [&](int j, int o, float s, const float (&r)[PER]) {
    if (j == 0) {
#pragma unroll
      for (int jj = 0; jj < PER; ++jj) wf[jj] = wt[jj];
    }
    bool ge[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) ge[i] = at_or_above(wf[j], s, i);
    if (lane == o) dec[j] = wf[j];
    // the tests are monotone (ge[2] -> ge[1] -> ge[0]): two selects deep
    const float lvl_s = ge[1] ? (ge[2] ? ls[3] : ls[2]) : (ge[0] ? ls[1] : ls[0]);
    const float err_own = __fsub_rn(wf[j], lvl_s);
#pragma unroll
    for (int jj = j + 1; jj < PER; ++jj) wf[jj] = __fsub_rn(wf[jj], __fmul_rn(r[jj], err_own));
    const float err = __shfl_sync(kFull, err_own, o);
    // every lane's channels, those already decided too (never read again; a branch costs more)
#pragma unroll
    for (int jj = 0; jj < PER; ++jj) wt[jj] = __fsub_rn(wt[jj], __fmul_rn(r[jj], err));
  };
  if constexpr (FBW < D) {
    // The blocks side by side (FB_BLOCK): step t decides channel FBW b + t of every block b at once,
    // lane group b (lanes LPB b .. LPB b + LPB - 1) the one that holds block b's channels. The
    // factor is zero between blocks, so these are the one chain's codes: a zero factor times a
    // finite error subtracts an exact zero (the cache zeroes or refuses NaN / Inf rows before any
    // write, runtime/kv/cache.py; the sign of a zero changes no code).
    const int b = lane / LPB, first = LPB * b;
    float s = scale[0];
#pragma unroll
    for (int k = 1; k < NB; ++k)
      if (FBW * b >= k * BS) s = scale[k];
#pragma unroll
    for (int k = 0; k < 4; ++k) ls[k] = __fmul_rn(l[k], s);
    const float* brows = rows + size_t(FBW * b) * D + PER * lane;  // row FBW b + t at brows + t D
#pragma unroll
    for (int p = 0; p < PREFETCH; ++p) load_cols(ring[p], brows + p * D);
#pragma unroll 1
    for (int t0 = 0; t0 < FBW; t0 += CHAIN_STEP) {
#pragma unroll
      for (int u = 0; u < CHAIN_STEP; ++u) {
        const int t = t0 + u;
        chain_step(u % PER, first + t / PER, s, ring[u % PREFETCH]);  // t0 is a multiple of PER
        if (t + PREFETCH < FBW) load_cols(ring[u % PREFETCH], brows + (t + PREFETCH) * D);
      }
    }
  } else {  // the one chain over the head
#pragma unroll
    for (int p = 0; p < PREFETCH; ++p) load_cols(ring[p], rows + p * D + PER * lane);
    block_levels();
#pragma unroll 1
    for (int c0 = 0; c0 < D; c0 += CHAIN_STEP) {
      if constexpr (BS % CHAIN_STEP == 0) {
        if (c0 > 0 && c0 % BS == 0) next_block(), block_levels();
      }
#pragma unroll
      for (int t = 0; t < CHAIN_STEP; ++t) {
        const int c = c0 + t;
        if constexpr (BS % CHAIN_STEP != 0) {
          if (c > 0 && c % BS == 0) next_block(), block_levels();
        }
        chain_step(t % PER, c / PER, sb[0], ring[t % PREFETCH]);  // c0 is a multiple of PER
        if (c + PREFETCH < D) load_cols(ring[t % PREFETCH], rows + (c + PREFETCH) * D + PER * lane);
      }
    }
  }
  // Each lane's own channels, from the values it decided them from, with the same tests: the code,
  // and the band test, -tol < r <= -0, on the bits: |r| < tol with the sign bit set is
  // (bits(r) ^ sign) < bits(tol), unsigned (-0 included: an fma that underflows keeps the sign).
  bool near = false;
  uint32_t packed = 0;  // the lane's codes, 2 bits per channel of its group
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    float s = scale[0];  // channel PER * lane + j's block (a group may straddle two: D = 96, PER = 3)
#pragma unroll
    for (int b = 1; b < NB; ++b)
      if (PER * lane + j >= b * BS) s = scale[b];
    int q = 0;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      q += int(at_or_above(dec[j], s, i));
      if (!EXACT) {
        const float r = __fmaf_rn(-s, m[i], dec[j]);
        const uint32_t tol = __float_as_uint(fmaxf(fmaxf(s * fabsf(m[i]) * 0x1p-21f, s * 0x1p-126f * 0x1p-22f), 0x1p-125f));
        near |= (__float_as_uint(r) ^ 0x80000000u) < tol;
      }
    }
    packed |= uint32_t(q) << (2 * j);
  }
  // back to lane-strided: channel 32 i + lane is field (32 i + lane) % PER of lane (32 i + lane) / PER
#pragma unroll
  for (int i = 0; i < PER; ++i)
    code[i] = int(__shfl_sync(kFull, packed, (32 * i + lane) / PER) >> (2 * ((32 * i + lane) % PER))) & 3;
  return near;
}

// The exact pass, out of line so that the fast pass keeps its registers (inlined beside it, the
// two cost 255 registers and spills at D = 128 with 32-channel key blocks, NVRTC 13.0). Its
// inputs and codes go through shared memory (arrays by reference would put the fast pass's
// arrays in local memory too): v and the scales as the fast pass found them, codes [D] back.
template <int BS>
__device__ __noinline__ void feedback_codes_exact(const float* __restrict__ rows, int lane, float m0, float m1,
                                                  float m2, float l0, float l1, float l2, float l3,
                                                  const float* __restrict__ sh_v, const float* __restrict__ sh_scale,
                                                  int* __restrict__ sh_code) {
  float scale[D / BS];
  int code[PER] = {};
#pragma unroll
  for (int b = 0; b < D / BS; ++b) scale[b] = sh_scale[b];
  const float m[3] = {m0, m1, m2}, l[4] = {l0, l1, l2, l3};
  feedback_codes<BS, true>(sh_v, code, lane, rows, scale, m, l);
#pragma unroll
  for (int i = 0; i < PER; ++i) sh_code[32 * i + lane] = code[i];
}

// Step 4's scales for one side (BS channels per block), the MSE search shared by every warp of the
// CTA (a __syncthreads inside: the caller is uniform per CTA); v: the row, lane-strided, in every
// warp. Absmax scales go straight into `scale`; for MSE each warp takes its share of the
// candidates, leaves its least (error, candidate) per block in shared memory, and after the barrier
// every thread picks the first least error over the shares.
template <int BS>
__device__ __forceinline__ void block_scales(const float (&v)[PER], int lane, int warp, const float* __restrict__ lv,
                             const float* __restrict__ fracs, bool mse, float (&scale)[D / BS]) {
  constexpr int NB = D / BS, SPB = BS / 32;  // blocks per token, slots per block
  constexpr int CPW = (NUM_CAND + kRowWarps - 1) / kRowWarps;  // MSE candidates per warp
  __shared__ double sh_err[D / 32][kRowWarps];
  __shared__ float sh_scale[D / 32][kRowWarps];
  const float l0 = lv[0], l1 = lv[1], l2 = lv[2], l3 = lv[3];
  // midpoints(): (L[i + 1] + L[i]) / 2, a halving being exact either way
  const float m0 = __fmul_rn(__fadd_rn(l1, l0), 0.5f);
  const float m1 = __fmul_rn(__fadd_rn(l2, l1), 0.5f);
  const float m2 = __fmul_rn(__fadd_rn(l3, l2), 0.5f);
  const float lmax = fmaxf(fmaxf(fabsf(l0), fabsf(l1)), fmaxf(fabsf(l2), fabsf(l3)));
  float frac[CPW];  // this warp's share of the candidates: c = warp * CPW + k
#pragma unroll
  for (int k = 0; k < CPW; ++k) frac[k] = mse && warp * CPW + k < NUM_CAND ? fracs[warp * CPW + k] : 0.f;

#pragma unroll
  for (int b = 0; b < NB; ++b) {
    float amax = 0.f;
#pragma unroll
    for (int i = b * SPB; i < (b + 1) * SPB; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int off = 16; off; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
    const float s0 = __fdiv_rn(amax, lmax);
    if (!mse) {
      scale[b] = zd::round_scale<SCALE_FMT>(s0);
      continue;
    }
    float cand[CPW];
    double err[CPW];
#pragma unroll
    for (int k = 0; k < CPW; ++k) {
      cand[k] = zd::round_scale<SCALE_FMT>(__fmul_rn(s0, frac[k]));
      const float t0 = __fmul_rn(cand[k], m0), t1 = __fmul_rn(cand[k], m1), t2 = __fmul_rn(cand[k], m2);
      // L * cand is exact in fp32 (a few significant bits each) unless it overflows, which needs
      // |y| near 2^126 with E8M0 scales: then every error is inf and candidate 0 stays (torch's
      // fp64 search would still rank them); stored-space values never come near
      const float q0 = __fmul_rn(l0, cand[k]), q1 = __fmul_rn(l1, cand[k]), q2 = __fmul_rn(l2, cand[k]);
      const float q3 = __fmul_rn(l3, cand[k]);
      err[k] = 0.0;
#pragma unroll
      for (int i = b * SPB; i < (b + 1) * SPB; ++i) {
        const float y = v[i];
        const float q = y >= t1 ? (y >= t2 ? q3 : q2) : (y >= t0 ? q1 : q0);
        const double d = double(y) - double(q);
        err[k] = fma(d, d, err[k]);
      }
    }
    // the butterflies round by round over the share: CPW shuffles in flight, not one
#pragma unroll
    for (int off = 16; off; off >>= 1) {
#pragma unroll
      for (int k = 0; k < CPW; ++k) err[k] += __shfl_xor_sync(kFull, err[k], off);
    }
    // the share's first least error; +inf and its first candidate where every error overflows
    double best = __longlong_as_double(0x7ff0000000000000ll);
    float pick = cand[0];
#pragma unroll
    for (int k = 0; k < CPW; ++k)
      if (warp * CPW + k < NUM_CAND && err[k] < best) best = err[k], pick = cand[k];
    if (lane == 0) sh_err[b][warp] = best, sh_scale[b][warp] = pick;
  }
  if (!mse) return;
  __syncthreads();
  // shares in candidate order, strict <: the first least error over all (candidate 0 where every
  // error overflows to inf)
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    double best = sh_err[b][0];
    scale[b] = sh_scale[b][0];
#pragma unroll
    for (int w = 1; w < kRowWarps; ++w)
      if (sh_err[b][w] < best) best = sh_err[b][w], scale[b] = sh_scale[b][w];
  }
}

// The staged build's factor: the head's [D, D] fp32 rows into shared memory by one bulk copy, whose
// bytes complete phase 0 of the mbarrier `bar` (one thread calls it, once per CTA).
__device__ __forceinline__ void stage_rows(float4* dst, const float* __restrict__ src, unsigned long long* bar) {
  const uint32_t b = uint32_t(__cvta_generic_to_shared(bar)), d = uint32_t(__cvta_generic_to_shared(dst));
  constexpr uint32_t kBytes = D * D * 4;  // at most 64 KB (STAGE_ROWS needs D <= 128)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the init, before the copy's bytes
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(kBytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(d), "l"(src), "r"(kBytes), "r"(b) : "memory");
}

// The staged factor has landed and the calling warp sees it (warp 0, before the chain; thread 0
// initialised the mbarrier in step 2).
__device__ __forceinline__ void rows_staged(unsigned long long* bar) {
  const uint32_t b = uint32_t(__cvta_generic_to_shared(bar));
  __syncwarp();  // thread 0's init, seen by its warp (no CTA barrier follows it under the absmax rule)
  asm volatile(
      "{\n"
      " .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      " @!done bra WAIT_%=;\n"
      "}" ::"r"(b) : "memory");
}

// Step 4's codes and step 5 for one side, one warp; v: the row, lane-strided; scale: the blocks'
// scales. words: the row's D/16 words, or with quad its quad's D/4 words, the row being token
// quad_token (0..3). quad is a run-time flag so that keys and values can share one instance (the
// packing is all that differs).
template <int BS>
__device__ __forceinline__ void quantize_row(float (&v)[PER], int lane, bool quad, const float* __restrict__ lv,
                                             const float (&scale)[D / BS], const float* __restrict__ rows,
                                             uint32_t* __restrict__ words, int quad_token,
                                             uint8_t* __restrict__ scale_bytes) {
  constexpr int NB = D / BS, SPB = BS / 32;  // blocks per token, slots per block
  const float l0 = lv[0], l1 = lv[1], l2 = lv[2], l3 = lv[3];
  const float m0 = __fmul_rn(__fadd_rn(l1, l0), 0.5f);
  const float m1 = __fmul_rn(__fadd_rn(l2, l1), 0.5f);
  const float m2 = __fmul_rn(__fadd_rn(l3, l2), 0.5f);

  // the chain's row, scales and codes (feedback_codes_exact)
  __shared__ float sh_v[D], sh_scale[D / 32];
  __shared__ int sh_code[D];
  int code[PER] = {};
  if (rows == nullptr) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const float z = __fdiv_rn(v[i], scale[i / SPB]);
      code[i] = int(!(z < m0)) + int(!(z < m1)) + int(!(z < m2));  // bucketize(right=True)
    }
  } else {
    const float m[3] = {m0, m1, m2}, l[4] = {l0, l1, l2, l3};
#pragma unroll
    for (int i = 0; i < PER; ++i) sh_v[32 * i + lane] = v[i];
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < NB; ++b) sh_scale[b] = scale[b];  // (scale[lane] would put scale in local memory)
    }
    __syncwarp();  // sh_v is read across lanes
    if (__any_sync(kFull, feedback_codes<BS, false>(sh_v, code, lane, rows, scale, m, l))) {
      feedback_codes_exact<BS>(rows, lane, m0, m1, m2, l0, l1, l2, l3, sh_v, sh_scale, sh_code);
      __syncwarp();
#pragma unroll
      for (int i = 0; i < PER; ++i) code[i] = sh_code[32 * i + lane];
    }
  }

  if (quad) {
    // Quad word (g, k) = g * PER + k holds, in byte quad_token, the channels 32k + 8f + g (f = 0..3,
    // field f): lanes g, g + 8, g + 16, g + 24 of slot k.
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      uint32_t x = uint32_t(code[i]) << (2 * (lane >> 3));
      x |= __shfl_xor_sync(kFull, x, 8);
      x |= __shfl_xor_sync(kFull, x, 16);
      if (lane < 8) reinterpret_cast<uint8_t*>(words)[4 * (lane * PER + i) + quad_token] = uint8_t(x);
    }
  } else {
    // 16 codes to a word, code j at bits 2j: word 2i holds lanes 0..15 of slot i, word 2i + 1 lanes 16..31
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      uint32_t w = uint32_t(code[i]) << (2 * (lane & 15));
#pragma unroll
      for (int off = 1; off < 16; off <<= 1) w |= __shfl_xor_sync(kFull, w, off);
      if ((lane & 15) == 0) words[2 * i + (lane >> 4)] = w;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < NB; ++b) scale_bytes[b] = uint8_t(zd::encode_scale<SCALE_FMT>(scale[b]));
  }
}
}  // namespace fp2w
