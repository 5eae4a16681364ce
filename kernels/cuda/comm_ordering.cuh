// Memory-ordering and bounded-wait primitives of the one-sided dispatch/combine.
//
// Peers on the same GPU or in the same NVLink domain are written through peer pointers (from
// nvshmem_ptr); a flag tells the reader its rows are complete. The writer publishes with
//     rows (weak stores)  ->  fence.sc.sys  ->  flag with st.release.sys
// and the reader consumes with ld.acquire.sys on the flag before touching the rows (in a later
// kernel on its stream, so L1 holds nothing stale). System scope, not GPU scope: the peer is another
// process and, across NVLink, another GPU.
#pragma once
#include <cuda/std/cstdint>

namespace zd {

using i64 = long long;
using u64 = unsigned long long;

__device__ __forceinline__ void st_release_sys(i64* p, i64 v) {
  asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ i64 ld_acquire_sys(const i64* p) {
  i64 v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The error word the host reads after a step: err[0] != 0 means a wait expired;
// err[1] kind (1 dispatch, 2 combine), err[2] the silent source rank, err[3] its local expert (-1: n/a).
// The first waiter to expire claims err[0]; the others see it and stop waiting.
__device__ __forceinline__ void report_timeout(u64* err, int kind, int src_rank, int local_expert) {
  if (atomicCAS(err, 0ull, 1ull) == 0ull) {
    err[1] = static_cast<u64>(kind);
    err[2] = static_cast<u64>(src_rank);
    err[3] = static_cast<u64>(static_cast<i64>(local_expert));
    __threadfence_system();
  }
}

// Spin until *flag != 0 (returns it) or timeout_ns passes or another waiter already failed
// (returns 0 after reporting). Every cross-rank wait on the device goes through here.
__device__ __forceinline__ i64 wait_flag(const i64* flag, u64 timeout_ns, u64* err, int kind, int src_rank,
                                         int local_expert) {
  const u64 t0 = globaltimer_ns();
  for (;;) {
    const i64 v = ld_acquire_sys(flag);
    if (v != 0) return v;
    if (*reinterpret_cast<volatile u64*>(err) != 0ull) return 0;
    if (globaltimer_ns() - t0 > timeout_ns) {
      report_timeout(err, kind, src_rank, local_expert);
      return 0;
    }
    __nanosleep(64);
  }
}

// Grid-wide "am I the last block?" after every block published its stores system-wide. The
// fence.sc.sys before the counter orders this block's peer stores before the last block's flags.
__device__ __forceinline__ bool last_block_done(unsigned int* done_blocks) {
  __shared__ bool s_last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(done_blocks, 1u) == gridDim.x - 1;
  __syncthreads();
  if (s_last) __threadfence_system();  // acquire side: every block's counters and rows precede us
  return s_last;
}

}  // namespace zd
