// The engine's fixed-shape FP2 decode write in one launch: runtime/kv/fp2_cache.py's
// `write_decode_static` (its torch body is the reference) for formats that flush one token at a
// time into channel blocks, symmetric scales, absmax or MSE rule, nearest or error-feedback codes.
//
// Shape legend: Bp padded batch rows, H KV heads, D head dim (HEAD_DIM), R bf16 rows per sequence
// slot (sinks S, window W, one arriving row), P page size, BS channels per scale block (K_BLOCK /
// V_BLOCK), NB = D / BS, PER = D / 32 channels per lane, C = NUM_CAND candidate scales.
//
// grid (Bp, H, 2 sides: K then V), NUM_THREADS threads. Per (row, head, side):
//   1. the new token (stored space, bf16) goes to its row of the slot's bf16 region;
//   2. every warp reads the new token into registers, lane l holding channels l + 32 i (its codes
//      are written now, at arrival, into its own page row: runtime/kv/fp2_cache.py); thread 0
//      starts one bulk copy of the head's factor rows into shared memory (the staged build,
//      STAGE_ROWS: D <= 128 and short grids; step 4's feedback reads them there), or the CTA asks
//      L2 for them (the L2 build);
//   3. where the row flushes (its oldest tail row joins the FP2 range, whose codes were written
//      when it arrived), the whole CTA moves rows S + 1 .. S + W up by one (the torch body's "tail
//      moves up"); elsewhere the tail stays. A sink's codes go to the scratch page;
//   4. each block's scale: absmax (warp 0), or the MSE search of attn_fp2_write.cu shared by the
//      four warps (candidates round(absmax / max|L| * frac_c), codes placed by y >= s_c * m_i,
//      first least error; warp w scores a contiguous share, the least (error, candidate) over the
//      shares taken from shared memory; the errors summed in fp64, as the torch search's prefix
//      sums are, so that both pick the same candidate unless two errors agree to ~1e-13); then
//      warp 0 places the codes: nearest (y / s >= m_i) or error feedback channel by channel as
//      fp2_feedback.cu, bit for bit, from the factor rows pre-divided by their diagonal (`rows`:
//      the same IEEE quotients that kernel recomputes at each use);
//   5. codes packed 16 to a word by warp shuffles, scales encoded, both stored at (page, page row);
//      with V_QUAD the values' codes go out as one byte per quad word instead (the quad layout,
//      runtime/kv/pack.py): byte stores, so the other three tokens of the quad are untouched.
//
// Why the search is shared, the chain a loop and the factor staged: a decode write is one short row
// per (sequence, head, side), so its time is its latency. One warp running 2 blocks x 33 candidates
// of fp64 butterflies, then a feedback chain that waited on factor rows from DRAM (a serving
// step's factor is not in L2: the attention before it streams the whole cache), took ~63 us a
// launch at any batch; 45 us with the shared search, an L2 prefetch and the fast pass below; 15.5
// with the chain rolled into a loop (its unrolled ~16 k instructions, run once, waited on
// instruction fetch); 13-15 with the factor copied into shared memory while the search runs (H200,
// docs/benchmarks.md); on an H100, 11.8-12.0 against 13.3-13.6 at B = 8 with the chain carrying
// only what the next channel needs (fp2_write_row.cuh); on the H200, 11.7-11.9 against 12.0-12.2
// with the factor staged by one bulk copy instead of 4096 cp.async of 16 bytes. Where K_BLOCK ==
// V_BLOCK both sides run one instance of steps 4 and 5 (41 KB of code instead of 68): within 0.3
// us alone, and 0.5-0.7 us a layer cheaper beside the decode at B = 8, L = 32k on an H100, perhaps
// because a write's code shares the SM's instruction caches with the decode's (docs/fp2-kernel.md,
// "Code a launch runs past").
//
// Hazards. Step 3 moves the rows in chunks, every chunk read whole
// before any thread stores it, so a store never lands on a row a later chunk still reads. The
// feedback chain is sequential over D channels: the factor rows are loaded PREFETCH channels ahead
// into a register ring, keeping the load latency off the chain. The staged factor is read only by
// warp 0, after its bytes have completed the mbarrier's phase 0 (thread 0 initialised it before
// starting the copy, and its warp meets it at a __syncwarp before the wait); the bulk copy needs
// the factor 16-byte aligned (the cache makes it a fresh contiguous tensor). Padding rows all name
// the scratch slot and page: their writes race, and nothing reads them.
#include "fp2_write_row.cuh"

namespace {
using namespace fp2w;
constexpr int NUM_THREADS = kRowThreads;
}  // namespace

// yk, yv        [Bp, H, D] bf16: the new tokens in the stored space
// index         [5, Bp] int64: slot, row, flush (nonzero: yes), the new token's page and page row
//               (StaticDecodeIndex)
// hp_k, hp_v    [slots + 1, H, R, D] bf16: the bf16 regions
// k_codes, v_codes    [pages + 1, H, P, D / 16] int32; k_scales, v_scales [pages + 1, H, P, NB] uint8
// k_levels, v_levels  [4] fp32 sorted; fracs [C] fp32 (MSE candidates)
// k_rows, v_rows      [H, D, D] fp32 feedback factor / its diagonal per row, or null (nearest codes)
// rules         bit 0: keys take the MSE rule (else absmax), bit 1: values
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
    fp2_decode_write(const __nv_bfloat16* __restrict__ yk, const __nv_bfloat16* __restrict__ yv,
                     const long long* __restrict__ index, __nv_bfloat16* hp_k, __nv_bfloat16* hp_v, int hp_rows,
                     uint32_t* __restrict__ k_codes, uint32_t* __restrict__ v_codes, uint8_t* __restrict__ k_scales,
                     uint8_t* __restrict__ v_scales, int page_size, const float* __restrict__ k_levels,
                     const float* __restrict__ v_levels, const float* __restrict__ fracs,
                     const float* __restrict__ k_rows, const float* __restrict__ v_rows, int num_sinks, int window,
                     int rules) {
  const int b = blockIdx.x, h = blockIdx.y, side = blockIdx.z;
  const int Bp = gridDim.x, H = gridDim.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long slot = index[b], row = index[Bp + b], page = index[3 * Bp + b], prow = index[4 * Bp + b];
  const bool flush = index[2 * Bp + b] != 0;

  __nv_bfloat16* hp = (side == 0 ? hp_k : hp_v) + (slot * H + h) * hp_rows * D;  // [R, D] of (slot, head)
  const __nv_bfloat16* y = (side == 0 ? yk : yv) + ((long long)b * H + h) * D;

  // 1. the new token to its row
  if (threadIdx.x < D / 8)
    reinterpret_cast<uint4*>(hp + row * D)[threadIdx.x] = reinterpret_cast<const uint4*>(y)[threadIdx.x];
  __syncthreads();

  // 2. the new token, lane-strided, into every warp (the search is shared); the head's factor
  // rows copied into shared memory (staged build) or asked of L2 (L2 build) now, so that the
  // chain's register ring does not wait on DRAM
  float v[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) v[i] = __bfloat162float(y[32 * i + lane]);
  const float* rows = side == 0 ? k_rows : v_rows;  // [H, D, D], or null: nearest codes
  extern __shared__ float4 sh_rows4[];  // [D, D] fp32 with STAGE_ROWS
  __shared__ __align__(8) unsigned long long sh_rows_bar;  // the staged factor's arrival (STAGE_ROWS)
  if (rows != nullptr) {
    rows += (long long)h * D * D;
    if constexpr (STAGE_ROWS) {
      // one bulk copy (the TMA unit) by thread 0, its completion counted on an mbarrier that warp 0
      // waits on before the chain: the threads' 4096 copies of 16 bytes took their issue time and
      // went through the SM's load path beside the decode's (docs/fp2-kernel.md, "One bulk copy")
      if (threadIdx.x == 0) stage_rows(sh_rows4, rows, &sh_rows_bar);
      rows = reinterpret_cast<const float*>(sh_rows4);
    } else {
      for (int line = threadIdx.x; line < D * D / 32; line += NUM_THREADS)  // 128-byte lines
        asm volatile("prefetch.global.L2 [%0];" ::"l"(rows + 32 * line));
    }
  }
  // 3. the tail moves up where the row flushes (uniform per CTA: the barriers inside are safe)
  if (flush && window > 0) shift_tail(hp + num_sinks * D, window);

  // 4, 5. scales (every warp), codes and stores at (page, page row): the new token's own page, or
  // the scratch page (warp 0)
  const long long at = (page * H + h) * page_size + prow;
  if constexpr (K_BLOCK == V_BLOCK) {
    // one instance for both sides (the format's default): the side picks the pointers and the
    // packing at run time, so the kernel's code is one side's (see the header)
    const float* levels = side == 0 ? k_levels : v_levels;
    const bool quad = V_QUAD && side == 1;
    float scale[D / K_BLOCK];
    block_scales<K_BLOCK>(v, lane, warp, levels, fracs, (rules >> side) & 1, scale);
    if (warp == 0) {
      if (STAGE_ROWS && rows != nullptr) rows_staged(&sh_rows_bar);
      quantize_row<K_BLOCK>(v, lane, quad, levels, scale, rows,
                            (side == 0 ? k_codes : v_codes) + (quad ? at & ~3LL : at) * (D / 16), int(prow & 3),
                            (side == 0 ? k_scales : v_scales) + at * (D / K_BLOCK));
    }
  } else if (side == 0) {
    float scale[D / K_BLOCK];
    block_scales<K_BLOCK>(v, lane, warp, k_levels, fracs, rules & 1, scale);
    if (warp == 0) {
      if (STAGE_ROWS && rows != nullptr) rows_staged(&sh_rows_bar);
      quantize_row<K_BLOCK>(v, lane, false, k_levels, scale, rows, k_codes + at * (D / 16), 0,
                            k_scales + at * (D / K_BLOCK));
    }
  } else {
    float scale[D / V_BLOCK];
    block_scales<V_BLOCK>(v, lane, warp, v_levels, fracs, (rules >> 1) & 1, scale);
    if (warp == 0) {
      if (STAGE_ROWS && rows != nullptr) rows_staged(&sh_rows_bar);
      quantize_row<V_BLOCK>(v, lane, V_QUAD, v_levels, scale, rows,
                            v_codes + (V_QUAD ? at & ~3LL : at) * (D / 16), int(prow & 3),
                            v_scales + at * (D / V_BLOCK));
    }
  }
}
