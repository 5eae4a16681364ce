// Combine over peer pointers: expert outputs back to their source, reduced there by router weight.
//
// N packed rows, T tokens, K top-k, D hidden, W world size. Layout: moe_layout.cuh.
//
//   moe_combine_send    row i of the packed outputs -> row recv_src_idx[i] of rank
//                       recv_src_rank[i]'s combine buffer; the last block sets flag[my_rank] on
//                       every rank (ring order), after a system fence.
//   moe_combine_wait    one block: bounded wait for all W flags, then zero them.
//   moe_combine_reduce  out[t] = sum_k topk_weight[t, k] * row[t * K + k] over chosen k, fp32.
#include <cuda/std/cstdint>

#include "comm_ordering.cuh"
#include "moe_layout.cuh"

extern "C" __global__ void moe_combine_send(
    const __nv_bfloat16* expert_out,  // [cap, D] packed
    const int* recv_src_rank,         // [cap]
    const int* recv_src_idx,          // [cap]
    const int* recv_num_rows,         // [1] valid packed rows
    const unsigned long long* peer_base,  // [W]
    long long off_comb, long long off_comb_flag, int hidden, int world_size, int my_rank,
    const int* ring_peers,     // [W]
    unsigned int* done_blocks  // [1] zero on entry; the last block re-zeroes it
) {
  const int num_rows = *recv_num_rows;
  for (int i = blockIdx.x; i < num_rows; i += gridDim.x) {
    unsigned char* base = reinterpret_cast<unsigned char*>(peer_base[recv_src_rank[i]]);
    auto* dst = reinterpret_cast<__nv_bfloat16*>(base + off_comb) + static_cast<long long>(recv_src_idx[i]) * hidden;
    zd::copy_row_bf16(dst, expert_out + static_cast<long long>(i) * hidden, hidden);
  }
  if (zd::last_block_done(done_blocks)) {
    for (int s = threadIdx.x; s < world_size; s += blockDim.x) {
      unsigned char* base = reinterpret_cast<unsigned char*>(peer_base[ring_peers[s]]);
      zd::st_release_sys(reinterpret_cast<long long*>(base + off_comb_flag) + my_rank, 1);
    }
    if (threadIdx.x == 0) *done_blocks = 0u;
  }
}

extern "C" __global__ void moe_combine_wait(unsigned char* my_base, long long off_comb_flag, int world_size,
                                            unsigned long long timeout_ns, unsigned long long* error) {
  auto* flags = reinterpret_cast<long long*>(my_base + off_comb_flag);
  for (int src = threadIdx.x; src < world_size; src += blockDim.x) {
    zd::wait_flag(flags + src, timeout_ns, error, 2, src, -1);
    // Safe to zero: src sets it again only after its next dispatch of this phase reached us.
    flags[src] = 0;
  }
}

extern "C" __global__ void moe_combine_reduce(const unsigned char* my_base, long long off_comb,
                                              const long long* topk_idx,  // [T, K]
                                              const float* topk_weight,   // [T, K]
                                              int num_tokens, int top_k, int hidden,
                                              __nv_bfloat16* out  // [T, D]
) {
  const auto* rows = reinterpret_cast<const __nv_bfloat16*>(my_base + off_comb);
  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < top_k; ++k) {
        if (topk_idx[t * top_k + k] < 0) continue;  // never written: no expert for this choice
        const float w = topk_weight[t * top_k + k];
        const int4 raw = reinterpret_cast<const int4*>(rows + static_cast<long long>(t * top_k + k) * hidden)[i];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(h[j]);
          acc[2 * j] = fmaf(w, f.x, acc[2 * j]);
          acc[2 * j + 1] = fmaf(w, f.y, acc[2 * j + 1]);
        }
      }
      __nv_bfloat162 o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
      reinterpret_cast<int4*>(out + static_cast<long long>(t) * hidden)[i] = *reinterpret_cast<const int4*>(o);
    }
  }
}
