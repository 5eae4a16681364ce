// Routing of one token inside the dispatch kernels: gate logits, top-k, weights, owner and slot.
//
// E experts, D hidden, K top-k (<= 8), R max owners per expert (primary + replicas).
// The math of runtime/moe/router.py (fp32 logits; softmax or sigmoid; ties to the lowest id).
#pragma once
#include <cuda_bf16.h>

namespace zd {

constexpr int kMaxTopk = 8;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
constexpr int ROUTE_TOPK = 0;    // topk_idx / topk_weight given
constexpr int ROUTE_LOGITS = 1;  // fp32 logits [T, E] given
constexpr int ROUTE_HIDDEN = 2;  // logits = x @ gate_weight^T computed here

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

// Gate logits of token t into s_logits[E]: warps split the experts, lanes the channels.
__device__ void gate_logits(float* s_logits, const __nv_bfloat16* x_row, const __nv_bfloat16* gate_weight,
                            int num_experts, int hidden) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  for (int e = warp; e < num_experts; e += num_warps) {
    const __nv_bfloat16* w_row = gate_weight + static_cast<long long>(e) * hidden;
    float acc = 0.0f;
    for (int i = lane; i < hidden / 8; i += 32) {
      const int4 xa = reinterpret_cast<const int4*>(x_row)[i];
      const int4 wa = reinterpret_cast<const int4*>(w_row)[i];
      const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&xa);
      const __nv_bfloat162* wh = reinterpret_cast<const __nv_bfloat162*>(&wa);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 xf = __bfloat1622float2(xh[j]), wf = __bfloat1622float2(wh[j]);
        acc = fmaf(xf.x, wf.x, fmaf(xf.y, wf.y, acc));
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) s_logits[e] = acc;
  }
}

// Warp 0: top-k over s_logits (ties: lowest expert id), weights by softmax or sigmoid, optional
// renormalisation. Scoring is monotonic, so selection runs on the logits; s_logits is consumed.
__device__ void select_topk(float* s_logits, int num_experts, int top_k, int scoring, int renormalize,
                            long long* s_idx, float* s_w) {
  const int lane = threadIdx.x & 31;
  float mx = neg_inf();
  for (int e = lane; e < num_experts; e += 32) mx = fmaxf(mx, s_logits[e]);
  mx = warp_max(mx);
  float denom = 0.0f;
  if (scoring == 0) {
    for (int e = lane; e < num_experts; e += 32) denom += __expf(s_logits[e] - mx);
    denom = warp_sum(denom);
  }
  float total = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    float best = neg_inf();
    int best_e = 0x7fffffff;
    for (int e = lane; e < num_experts; e += 32) {
      const float v = s_logits[e];
      if (v > best || (v == best && e < best_e)) best = v, best_e = e;
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, m);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, m);
      if (ov > best || (ov == best && oe < best_e)) best = ov, best_e = oe;
    }
    const float w = scoring == 0 ? __expf(best - mx) / denom : 1.0f / (1.0f + __expf(-best));
    total += w;
    if (lane == 0) {
      s_idx[k] = best_e;
      s_w[k] = w;
      s_logits[best_e] = neg_inf();
    }
    __syncwarp();
  }
  if (renormalize && lane < top_k) s_w[lane] /= total;
  __syncwarp();
}

// Route token t and give each choice its slot: fills s_idx/s_w (choices, weights), s_dst/s_le/
// s_slot (owner rank, its local expert, slot), s_order (choices sorted by ring step, so this rank's
// writes sweep the ring). Writes topk_idx/topk_weight unless they were the input. Whole block.
__device__ void route_token(int t, const __nv_bfloat16* x_row, const __nv_bfloat16* gate_weight, const float* logits,
                            long long* topk_idx, float* topk_weight, int num_experts, int hidden, int top_k,
                            int route_mode, int scoring, int renormalize, const int* owner_rank,
                            const int* owner_local, const int* num_owners, int max_owners, const int* ring_pos,
                            int world_size, int max_local_experts, int* send_counter, float* s_logits,
                            long long* s_idx, float* s_w, int* s_dst, int* s_le, int* s_slot, int* s_order) {
  if (route_mode == ROUTE_HIDDEN) {
    gate_logits(s_logits, x_row, gate_weight, num_experts, hidden);
  } else if (route_mode == ROUTE_LOGITS) {
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
