// Fused router + dispatch over peer pointers, and the receive side (bounded wait, pack).
//
// T tokens, E experts, K top-k (<= 8), D hidden, W world size, Elm max local experts, El local
// experts, Tm max tokens per rank. Layout of the receive buffers: moe_layout.cuh.
//
//   moe_dispatch_send   one block per token (grid-strided): top-k of the token's logits and its
//                       weights (or the choices given); a slot per (token, choice) by an atomic on the
//                       (dst, local expert) counter; the row stored straight into the owner's slab
//                       (bf16 or FP8), choices visited in this rank's ring order; the last block to
//                       finish publishes count + 1 to every (dst, local expert) flag, ring order.
//   moe_dispatch_wait   one block: bounded wait on the El x W flags, counts, packed offsets, load
//                       counters; zeroes the flags for the next use of this phase.
//   moe_dispatch_pack   rows from the slab into the expert-major packed layout (dequantizing FP8).
//
// No host sync anywhere: sizes are worst-case, so the three launches can be captured in a graph.
#include <cuda/std/cstdint>

#include "comm_ordering.cuh"
#include "moe_layout.cuh"
#include "moe_route.cuh"

extern "C" __global__ void moe_dispatch_send(
    const __nv_bfloat16* x,            // [T, D]
    const float* logits,               // [T, E] (ROUTE_LOGITS) or null
    long long* topk_idx,               // [T, K] in for ROUTE_TOPK, else out
    float* topk_weight,                // [T, K] likewise
    int num_tokens, int hidden, int num_experts, int top_k, int route_mode, int scoring, int renormalize,
    const int* owner_rank,                // [E, R]
    const int* owner_local,               // [E, R]
    const int* num_owners,                // [E]
    int max_owners,                       // R
    const int* ring_pos,                  // [W] step at which this rank visits each rank
    const int* ring_peers,                // [W] this rank's visit order, itself first
    const int* num_local_experts,         // [W]
    const unsigned long long* peer_base,  // [W] every rank's buffer of this phase, as we address it
    int world_size, int my_rank, int max_local_experts, int max_tokens, int msg_bytes, int wire_fp8,
    long long off_msg, long long off_info, long long off_flag,
    int* send_counter,         // [W * Elm] zero on entry; the last block re-zeroes it
    unsigned int* done_blocks  // [1] zero on entry; the last block re-zeroes it
) {
  extern __shared__ float s_logits[];  // [E]
  __shared__ long long s_idx[zd::kMaxTopk];
  __shared__ float s_w[zd::kMaxTopk];
  __shared__ int s_dst[zd::kMaxTopk], s_le[zd::kMaxTopk], s_slot[zd::kMaxTopk], s_order[zd::kMaxTopk];
  const int W = world_size, Elm = max_local_experts;

  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const __nv_bfloat16* x_row = x + static_cast<long long>(t) * hidden;
    zd::route_token(t, logits, topk_idx, topk_weight, num_experts, top_k, route_mode, scoring, renormalize,
                    owner_rank, owner_local, num_owners, max_owners, ring_pos, W, Elm, send_counter, s_logits,
                    s_idx, s_w, s_dst, s_le, s_slot, s_order);
    for (int j = 0; j < top_k; ++j) {
      const int k = s_order[j], dst = s_dst[k];
      if (dst < 0) continue;
      const long long row = zd::slab_row(s_le[k], my_rank, s_slot[k], W, max_tokens);
      unsigned char* base = reinterpret_cast<unsigned char*>(peer_base[dst]);
      unsigned char* msg = base + off_msg + row * msg_bytes;
      if (wire_fp8) {
        zd::quantize_row_fp8(msg, x_row, hidden);
      } else {
        zd::copy_row_bf16(msg, x_row, hidden);
      }
      if (threadIdx.x == 0) reinterpret_cast<int*>(base + off_info)[row] = t * top_k + k;
    }
    __syncthreads();  // s_* are rewritten by the next token
  }

  if (zd::last_block_done(done_blocks)) {
    for (int i = threadIdx.x; i < W * Elm; i += blockDim.x) {
      const int dst = ring_peers[i / Elm], le = i % Elm;
      if (le >= num_local_experts[dst]) continue;
      const int count = atomicExch(&send_counter[dst * Elm + le], 0);
      auto* flag = reinterpret_cast<long long*>(reinterpret_cast<unsigned char*>(peer_base[dst]) + off_flag);
      zd::st_release_sys(flag + le * W + my_rank, static_cast<long long>(count) + 1);
    }
    if (threadIdx.x == 0) *done_blocks = 0u;
  }
}

extern "C" __global__ void moe_dispatch_wait(
    unsigned char* my_base,  // this rank's buffer of this phase
    long long off_flag, int world_size, int num_local_experts,
    int* recv_counts,                  // [El, W] out
    int* recv_pair_offsets,            // [El, W] out: start of each pair in the packed rows
    int* recv_expert_offsets,          // [El] out: cumulative ends
    int* recv_num_tokens_per_expert,   // [El] out
    long long* expert_load,            // [El] += rows received (the dashboard's counters)
    int* recv_num_rows,                // [1] out
    unsigned long long timeout_ns, unsigned long long* error) {
  extern __shared__ int s_counts[];  // [El * W + El]
  const int W = world_size, El = num_local_experts, n = El * W;
  int* s_expert_start = s_counts + n;
  auto* flags = reinterpret_cast<long long*>(my_base + off_flag);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long v = zd::wait_flag(flags + i, timeout_ns, error, 1, i % W, i / W);
    // Zeroing is safe here: src writes this flag again only in its next dispatch of this phase,
    // which comes after a combine that waits for this rank, which runs after this kernel.
    flags[i] = 0;
    const int count = v > 0 ? static_cast<int>(v - 1) : 0;
    s_counts[i] = count;
    recv_counts[i] = count;
  }
  __syncthreads();
  for (int le = threadIdx.x; le < El; le += blockDim.x) {
    int total = 0;
    for (int s = 0; s < W; ++s) total += s_counts[le * W + s];
    s_expert_start[le] = total;
    recv_num_tokens_per_expert[le] = total;
    expert_load[le] += total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int le = 0; le < El; ++le) {
      const int total = s_expert_start[le];
      s_expert_start[le] = running;
      running += total;
      recv_expert_offsets[le] = running;
    }
    *recv_num_rows = running;
  }
  __syncthreads();
  for (int le = threadIdx.x; le < El; le += blockDim.x) {
    int running = s_expert_start[le];
    for (int s = 0; s < W; ++s) {
      recv_pair_offsets[le * W + s] = running;
      running += s_counts[le * W + s];
    }
  }
}

extern "C" __global__ void moe_dispatch_pack(
    const unsigned char* my_base, long long off_msg, long long off_info, int world_size, int max_tokens,
    int msg_bytes, int hidden, int wire_fp8,
    const int* recv_counts,        // [El, W]
    const int* recv_pair_offsets,  // [El, W]
    __nv_bfloat16* recv_x,         // [cap, D] out, packed
    int* recv_src_rank,            // [cap] out
    int* recv_src_idx              // [cap] out: t * K + k at the source
) {
  const int pair = blockIdx.y;  // le * W + src
  const int count = recv_counts[pair], start = recv_pair_offsets[pair];
  for (int slot = blockIdx.x; slot < count; slot += gridDim.x) {
    const long long row = static_cast<long long>(pair) * max_tokens + slot;
    const unsigned char* msg = my_base + off_msg + row * msg_bytes;
    __nv_bfloat16* out = recv_x + static_cast<long long>(start + slot) * hidden;
    if (wire_fp8) {
      zd::dequantize_row_fp8(out, msg, hidden);
    } else {
      zd::copy_row_bf16(out, msg, hidden);
    }
    if (threadIdx.x == 0) {
      recv_src_rank[start + slot] = pair % world_size;
      recv_src_idx[start + slot] = reinterpret_cast<const int*>(my_base + off_info)[row];
    }
  }
}
