// Shared pieces of the FP2 decode-attention kernels: PTX wrappers (byte permute, tensor-core MMA,
// 8x8 transpose, cp.async), FP2 code expansion and 8-bit scale decoding.
//
// FP2 codes: 16 per uint32, element j of a group of 16 at bits [2j, 2j+1] (docs/fp2-format.md).
// Expansion of one word is a byte-permute table lookup: 16 codes -> 8 half2 at about 1.2-1.4
// instructions per element, or -> 16 bytes (int8 keys) at 0.56 (docs/fp2-kernel.md, "Code expansion").
#pragma once
#include <cuda_fp16.h>
#include <cuda/std/cstdint>

using cuda::std::int32_t;
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uint8_t;

#define ZD_DEVICE __device__ __forceinline__
#define ZD_NEG_INF (-__int_as_float(0x7f800000))

namespace zd {

// ---- PTX wrappers -------------------------------------------------------------------------------

ZD_DEVICE uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// D += A (16x16, row) * B (16x8, col); fp16 inputs, fp32 accumulators (m16n8k16 fragments).
ZD_DEVICE void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D += A (16x32, row) * B (32x8, col); int8 inputs, int32 accumulators (m16n8k32 fragments: a lane
// (g, t) holds A rows g / g + 8 at k 4t..4t+3 and 16+4t..16+4t+3, four bytes to a register, lowest
// k in the lowest byte; B column g at the same k). Native on sm_90 (IMMA.16832); the e4m3 form of
// this instruction is not (it compiles to conversions plus two fp16 HMMAs).
ZD_DEVICE void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x rounded to the nearest integer (ties to even) as an int8 byte, saturating.
ZD_DEVICE uint32_t s8_byte(float x) {
  int d;
  asm("cvt.rni.sat.s8.f32 %0, %1;" : "=r"(d) : "f"(x));
  return uint32_t(d) & 0xFFu;
}

// Transpose of an 8x8 b16 matrix held in the standard fragment layout (lane: row lane/4, columns
// 2*(lane%4) and +1): afterwards the lane holds row lane/4 of the transpose.
ZD_DEVICE uint32_t movmatrix_trans(uint32_t x) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x));
  return d;
}

ZD_DEVICE uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The dynamic shared memory this launch was given, in bytes (what the host passed, not a constant
// of the build).
ZD_DEVICE uint32_t dynamic_smem_bytes() {
  uint32_t r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// 16-byte global -> shared copy of the first src_bytes bytes, the rest zero-filled (the decode kernel
// always copies whole 16-byte chunks; it masks tokens outside its range after the MMA instead).
ZD_DEVICE void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// A whole 16-byte chunk through L1 (`.ca`), issued only if `pred` (a predicated instruction, no
// branch): the decode's stage copies. Through L1 each warp's copy asks L2 for the 16 sectors of its
// 512 bytes; the L2-only form above (`.cg`) asks for 32 (Nsight Compute's count), and `.ca` cut
// the decode's time by 4.5-6.9% at B = 8 and at B = 1, 128k on an H100 (docs/fp2-kernel.md,
// "The stage copies through L1"). Hazard: L1 is not coherent within a launch, so only for data no
// CTA of the same launch writes (the pages; never the partials the merge reads: `cp_async16`).
ZD_DEVICE void cp_async16_ca_if(bool pred, uint32_t dst, const void* src) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p cp.async.ca.shared.global [%1], [%2], 16;\n}" ::"r"(
          int(pred)),
      "r"(dst), "l"(src)
      : "memory");
}
ZD_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
ZD_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

ZD_DEVICE float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// (a & b) | c in one LOP3. Written as PTX with register operands because LOP3 takes at most one
// immediate: the plain C++ form with two constants compiles to two instructions.
ZD_DEVICE uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The constant c as a value ptxas cannot rebuild, computed from `any` (a value the kernel loaded:
// min(|any|, 1) * 0 is +0 whatever its bits, a NaN included, yet not a constant to ptxas). A loop
// constant that an instruction can only take from a register (an IMMA's C operand, LOP3's second
// constant) is otherwise rebuilt by a move every iteration; this one stays live across the loop,
// at a register each.
ZD_DEVICE uint32_t kept_constant(uint32_t c, float any) { return c | __float_as_uint(fminf(fabsf(any), 1.f) * 0.f); }

// x, through an asm the compiler cannot see through: an operand it cannot fold or reassociate with
// what is added to it later (pinned, below, does the same for a pointer).
ZD_DEVICE uint32_t opaque(uint32_t x) {
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
  return x;
}

// p, computed once and kept in a register: the compiler cannot see through the asm, so it neither
// splits it back into uniform base + lane offset nor recomputes it inside a loop.
template <typename T>
ZD_DEVICE T* pinned(T* p) {
  uint64_t x;
  asm volatile("mov.b64 %0, %1;" : "=l"(x) : "l"(reinterpret_cast<uint64_t>(p)));
  return reinterpret_cast<T*>(x);
}
ZD_DEVICE uint32_t h2_as_u32(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
ZD_DEVICE __half2 u32_as_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

ZD_DEVICE uint32_t pack_half2(float lo, float hi) { return h2_as_u32(__floats2half2_rn(lo, hi)); }

// ---- scales -------------------------------------------------------------------------------------

enum ScaleFmt { kScaleE4M3 = 0, kScaleE8M0 = 1 };

// Two 8-bit scales (in bytes 0 and 1 of `pair`) -> half2(s0, s1). Exact: E4M3 values are fp16
// values; E8M0 exponents are clamped into fp16's normal range (the stored space has unit RMS per
// head, so real scales sit far inside it).
template <int FMT>
ZD_DEVICE uint32_t scales_to_half2(uint32_t pair) {
  if constexpr (FMT == kScaleE4M3) {
    uint32_t d;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(static_cast<uint16_t>(pair & 0xFFFFu)));
    return d;
  } else {
    // 2^(e-127) as fp16 bits: (e - 112) << 10, e clamped to [113, 142] (fp16 normals).
    uint32_t e0 = min(max(pair & 0xFFu, 113u), 142u), e1 = min(max((pair >> 8) & 0xFFu, 113u), 142u);
    return ((e0 - 112u) << 10) | ((e1 - 112u) << 26);
  }
}

// Two E4M3 bytes (bits 0-15, or 16-31) as half2, exactly; the high form reads the register's high
// half directly (no shift).
ZD_DEVICE uint32_t e4m3x2_lo(uint32_t x) {
  uint32_t d;
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(d) : "r"(x));
  return d;
}
ZD_DEVICE uint32_t e4m3x2_hi(uint32_t x) {
  uint32_t d;
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(d) : "r"(x));
  return d;
}

// Two value scales for the quad layout, where they multiply P (<= 2^7) in fp16: scales_to_half2,
// with E8M0 clamped to [2^-14, 2^8] instead (E4M3 stays <= 448), so that the product stays finite.
template <int FMT>
ZD_DEVICE uint32_t value_scales_to_half2(uint32_t pair) {
  if constexpr (FMT == kScaleE4M3) {
    return scales_to_half2<kScaleE4M3>(pair);
  } else {
    uint32_t e0 = min(max(pair & 0xFFu, 113u), 135u), e1 = min(max((pair >> 8) & 0xFFu, 113u), 135u);
    return ((e0 - 112u) << 10) | ((e1 - 112u) << 26);
  }
}

// One 8-bit scale as fp32, exactly (E8M0: 2^(e-127), no clamping; the byte 0xFF, NaN by the
// format, gives inf, which only unwritten slots hold and the kernels mask).
template <int FMT>
ZD_DEVICE float scale_to_float(uint32_t byte) {
  if constexpr (FMT == kScaleE4M3) {
    return __low2float(u32_as_h2(scales_to_half2<kScaleE4M3>(byte & 0xFFu)));  // exact in fp16
  } else {
    return byte ? __uint_as_float(byte << 23) : __uint_as_float(0x00400000u);  // 2^-127 is subnormal
  }
}

// A positive fp32 scale rounded to the format, as runtime/kv/scales.round_scale (E4M3:
// round-to-nearest-even clamped into [2^-9, 448]; E8M0: nearest power of two in log2, ties up).
template <int FMT>
ZD_DEVICE float round_scale(float s) {
  if constexpr (FMT == kScaleE4M3) {
    s = fminf(fmaxf(s, 0.001953125f), 448.f);  // [2^-9, 448]
    uint16_t b;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(b) : "f"(0.f), "f"(s));  // s -> low byte
    return __low2float(u32_as_h2(scales_to_half2<kScaleE4M3>(b)));
  } else {
    const float e = fminf(fmaxf(floorf(log2f(fmaxf(s, 5.877471754e-39f)) + 0.5f), -127.f), 127.f);
    return exp2f(e);
  }
}

// The storage byte of an already-rounded scale (runtime/kv/scales.encode_scale).
template <int FMT>
ZD_DEVICE uint32_t encode_scale(float s) {
  if constexpr (FMT == kScaleE4M3) {
    uint16_t b;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(b) : "f"(0.f), "f"(s));
    return b & 0xFFu;
  } else {
    return uint32_t(int(rintf(log2f(s))) + 127);
  }
}

// ---- code expansion -----------------------------------------------------------------------------
//
// Both expansions give, for one code word w (code j at bits [2j, 2j+1]):
//   out[2s] = half2(L[code s], L[code 4+s]),  out[2s+1] = half2(L[code 8+s], L[code 12+s]),  s = 0..3.
// What an instruction costs here was measured (benchmarks/issue_rates.py; docs/fp2-kernel.md,
// "Issue costs"): LOP3, PRMT, SHF, I2FP, FMNMX and F2FP share the integer ALU pipe, one warp
// instruction per two cycles; IMAD.SHL runs beside PRMT on the heavy FMA pipe, IMAD.HI takes four
// cycles there and stalls PRMT; HADD2 issues beside PRMT at full rate. So left shifts are IMAD.SHL
// (shl_fma), a selector's high half comes down by HADD2 (hi16), and the one right shift by 2 is a
// plain SHF.

template <int N>
ZD_DEVICE uint32_t shl_fma(uint32_t x) {  // x << N as IMAD.SHL
  uint32_t d;
  asm("mul.lo.u32 %0, %1, %2;" : "=r"(d) : "r"(x), "n"(1u << N));
  return d;
}
template <int N>
ZD_DEVICE uint32_t shr_fma(uint32_t x) {  // x >> N (1 <= N < 32) as IMAD.HI (expand_word_f16 only)
  static_assert(N >= 1 && N < 32, "shift");
  uint32_t d;
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(d) : "r"(x), "n"(1u << (32 - N)));
  return d;
}

// A selector's high 16 bits brought down to its low 16 bits (where prmt reads them): one HADD2
// that adds -0 to the high half and writes it to both halves. HADD2 issues on the FMA pipes; the
// alternatives are a shift on the ALU pipe (which the permutes fill) or IMAD.HI, which takes four
// issue cycles of the heavy FMA pipe (measured on the H200: docs/fp2-kernel.md, "Issue costs").
// Exact because every selector half is a finite fp16 bit pattern (bytes <= 0x76: the exponent
// field is never all ones), and x + (-0) = x bit for bit for every finite x, -0 and subnormals
// included (fp16 arithmetic keeps subnormals).
ZD_DEVICE uint32_t hi16(uint32_t x) {
  uint32_t d;
  asm("{.reg .b16 l, h, z; mov.b32 {l, h}, %1; mov.b16 z, 0x8000; add.rn.f16 l, h, z; mov.b32 %0, {l, l};}"
      : "=r"(d)
      : "r"(x));
  return d;
}

// fp16 table (any levels, e.g. already multiplied by a key block scale): t01 = half2(L0, L1),
// t23 = half2(L2, L3), so bytes 2c, 2c+1 of the pair (t01, t23) hold level c. prmt reads four
// selector nibbles from the low 16 bits of its selector; nibbles (2c0, 2c0+1, 2c1, 2c1+1) give
// half2(L[c0], L[c1]). With a code c in the low 2 bits of a byte, c * 0x22 + 0x10 is exactly that
// nibble pair, so one IMAD turns four bytes of codes into two selectors (bytes 0-1, 2-3; the
// second brought down by hi16). Per word: 4 LOP3 + 8 PRMT (ALU), 3 + 4 IMAD, 4 HADD2.
ZD_DEVICE void expand_word_f16(uint32_t w, uint32_t t01, uint32_t t23, uint32_t (&out)[8]) {
  const uint32_t ws[4] = {w, shr_fma<2>(w), shr_fma<4>(w), shr_fma<6>(w)};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t x = ws[s] & 0x03030303u;           // byte b = code 4b + s
    const uint32_t sel = x * 0x22u + 0x10101010u;     // nibble pairs for all four bytes
    out[2 * s] = prmt(t01, t23, sel);
    out[2 * s + 1] = prmt(t01, t23, hi16(sel));
  }
}

// e5m2-exact levels (docs/fp2-format.md): each fp16 level is its high byte over a zero low byte,
// so the table is one register t = (hb(L0), hb(L1), hb(L2), hb(L3)) and a zero register supplies
// the low bytes: selector nibbles (4, c0, 4, c1) give half2(L[c0], L[c1]). A byte 0b00cc0100 is
// such a nibble pair, i.e. (w' & 0x30303030) | 0x04040404 with the codes moved to bits 4-5 of
// each byte: one LOP3 per four codes and no multiply (`fours` is 0x04040404, in a register: LOP3
// takes one immediate). Per word: 4 LOP3 + 8 PRMT + 1 SHF (ALU), 2 IMAD.SHL, 4 HADD2.
ZD_DEVICE void expand_word_e5m2(uint32_t w, uint32_t t, uint32_t fours, uint32_t (&out)[8]) {
  // Code 4b+s sits at bits 8b+2s; bring it to 8b+4.
  const uint32_t ws[4] = {shl_fma<4>(w), shl_fma<2>(w), w, w >> 2};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t sel = and_or(ws[s], 0x30303030u, fours);
    out[2 * s] = prmt(t, 0u, sel);
    out[2 * s + 1] = prmt(t, 0u, hi16(sel));
  }
}

// 8-bit table (e.g. the levels as int8): t = (L0, L1, L2, L3) as bytes, and a code c in the low 2
// bits of a selector nibble picks byte c. One word gives four registers of four 8-bit values:
//   out[0] = L[codes 0, 2, 4, 6]   out[1] = L[codes 8, 10, 12, 14]
//   out[2] = L[codes 1, 3, 5, 7]   out[3] = L[codes 9, 11, 13, 15]
// (w & 0x33333333 leaves code 2n in nibble n; prmt reads the low four nibbles). Per word: 2 LOP3 +
// 4 PRMT + 1 SHF (ALU) and 2 HADD2: 9 instructions for 16 elements, against 19-23 for fp16 halves.
ZD_DEVICE void expand_word_bytes(uint32_t w, uint32_t t, uint32_t (&out)[4]) {
  const uint32_t even = w & 0x33333333u, odd = (w >> 2) & 0x33333333u;
  out[0] = prmt(t, 0u, even);
  out[1] = prmt(t, 0u, hi16(even));
  out[2] = prmt(t, 0u, odd);
  out[3] = prmt(t, 0u, hi16(odd));
}

}  // namespace zd
