// A self-checking kernel for the JIT's own tests: fills out[i] with a pattern of (i, seed) that
// the host can recompute, so a test sees whether every element was written and by whom.
#include <cuda/std/cstdint>
using cuda::std::uint32_t;

#ifndef ZD_SMOKE_MULT
#define ZD_SMOKE_MULT 2654435761u  // Knuth's multiplicative hash constant
#endif

extern "C" __global__ void fill_pattern(uint32_t* out, int n, uint32_t seed) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = (static_cast<uint32_t>(i) * ZD_SMOKE_MULT) ^ seed;
  }
}
