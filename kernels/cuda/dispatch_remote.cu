// Dispatch to peers that no peer pointer reaches (other nodes): NVSHMEM put-with-signal.
//
// T tokens, K top-k, D hidden, W world size, Elm max local experts, B message bytes.
//
// Same routing and slot rules as dispatch.cu (moe_route.cuh). A destination whose peer_base is 0
// (nvshmem_ptr returned NULL) gets its rows by `nvshmemx_putmem_signal_nbi_block` from this rank's
// symmetric staging rows (IB transports need registered sources), each adding 1 to the pair's
// arrival counter at the destination; the last block then sets the pair's flag to count + 1 with
// `nvshmemx_signal_op`. The receiver waits for the flag, then for arrivals == count (the puts and the
// flag may land in any order). Reachable destinations take the peer-pointer stores of dispatch.cu.
//
// Build: BuildOptions.make(nvshmem=True, defines={"ZD_WITH_NVSHMEM": 1, "__NVSHMEM_NUMBA_SUPPORT__": 1})
// against nvidia-nvshmem-cu13 >= 3.8 headers (3.4.5 does not compile under NVRTC). Running it needs
// the NVSHMEM device library linked and nvshmemx_cumodule_init on the module: see
// runtime/comm/nvshmem_comm.py, which refuses remote peers with a clear message until then.
// Without ZD_WITH_NVSHMEM this file compiles to a kernel that only reports "unsupported".
#include <cuda/std/cstdint>

#include "comm_ordering.cuh"
#include "moe_layout.cuh"
#include "moe_route.cuh"

#ifndef ZD_WITH_NVSHMEM
#define ZD_WITH_NVSHMEM 0
#endif

#if ZD_WITH_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>

extern "C" __global__ void moe_dispatch_send_remote(
    const __nv_bfloat16* x, const float* logits, long long* topk_idx,
    float* topk_weight, int num_tokens, int hidden, int num_experts, int top_k, int route_mode, int scoring,
    int renormalize, const int* owner_rank, const int* owner_local, const int* num_owners, int max_owners,
    const int* ring_pos, const int* ring_peers, const int* num_local_experts,
    const unsigned long long* peer_base,  // [W]; 0 where only NVSHMEM puts reach
    unsigned char* my_base,               // this rank's symmetric buffer of this phase
    int world_size, int my_rank, int max_local_experts, int max_tokens, int msg_bytes, int wire_fp8,
    long long off_msg, long long off_info, long long off_flag, long long off_arrive, long long off_stage,
    int* send_counter, unsigned int* done_blocks) {
  extern __shared__ float s_logits[];
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
      const bool direct = peer_base[dst] != 0ull;
      unsigned char* msg = direct ? reinterpret_cast<unsigned char*>(peer_base[dst]) + off_msg + row * msg_bytes
                                  : my_base + off_stage + static_cast<long long>(t * top_k + k) * msg_bytes;
      if (wire_fp8) {
        zd::quantize_row_fp8(msg, x_row, hidden);
      } else {
        zd::copy_row_bf16(msg, x_row, hidden);
      }
      if (direct) {
        if (threadIdx.x == 0)
          reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(peer_base[dst]) + off_info)[row] = t * top_k + k;
        continue;
      }
      __syncthreads();  // the staged row is complete before the block-wide put reads it
      if (threadIdx.x == 0) {
        nvshmem_int_p(reinterpret_cast<int*>(my_base + off_info) + row, t * top_k + k, dst);
        nvshmem_fence();  // src_idx lands before the row's arrival is counted
      }
      __syncthreads();
      auto* arrive = reinterpret_cast<uint64_t*>(my_base + off_arrive) + (s_le[k] * W + my_rank);
      nvshmemx_putmem_signal_nbi_block(my_base + off_msg + row * msg_bytes, msg, msg_bytes, arrive, 1,
                                       NVSHMEM_SIGNAL_ADD, dst);
    }
    __syncthreads();
  }
  if (zd::last_block_done(done_blocks)) {
    for (int i = threadIdx.x; i < W * Elm; i += blockDim.x) {
      const int dst = ring_peers[i / Elm], le = i % Elm;
      if (le >= num_local_experts[dst]) continue;
      const long long count = atomicExch(&send_counter[dst * Elm + le], 0);
      if (peer_base[dst] != 0ull) {
        auto* flag = reinterpret_cast<long long*>(reinterpret_cast<unsigned char*>(peer_base[dst]) + off_flag);
        zd::st_release_sys(flag + le * W + my_rank, count + 1);
      } else {
        auto* flag = reinterpret_cast<uint64_t*>(my_base + off_flag) + (le * W + my_rank);
        nvshmemx_signal_op(flag, static_cast<uint64_t>(count + 1), NVSHMEM_SIGNAL_SET, dst);
      }
    }
    if (threadIdx.x == 0) *done_blocks = 0u;
  }
}

// Receiver side for remote sources: after moe_dispatch_wait saw count + 1 in flag (le, src), the
// rows themselves may still be in flight; wait (bounded) until their arrival counter reaches count.
extern "C" __global__ void moe_dispatch_wait_arrivals(unsigned char* my_base, long long off_arrive,
                                                      const int* recv_counts,  // [El, W]
                                                      int num_pairs, int world_size, unsigned long long timeout_ns,
                                                      unsigned long long* error) {
  auto* arrive = reinterpret_cast<uint64_t*>(my_base + off_arrive);
  for (int i = threadIdx.x; i < num_pairs; i += blockDim.x) {
    const uint64_t want = static_cast<uint64_t>(recv_counts[i]);
    const unsigned long long t0 = zd::globaltimer_ns();
    while (nvshmem_uint64_atomic_fetch(arrive + i, nvshmem_my_pe()) < want) {
      if (zd::globaltimer_ns() - t0 > timeout_ns) {
        zd::report_timeout(error, 1, i % world_size, i / world_size);
        break;
      }
    }
    arrive[i] = 0;  // as with the flags: the source re-arms this pair only after our combine
  }
}

#else  // !ZD_WITH_NVSHMEM: keep the symbol so a wrong build fails loudly, not with a missing name

extern "C" __global__ void moe_dispatch_send_remote(unsigned long long* error) {
  if (threadIdx.x == 0 && blockIdx.x == 0) zd::report_timeout(error, 99, -1, -1);  // 99: unsupported build
}

#endif
