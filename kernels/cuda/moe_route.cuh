// Routing of one token inside the dispatch kernels: top-k of its logits, weights, owner and slot.
//
// E experts, K top-k (<= 8), R max owners per expert (primary + replicas).
// The math of runtime/moe/router.py (fp32 logits; softmax or sigmoid; ties to the lowest id; NaN
// below -inf; a zero renormalisation sum divides by 1). The logits come in: from a gate weight they
// are one GEMM before the dispatch (`gate_logits`), which spreads the [E, D] weight over every SM;
// a block per token computing its own logits here read the whole weight through one SM (at E = 256,
// D = 7168: 0.2 ms a dispatch on an H100, docs/benchmarks.md, "Dispatch / combine").
#pragma once

namespace zd {

constexpr int kMaxTopk = 8;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
constexpr int ROUTE_TOPK = 0;    // topk_idx / topk_weight given
constexpr int ROUTE_LOGITS = 1;  // fp32 logits [T, E] given

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// Selection keys: the logits mapped onto ints whose order is total, so that every argmax below
// lands on a real expert. Comparing floats did not: a lane whose experts were all NaN kept
// best_e = INT_MAX (every comparison with NaN is false), and lane 0 then stored s_logits[INT_MAX],
// out of bounds; and a chosen expert, marked -inf, tied with a real -inf logit and was chosen again.
//   numbers, +-inf   ordered as floats; -0 and +0 are one key, so they tie (lowest id), as floats do
//   NaN              kNanKey, below -inf: never chosen before a real expert; NaNs tie (lowest id)
//   chosen           kTakenKey, below everything (K <= E, so an untaken expert always outranks it)
// The key is a bijection on non-NaN floats (-0 aside), so key_logit gives the logit back exactly.
// runtime/moe/router.py computes the same keys in torch.
constexpr int kTakenKey = -0x7fffffff - 1;
constexpr int kNanKey = kTakenKey + 1;

__device__ __forceinline__ int logit_key(float v) {
  const int b = __float_as_int(v), mag = b & 0x7fffffff;
  if (mag > 0x7f800000) return kNanKey;  // any NaN, whatever its sign or payload
  if (mag == 0) return 0;
  return b >= 0 ? b : b ^ 0x7fffffff;  // negative: -1 - |bits|, so a larger magnitude ranks lower
}

__device__ __forceinline__ float key_logit(int key) {
  if (key == kNanKey) return __int_as_float(0x7fc00000);  // the logit was a NaN: its weight is NaN
  return __int_as_float(key >= 0 ? key : key ^ 0x7fffffff);
}

// Warp 0: top-k over s_logits (by logit_key: ties to the lowest expert id, NaN below -inf), weights
// by softmax or sigmoid, optional renormalisation. Scoring is monotonic, so selection runs on the
// logits; s_logits is consumed (it holds the keys afterwards, as float bit patterns).
__device__ void select_topk(float* s_logits, int num_experts, int top_k, int scoring, int renormalize,
                            long long* s_idx, float* s_w) {
  const int lane = threadIdx.x & 31;
  float mx = neg_inf();
  // fmaxf skips NaN; a NaN logit still makes the softmax denominator, so every weight, NaN (as
  // torch.softmax does), and the engine's non-finite checks end that token's request downstream.
  for (int e = lane; e < num_experts; e += 32) mx = fmaxf(mx, s_logits[e]);
  mx = warp_max(mx);
  float denom = 0.0f;
  if (scoring == 0) {
    for (int e = lane; e < num_experts; e += 32) denom += __expf(s_logits[e] - mx);
    denom = warp_sum(denom);
  }
  // Keys in place, stored through float bit casts (no int/float aliasing of the shared array). Each
  // lane converts and then scans only its own experts (e = lane mod 32); lane 0's kTakenKey store
  // into another lane's expert is published by the __syncwarp that ends each round.
  for (int e = lane; e < num_experts; e += 32) s_logits[e] = __int_as_float(logit_key(s_logits[e]));
  float total = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    int best = kTakenKey;
    int best_e = 0x7fffffff;  // a lane without experts keeps it; it loses every tie to a real id
    for (int e = lane; e < num_experts; e += 32) {
      const int v = __float_as_int(s_logits[e]);
      if (v > best || (v == best && e < best_e)) best = v, best_e = e;
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
      const int ov = __shfl_xor_sync(0xffffffffu, best, m);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, m);
      if (ov > best || (ov == best && oe < best_e)) best = ov, best_e = oe;
    }
    // (key, id) is a total order, so every lane holds the same winner, with best_e in [0, E).
    const float l = key_logit(best);
    const float w = scoring == 0 ? __expf(l - mx) / denom : 1.0f / (1.0f + __expf(-l));
    total += w;
    if (lane == 0) {
      s_idx[k] = best_e;
      s_w[k] = w;
      s_logits[best_e] = __int_as_float(kTakenKey);
    }
    __syncwarp();
  }
  // Sigmoid scores of very negative logits underflow to 0, and 0 / 0 would give NaN weights to a
  // token whose logits are all finite. A zero sum (every chosen score 0) divides by 1: the weights
  // stay 0, a token no expert wants. A NaN sum stays NaN (a NaN logit was chosen). As the reference.
  if (renormalize && lane < top_k) s_w[lane] /= total == 0.0f ? 1.0f : total;
  __syncwarp();
}

// Route token t and give each choice its slot: fills s_idx/s_w (choices, weights), s_dst/s_le/
// s_slot (owner rank, its local expert, slot), s_order (choices sorted by ring step, so this rank's
// writes sweep the ring). Writes topk_idx/topk_weight unless they were the input. Whole block.
__device__ void route_token(int t, const float* logits, long long* topk_idx, float* topk_weight, int num_experts,
                            int top_k, int route_mode, int scoring, int renormalize, const int* owner_rank,
                            const int* owner_local, const int* num_owners, int max_owners, const int* ring_pos,
                            int world_size, int max_local_experts, int* send_counter, float* s_logits,
                            long long* s_idx, float* s_w, int* s_dst, int* s_le, int* s_slot, int* s_order) {
  if (route_mode == ROUTE_LOGITS) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
      s_logits[e] = logits[static_cast<long long>(t) * num_experts + e];
  }
  __syncthreads();
  if (route_mode == ROUTE_TOPK) {
    if (threadIdx.x < top_k) {
      s_idx[threadIdx.x] = topk_idx[t * top_k + threadIdx.x];
      s_w[threadIdx.x] = topk_weight[t * top_k + threadIdx.x];
    }
  } else if (threadIdx.x < 32) {
    select_topk(s_logits, num_experts, top_k, scoring, renormalize, s_idx, s_w);
    if (threadIdx.x < top_k) {
      topk_idx[t * top_k + threadIdx.x] = s_idx[threadIdx.x];
      topk_weight[t * top_k + threadIdx.x] = s_w[threadIdx.x];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int W = world_size;
    for (int k = 0; k < top_k; ++k) {
      const int e = static_cast<int>(s_idx[k]);
      if (e < 0 || e >= num_experts) {
        s_dst[k] = -1;
      } else {
        const int o = t % num_owners[e];  // replica choice: the same rule as plan_send
        const int dst = owner_rank[e * max_owners + o], le = owner_local[e * max_owners + o];
        s_dst[k] = dst;
        s_le[k] = le;
        s_slot[k] = atomicAdd(&send_counter[dst * max_local_experts + le], 1);
      }
      int j = k;
      const int key = s_dst[k] < 0 ? W : ring_pos[s_dst[k]];
      while (j > 0 && (s_dst[s_order[j - 1]] < 0 ? W : ring_pos[s_dst[s_order[j - 1]]]) > key) {
        s_order[j] = s_order[j - 1];
        --j;
      }
      s_order[j] = k;
    }
  }
  __syncthreads();
}

}  // namespace zd
