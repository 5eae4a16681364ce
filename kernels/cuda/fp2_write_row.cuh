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

// One float of the factor: shared memory (the staged build, plain loads) or global memory (the L2
// build, through the read-only path)
__device__ __forceinline__ float load_factor(const float* __restrict__ src) {
  if constexpr (STAGE_ROWS) return *src;
  else return __ldg(src);
}

// The chain's slots across the CTA's warps. Slot i (channels 32 i .. 32 i + 31, lane-strided: lane l
// holds channel 32 i + l) is decided by warp i % kRowWarps, after the slots before it; every other
// warp that holds a later slot applies slot i's 32 errors to it when they are out (one named barrier
// a slot, ids 1 .. PER - 1: 0 is __syncthreads').
__host__ __device__ constexpr int slot_warp(int i) { return i % kRowWarps; }
// warp w's last slot, or -1 where it holds none (D < 128)
__host__ __device__ constexpr int last_slot(int w) { return w < PER ? w + (PER - 1 - w) / kRowWarps * kRowWarps : -1; }
// the warps that wait on slot i's errors: those, other than its own, with a later slot
__host__ __device__ constexpr int slot_waiters(int i) {
  int n = 0;
  for (int w = 0; w < kRowWarps; ++w) n += int(w != slot_warp(i) && last_slot(w) > i);
  return n;
}
static_assert(PER <= 15, "a named barrier a slot");

// Step 4's error-feedback codes, channel by channel as fp2_feedback.cu does, from the factor rows
// over their diagonal (`rows`, [D, D]), warp WARP's slots. The torch body divides, z = v / s, and
// counts the midpoints z reaches (bucketize, right=True). On the chain a division is ~40 cycles a
// channel, so the fast pass tests r_i = v - s m_i instead: one fma, rounded once, so
// !(r_i < 0) says v / s >= m_i exactly, except where r_i underflows to -0. The rounded quotient
// differs from the exact one only where v / s lies just below m_i and rounds up onto it (within half
// an ulp of m_i, at most s |m_i| 2^-24; within s 2^-150 of 0 where m_i is 0 or subnormal: a tiny
// negative quotient rounds to -0, which counts). The fast pass flags any value whose r_i lies in
// (-tol_i, -0], tol_i = max(s |m_i| 2^-21, s 2^-148, 2^-125), a band four times or more the widest
// of these, and the caller then runs the exact pass, with the divisions. For the format's levels
// (e5m2) times its scales (e4m3, E8M0) the band holds no float beside m_i != 0, so the exact pass is
// for tiny values and for other levels. NaN counts either way (!(NaN < x)). The three tests are
// monotone (m ascending, s > 0), so the level comes from them directly.
//
// Why the chain is spread over the warps. A write costs the decode beside it about the
// instructions its busiest warp issues: the write's CTAs share SMs with the next layer's decode,
// whose warps the issue slots bound, and the decode ends with its slowest split. With the whole
// chain in one warp, every channel's error went to all D running values (2 D / 32 instructions a
// channel, 27 in all: 3456 at D = 128, ~1.8 us of the decode at B = 1, L = 32k on an H100,
// docs/fp2-kernel.md "The chain across the warps"). Here a warp keeps only its own slots' values:
// while it decides slot i, every error goes to its own 32 channels (the lanes already decided
// waste theirs: a branch costs more), and the errors of earlier slots come from shared memory in
// one pass each, 32 products and subtractions. Each value still takes every earlier error in
// channel order, rounded as the reference rounds it (products rounded before each subtraction):
// the same bits. What it costs is latency: a warp applies the slot before its own before starting.
//
// The chain proper (decide, error, shuffle it out, update) is one shuffle deep a channel: lane t
// owns channel 32 i + t. The loop is rolled by PREFETCH channels, a turn of the factor ring, so that
// the ring's index stays compile-time (unrolled over D the chain waited on instruction fetch: a
// third of its cycles, Nsight Compute, H200). The owner keeps the value it decided from (dec); after
// the loop every lane derives its own channels' codes and band test from it, with the same tests.
template <int BS, int WARP>
__device__ __forceinline__ bool feedback_warp(const float (&v)[PER], int (&code)[PER], int lane,
                                              const float* __restrict__ rows, const float (&scale)[D / BS],
                                              const float (&m)[3], const float (&l)[4], float* __restrict__ sh_err) {
  // x / s >= m_i but where the band test below flags x, the one test the chain decides by and the
  // codes are read back with after it
  auto at_or_above = [&](float x, float s, int i) { return !(__fmaf_rn(-s, m[i], x) < 0.f); };
  // the level x is placed on, times the scale (ls: the four products): the three tests side by
  // side, then two selects deep, the tests being monotone (ge2 -> ge1 -> ge0). (The tests inside
  // the selects' arms are evaluated one after the other, each behind the last one's predicate.)
  auto level_times_scale = [&](float x, float s, const float (&ls)[4]) {
    const bool ge0 = at_or_above(x, s, 0), ge1 = at_or_above(x, s, 1), ge2 = at_or_above(x, s, 2);
    return ge1 ? (ge2 ? ls[3] : ls[2]) : (ge0 ? ls[1] : ls[0]);
  };
  float x[PER], dec[PER];  // this warp's slots: running values, then the values decided from
#pragma unroll
  for (int i = 0; i < PER; ++i) x[i] = v[i], dec[i] = 0.f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    if (slot_warp(i) == WARP) {
      // slot i's chain; every slot of this warp from i on takes its errors
      const float s = scale[32 * i / BS];  // a slot lies in one block (BS % 32 == 0)
      float ls[4];  // the levels times the scale, as the reference's error takes them
#pragma unroll
      for (int k = 0; k < 4; ++k) ls[k] = __fmul_rn(l[k], s);
      float ring[PREFETCH][PER];  // ring[t % PREFETCH][i2]: row 32 i + t of the factor, slot i2's column
#pragma unroll
      for (int p = 0; p < PREFETCH; ++p)
#pragma unroll
        for (int i2 = i; i2 < PER; i2 += kRowWarps) ring[p][i2] = load_factor(rows + (32 * i + p) * D + 32 * i2 + lane);
#pragma unroll 1
      for (int t0 = 0; t0 < 32; t0 += PREFETCH) {
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u) {
          const int t = t0 + u;
          const float err_own = __fsub_rn(x[i], level_times_scale(x[i], s, ls));
          if (lane == t) dec[i] = x[i];
          const float err = __shfl_sync(kFull, err_own, t);
#pragma unroll
          for (int i2 = i; i2 < PER; i2 += kRowWarps) x[i2] = __fsub_rn(x[i2], __fmul_rn(ring[u][i2], err));
          if (t0 + PREFETCH < 32) {
#pragma unroll
            for (int i2 = i; i2 < PER; i2 += kRowWarps)
              ring[u][i2] = load_factor(rows + (32 * i + t + PREFETCH) * D + 32 * i2 + lane);
          }
        }
      }
      if (slot_waiters(i) > 0) {
        // the slot's errors out: the owner's, remade from the value it decided from (the same bits)
        sh_err[32 * i + lane] = __fsub_rn(dec[i], level_times_scale(dec[i], s, ls));
        asm volatile("bar.arrive %0, %1;" ::"r"(1 + i), "r"(32 * (1 + slot_waiters(i))) : "memory");
      }
    } else if (last_slot(WARP) > i) {
      // slot i's errors, channel by channel, to this warp's later slots (rolled: see the exact pass)
      asm volatile("bar.sync %0, %1;" ::"r"(1 + i), "r"(32 * (1 + slot_waiters(i))) : "memory");
#pragma unroll 1
      for (int t0 = 0; t0 < 32; t0 += 8) {
        const float4 e0 = *reinterpret_cast<const float4*>(sh_err + 32 * i + t0);
        const float4 e1 = *reinterpret_cast<const float4*>(sh_err + 32 * i + t0 + 4);
        const float err[8] = {e0.x, e0.y, e0.z, e0.w, e1.x, e1.y, e1.z, e1.w};
#pragma unroll
        for (int u = 0; u < 8; ++u)
#pragma unroll
          for (int i2 = WARP; i2 < PER; i2 += kRowWarps)
            if (i2 > i)
              x[i2] = __fsub_rn(x[i2], __fmul_rn(load_factor(rows + (32 * i + t0 + u) * D + 32 * i2 + lane), err[u]));
      }
    }
  }
  // This warp's codes from the values decided from, and the band test, -tol < r <= -0, on the bits:
  // |r| < tol with the sign bit set is (bits(r) ^ sign) < bits(tol), unsigned (-0 included: an fma
  // that underflows keeps the sign).
  bool near = false;
#pragma unroll
  for (int i = WARP; i < PER; i += kRowWarps) {
    const float s = scale[32 * i / BS];
    int q = 0;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      q += int(at_or_above(dec[i], s, k));
      const float r = __fmaf_rn(-s, m[k], dec[i]);
      const uint32_t tol = __float_as_uint(fmaxf(fmaxf(s * fabsf(m[k]) * 0x1p-21f, s * 0x1p-126f * 0x1p-22f), 0x1p-125f));
      near |= (__float_as_uint(r) ^ 0x80000000u) < tol;
    }
    code[i] = q;
  }
  return near;
}

// Step 4's fast-pass codes for the calling warp's slots (code[i], i % kRowWarps == warp; the others
// stay 0); true where one of this lane's values lies in the band. Every warp of the CTA calls it.
template <int BS>
__device__ __forceinline__ bool feedback_codes(const float (&v)[PER], int (&code)[PER], int lane, int warp,
                                               const float* __restrict__ rows, const float (&scale)[D / BS],
                                               const float (&m)[3], const float (&l)[4], float* __restrict__ sh_err) {
  static_assert(kRowWarps == 4, "one case a warp");
  switch (warp) {
    case 0: return feedback_warp<BS, 0>(v, code, lane, rows, scale, m, l, sh_err);
    case 1: return feedback_warp<BS, 1>(v, code, lane, rows, scale, m, l, sh_err);
    case 2: return feedback_warp<BS, 2>(v, code, lane, rows, scale, m, l, sh_err);
    default: return feedback_warp<BS, 3>(v, code, lane, rows, scale, m, l, sh_err);
  }
}

// The exact pass, with the divisions (the torch body's z = v / s against the midpoints), where the
// fast pass flagged a value: warp 0 alone, the running values in shared memory (sh_x: the row in
// channel order, [D], consumed), channel by channel in the reference's order; codes to sh_code [D].
// It runs for tiny values and for levels other than the format's, so it is written for size, not
// speed: rolled, and out of line, where its code lies past the kernel's own. Code among the paths a
// launch runs costs the launch even where no warp runs it (95 KB of never-run code inside the
// kernel added 8 us to a write, the same in a function after it 0.4 us: docs/fp2-kernel.md, "The
// chain across the warps").
template <int BS>
__device__ __noinline__ void feedback_codes_exact(const float* __restrict__ rows, int lane, float m0, float m1,
                                                  float m2, float l0, float l1, float l2, float l3,
                                                  float* __restrict__ sh_x, const float* __restrict__ sh_scale,
                                                  int* __restrict__ sh_code) {
#pragma unroll 1
  for (int c = 0; c < D; ++c) {
    const float s = sh_scale[c / BS], x = sh_x[c];  // channel c, with every error before it applied
    const int q = int(!(__fdiv_rn(x, s) < m0)) + int(!(__fdiv_rn(x, s) < m1)) + int(!(__fdiv_rn(x, s) < m2));
    const float err = __fsub_rn(x, __fmul_rn(q == 3 ? l3 : q == 2 ? l2 : q == 1 ? l1 : l0, s));
    __syncwarp();  // every lane has read channel c before any lane updates
    if (lane == 0) sh_code[c] = q;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int j = 32 * i + lane;
      if (j > c) sh_x[j] = __fsub_rn(sh_x[j], __fmul_rn(rows[c * D + j], err));
    }
    __syncwarp();
  }
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

// The staged factor has landed and the calling warp sees it (every warp, before the chain; thread 0
// initialised the mbarrier before step 1's CTA barrier).
__device__ __forceinline__ void rows_staged(unsigned long long* bar) {
  const uint32_t b = uint32_t(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n"
      " .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      " @!done bra WAIT_%=;\n"
      "}" ::"r"(b) : "memory");
}

// Step 4's codes and step 5 for one side, every warp of the CTA, each its own slots (slot i: channels
// 32 i + lane, warp i % kRowWarps); v: the row, lane-strided; scale: the blocks' scales. words: the
// row's D/16 words, or with quad its quad's D/4 words, the row being token quad_token (0..3).
template <int BS>
__device__ __forceinline__ void quantize_row(float (&v)[PER], int lane, int warp, const float* __restrict__ lv,
                                             const float (&scale)[D / BS], const float* __restrict__ rows,
                                             bool quad, uint32_t* __restrict__ words, int quad_token,
                                             uint8_t* __restrict__ scale_bytes) {
  constexpr int NB = D / BS, SPB = BS / 32;  // blocks per token, slots per block
  const float l0 = lv[0], l1 = lv[1], l2 = lv[2], l3 = lv[3];
  const float m0 = __fmul_rn(__fadd_rn(l1, l0), 0.5f);
  const float m1 = __fmul_rn(__fadd_rn(l2, l1), 0.5f);
  const float m2 = __fmul_rn(__fadd_rn(l3, l2), 0.5f);

  // the chain's slot errors; the exact pass's row, scales and codes (feedback_codes_exact)
  __shared__ __align__(16) float sh_err[D];
  __shared__ float sh_v[D], sh_scale[D / 32];
  __shared__ int sh_code[D];
  int code[PER] = {};
  if (rows == nullptr) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (slot_warp(i) != warp) continue;
      const float z = __fdiv_rn(v[i], scale[i / SPB]);
      code[i] = int(!(z < m0)) + int(!(z < m1)) + int(!(z < m2));  // bucketize(right=True)
    }
  } else {
    const float m[3] = {m0, m1, m2}, l[4] = {l0, l1, l2, l3};
#pragma unroll
    for (int i = 0; i < PER; ++i)
      if (slot_warp(i) == warp) sh_v[32 * i + lane] = v[i];
    if (threadIdx.x == 0) {
#pragma unroll
      for (int b = 0; b < NB; ++b) sh_scale[b] = scale[b];  // (scale[lane] would put scale in local memory)
    }
    // rows is uniform per CTA, so every thread meets the barrier; it also orders sh_scale and sh_v
    // before the exact pass, and the fast pass's reads of sh_err before the exact pass's stores
    if (__syncthreads_or(feedback_codes<BS>(v, code, lane, warp, rows, scale, m, l, sh_err))) {
      if (warp == 0) feedback_codes_exact<BS>(rows, lane, m0, m1, m2, l0, l1, l2, l3, sh_v, sh_scale, sh_code);
      __syncthreads();  // (the branch is uniform per CTA)
#pragma unroll
      for (int i = 0; i < PER; ++i)
        if (slot_warp(i) == warp) code[i] = sh_code[32 * i + lane];
    }
  }

#pragma unroll
  for (int i = 0; i < PER; ++i) {
    if (slot_warp(i) != warp) continue;
    if (quad) {
      // Quad word (g, k) = g * PER + k holds, in byte quad_token, the channels 32k + 8f + g (f = 0..3,
      // field f): lanes g, g + 8, g + 16, g + 24 of slot k.
      uint32_t x = uint32_t(code[i]) << (2 * (lane >> 3));
      x |= __shfl_xor_sync(kFull, x, 8);
      x |= __shfl_xor_sync(kFull, x, 16);
      if (lane < 8) reinterpret_cast<uint8_t*>(words)[4 * (lane * PER + i) + quad_token] = uint8_t(x);
    } else {
      // 16 codes to a word, code j at bits 2j: word 2i holds lanes 0..15 of slot i, word 2i + 1 lanes 16..31
      uint32_t w = uint32_t(code[i]) << (2 * (lane & 15));
#pragma unroll
      for (int off = 1; off < 16; off <<= 1) w |= __shfl_xor_sync(kFull, w, off);
      if ((lane & 15) == 0) words[2 * i + (lane >> 4)] = w;
    }
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < NB; ++b) scale_bytes[b] = uint8_t(zd::encode_scale<SCALE_FMT>(scale[b]));
  }
}
}  // namespace fp2w
