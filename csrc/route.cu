// The MoE routing of decode tokens (dsv4_route): one CTA per token, warp-shuffle top-k.
#include "dsv4_api.h"
#include "dsv4_common.cuh"

namespace {

// The routing of one token, as dsv4/kernels/decode/route.py: scores (softmax / sigmoid / sqrt-softplus,
// libdevice exp/log1p, IEEE sqrt and division), the top-k of scores + bias (k rounds of max, the
// lowest id among equal values, ids clamped into [0, E)) or the token's tid2eid row, experts sorted
// by id, weights normalized (not for softmax) and scaled.
struct RouteArgs {
  const float* logits;      // [E] float32 (the gate GEMV)
  const float* bias;        // [E] float32 (score routing) or null
  const int64_t* tid2eid;   // [V, k] int64 (hash routing) or null
  const int64_t* ids;       // [1] int64: the token (hash routing)
  int E;
  int score;                // 0 softmax, 1 sigmoid, 2 sqrt-softplus
  float route_scale;
};
constexpr int ROUTE_MAX_E = 512, ROUTE_MAX_K = 16;

// By the whole CTA (E <= 512): all threads load the logits and the bias into shared memory at
// once (one memory round trip) and compute the scores; warp 0 picks the experts from shared
// memory (k rounds of a warp argmax) and their weights. s_score, s_bias: [E]; results in s_idx,
// s_w. Every thread must call it.
DEV void route_cta(const RouteArgs& ra, int k, float* s_score, float* s_bias, int64_t* s_idx,
                   float* s_w) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, E = ra.E;
  for (int e = tid; e < E; e += nt) {
    s_score[e] = ra.logits[e];
    s_bias[e] = ra.bias != nullptr ? ra.bias[e] : 0.0f;
  }
  __syncthreads();
  if (ra.score == 0) {   // softmax: max and sum by warp 0 (E / 32 values per lane), kept in s_w
    if (tid < 32) {
      float mx = -INFINITY, sum = 0.0f;
      for (int e = lane; e < E; e += 32) mx = fmaxf(mx, s_score[e]);
      for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
      for (int e = lane; e < E; e += 32) sum += expf(s_score[e] - mx);
      for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(FULL, sum, off);
      if (lane == 0) {
        s_w[0] = mx;
        s_w[1] = sum;
      }
    }
    __syncthreads();
  }
  const float mx = s_w[0], sum = s_w[1];
  for (int e = tid; e < E; e += nt) {   // in place: each thread its own experts
    const float lg = s_score[e];
    if (ra.score == 0)
      s_score[e] = __fdiv_rn(expf(lg - mx), sum);
    else if (ra.score == 1)
      s_score[e] = __fdiv_rn(1.0f, 1.0f + expf(-lg));
    else
      s_score[e] = __fsqrt_rn(lg > 20.0f ? lg : log1pf(expf(lg)));
  }
  __syncthreads();
  if (tid < 32) {
    int sel = E;   // lane j < k ends with expert j
    if (ra.tid2eid != nullptr) {
      if (lane < k) sel = int(ra.tid2eid[ra.ids[0] * k + lane]);
    } else {
      for (int t = 0; t < k; ++t) {
        float bm = -INFINITY;
        int be = ROUTE_MAX_E;   // none yet; NaN never qualifies
        for (int e = lane; e < E; e += 32) {   // the lowest id among equal values
          const float b = s_score[e] + s_bias[e];
          if (b == b && (be == ROUTE_MAX_E || b > bm)) {
            bm = b;
            be = e;
          }
        }
        for (int off = 16; off >= 1; off >>= 1) {
          const float ob = __shfl_xor_sync(FULL, bm, off);
          const int oe = __shfl_xor_sync(FULL, be, off);
          if (ob > bm || (ob == bm && oe < be)) {
            bm = ob;
            be = oe;
          }
        }
        const int a = min(be, E - 1);      // NaN scores: still a valid expert id
        if (lane == t) sel = a;
        if (lane == 0) s_bias[a] = -INFINITY;   // taken
        __syncwarp();
      }
    }
    sel = lane < k ? min(max(sel, 0), E - 1) : E;
    int rank = 0;   // the ids sorted: rank = ids below, or equal at a lower lane
    for (int j = 0; j < k; ++j) {
      const int o = __shfl_sync(FULL, sel, j);
      rank += (o < sel) || (o == sel && j < lane);
    }
    if (lane < k) s_idx[rank] = sel;
    __syncwarp();
    if (lane == 0) {
      float tot = 0.0f;
      for (int j = 0; j < k; ++j) tot += s_score[s_idx[j]];
      for (int j = 0; j < k; ++j) {
        const float w = s_score[s_idx[j]];
        s_w[j] = (ra.score != 0 ? __fdiv_rn(w, tot) : w) * ra.route_scale;
      }
    }
  }
  __syncthreads();
}

// One CTA: the routing of the token into idx [k] int64 (ascending) and w [k] float32.
// CTA b: token b of the launch (the speculative verify rows): logits row b, ids[b], idx / w row b.
__global__ void __launch_bounds__(256) route_kernel(const RouteArgs ra, int k, int64_t* idx, float* w) {
  __shared__ float s_score[ROUTE_MAX_E], s_bias[ROUTE_MAX_E];
  __shared__ int64_t s_idx[ROUTE_MAX_K];
  __shared__ float s_w[ROUTE_MAX_K];
  RouteArgs rb = ra;
  rb.logits += size_t(blockIdx.x) * ra.E;
  if (rb.ids != nullptr) rb.ids += blockIdx.x;
  idx += size_t(blockIdx.x) * k;
  w += size_t(blockIdx.x) * k;
  pdl_wait();   // the logits come from the gate GEMV
  route_cta(rb, k, s_score, s_bias, s_idx, s_w);
  if (threadIdx.x < k) {
    idx[threadIdx.x] = s_idx[threadIdx.x];
    w[threadIdx.x] = s_w[threadIdx.x];
  }
}

}  // namespace

extern "C" {


// The MoE routing of one token (kernels/decode/route.py semantics): logits [E] float32 with bias [E]
// float32 (score routing) or tid2eid [V, k] int64 + ids [1] int64 (hash routing); score 0 softmax,
// 1 sigmoid, 2 sqrt-softplus -> idx [k] int64 ascending, w [k] float32. One CTA per token: rows
// tokens (logits [rows, E], ids [rows], idx / w [rows, k]).
int dsv4_route(const void* logits, const void* bias, const void* tid2eid, const void* ids, int E,
               int k, int score, float route_scale, void* idx, void* w, int rows, void* stream,
               int pdl) {
  if (k < 1 || k > ROUTE_MAX_K || E < k || E > ROUTE_MAX_E || (bias == nullptr) == (tid2eid == nullptr) ||
      score < 0 || score > 2 || rows < 1)
    return -1;
  RouteArgs ra;
  ra.logits = static_cast<const float*>(logits);
  ra.bias = static_cast<const float*>(bias);
  ra.tid2eid = static_cast<const int64_t*>(tid2eid);
  ra.ids = static_cast<const int64_t*>(ids);
  ra.E = E;
  ra.score = score;
  ra.route_scale = route_scale;
  return launch(route_kernel, dim3(rows), dim3(256), 0, static_cast<cudaStream_t>(stream), pdl, ra, k,
                static_cast<int64_t*>(idx), static_cast<float*>(w));
}

}  // extern "C"
