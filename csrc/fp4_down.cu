// The routed FP4 experts' down of decode tokens on tensor cores (dsv4_fp4_down): w2 of each routed
// expert, the experts summed in slot order through a per-row-tile semaphore (fp4_down_kernel) or
// all experts of a row tile in one CTA (fp4_down_all_kernel; the same bits), plus the shared
// expert's output. fp4_experts.cuh: the decode and the tensor-core step. early (the launch's pdl 2):
// idx and the weights it addresses are requested before the PDL wait (idx comes from the routing,
// which completed before up, the kernel waited for, passed its own wait), so the weights stream
// while up finishes; the activation and everything else after it.
#include "dsv4_api.h"
#include "fp4_experts.cuh"

namespace {

// The block's mHC post of down's output (post != null): v, y's element r before its rounding to
// bf16, put into the row's 4 streams: y [4, D] bf16 (the streams after), res [4, D] bf16 (before),
// post [4], comb [4, 4] (mhc_post_one: the float order of every kernel that takes the post).
DEV void down_post(float v, const __nv_bfloat16* res, const float* post, const float* comb,
                   __nv_bfloat16* y, int D, int r) {
  float rr[MHC_STREAMS];
#pragma unroll
  for (int i = 0; i < MHC_STREAMS; ++i) rr[i] = __bfloat162float(res[size_t(i) * D + r]);
  const float vb = bf16_round(v);
#pragma unroll
  for (int j = 0; j < MHC_STREAMS; ++j)
    y[size_t(j) * D + r] = __float2bfloat16_rn(mhc_post_one(vb, rr, post, comb, j));
}

// y[r] = sum_j bf16(W8A8 w2[idx[j]] @ a[j])[r] in float32, slot order j = 0..k-1, (+ add[r]),
// rounded to y's dtype. Grid (D / 16, k): CTA (t, j) writes expert j's bf16 rows of tile t to
// ws[j, :]; the last CTA of tile t (semaphore cnt[t], reset by it) adds them up in slot order.
// POST: y [4, D] bf16 gets the block's mHC post of that output instead (down_post; an
// instantiation of its own, so the kernel without it keeps its code).
template <int SPW, int DEC, int DEPTH, bool POST>
__global__ void __launch_bounds__(512) fp4_down_kernel(const __nv_bfloat16* act, const int64_t* idx,
                                                       const uint8_t* w2, const uint8_t* s2,
                                                       const __nv_bfloat16* add, void* y,
                                                       float* ws, int* cnt, int D, int I, int k,
                                                       int y_f32, int early,
                                                       const __nv_bfloat16* res,
                                                       const float* post, const float* comb) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, j = blockIdx.y, r0 = blockIdx.x * 16;
  uint4* xs;
  float *ef, *red;
  int xstride;
  const uint4* xq = expert_smem<SPW>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  if (!early) pdl_wait();
  const int64_t e = idx[j];
  const int k0 = warp * 128 * SPW;
  const size_t rowa = size_t(e) * D + r0 + g;
  ExpertWarp<SPW, 1, DEC, DEPTH> ew;
  ew.wrow = size_t(I) / 2;
  ew.srow = size_t(I) / 32;
  ew.q = q;
  ew.wp[0] = w2 + rowa * ew.wrow + (k0 >> 5) * 16;
  ew.sp[0] = s2 + rowa * ew.srow + (k0 >> 5);
  ew.prefetch();
  if (early) pdl_wait();   // the weights of idx requested; now the activation (up's output)
  quant_slice<SPW, DEC>(act + size_t(j) * I + k0, reinterpret_cast<uint16_t*>(xs), ef, lane);
  __syncthreads();   // xs, and the zero operand
  float tot[1][2] = {{0.0f, 0.0f}};
  ew.run(xq, xstride, ef, tot);
  tot[0][0] += __shfl_xor_sync(FULL, tot[0][0], 1);
  tot[0][1] += __shfl_xor_sync(FULL, tot[0][1], 1);
  if (q == 0) {
    red[warp * 16 + g] = tot[0][0];
    red[warp * 16 + g + 8] = tot[0][1];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float t = 0.0f;
    for (int w = 0; w < nwarps; ++w) t += red[w * 16 + threadIdx.x];
    ws[size_t(j) * D + r0 + threadIdx.x] = bf16_round(t);   // fp4_gemm outputs bf16
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int done = atomicAdd(cnt + blockIdx.x, 1);
    last = done == k - 1;
    if (last) cnt[blockIdx.x] = 0;   // ready for the next launch
  }
  __syncthreads();
  if (last && threadIdx.x < 16) {
    __threadfence();
    const int r = r0 + threadIdx.x;
    float t = 0.0f;
    for (int jj = 0; jj < k; ++jj) t += __ldcg(ws + size_t(jj) * D + r);
    if (add != nullptr) t += __bfloat162float(add[r]);
    if constexpr (POST)
      down_post(t, res, post, comb, static_cast<__nv_bfloat16*>(y), D, r);
    else if (y_f32)
      static_cast<float*>(y)[r] = t;
    else
      static_cast<__nv_bfloat16*>(y)[r] = __float2bfloat16_rn(t);
  }
}

// fp4_down_kernel with all NE experts of a row tile in one CTA: y[r] = sum_j bf16(W8A8 w2[idx[j]] @
// a[j])[r] in float32, slot order j = 0..NE-1, (+ add[r]). Grid D / 16; warp w takes the K slice
// [w*128*SPW, ...) of every expert and streams its NE * SPW steps (expert-major) with DEPTH steps
// of weights in flight across the expert boundaries. The sums are those of fp4_down_kernel with
// the same SPW (per expert: warps in order, then bf16; experts in slot order), without its
// workspace, semaphore and second pass, and with one CTA per row tile instead of NE. Grid axis y:
// the activation row b (the speculative verify rows): act, idx, add and y move to row b's.
// POST: as fp4_down_kernel's (y [rows, 4, D]; res, post, comb row b's).
template <int SPW, int NE, int DEC, int DEPTH, bool POST>
__global__ void __launch_bounds__(512) fp4_down_all_kernel(const __nv_bfloat16* act,
                                                           const int64_t* idx, const uint8_t* w2,
                                                           const uint8_t* s2,
                                                           const __nv_bfloat16* add, void* y,
                                                           int D, int I, int y_f32, int early,
                                                           const __nv_bfloat16* res,
                                                           const float* post, const float* comb) {
  constexpr int NS = NE * SPW;
  static_assert(NE % 2 == 0, "the scale loads take two experts");
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, r0 = blockIdx.x * 16;
  act += size_t(blockIdx.y) * NE * I;
  idx += size_t(blockIdx.y) * NE;
  if (add != nullptr) add += size_t(blockIdx.y) * D;
  if constexpr (POST) {          // row b's streams: y and res [rows, 4, D], post / comb its own
    res += size_t(blockIdx.y) * MHC_STREAMS * D;
    post += size_t(blockIdx.y) * MHC_STREAMS;
    comb += size_t(blockIdx.y) * MHC_STREAMS * MHC_STREAMS;
    y = static_cast<char*>(y) + size_t(blockIdx.y) * MHC_STREAMS * D * 2;
  } else {
    y = static_cast<char*>(y) + size_t(blockIdx.y) * D * (y_f32 ? 4 : 2);
  }
  uint4* xs;
  float *ef, *red;   // the expert_smem layout with NS steps per warp; red [warps][NE][16]
  int xstride;
  const uint4* xq = expert_smem<NS>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  if (!early) pdl_wait();
  const int k0 = warp * 128 * SPW;
  const size_t wrow = size_t(I) / 2, srow = size_t(I) / 32;
  const uint8_t* wp[NE];
#pragma unroll
  for (int j = 0; j < NE; ++j) {
    const size_t row = size_t(idx[j]) * D + r0 + g;
    wp[j] = w2 + row * wrow + (k0 >> 5) * 16 + q * 16;
  }
  ExpertStep<1> st[DEPTH];   // sa / sb: see the step loop
  auto load = [&](int s) {
    ExpertStep<1>& e = st[s % DEPTH];
    const int j = s / SPW, t = s % SPW;
    e.wa[0] = ld_stream(wp[j] + t * 64);
    e.wb[0] = ld_stream(wp[j] + t * 64 + 8 * wrow);
  };
#pragma unroll
  for (int s = 0; s < DEPTH && s < NS; ++s) load(s);
  uint32_t sc[NE / 2][SPW];   // experts 2i (lanes 0-15) and 2i + 1 (lanes 16-31), ld_scales
#pragma unroll
  for (int i = 0; i < NE / 2; ++i)
    ld_scales<SPW>(s2 + (size_t(idx[2 * i + (lane >> 4)]) * D + r0 + (lane & 15)) * srow + (k0 >> 5),
                   sc[i]);
  if (early) pdl_wait();   // the weights of idx requested; now the activation (up's output)
#pragma unroll
  for (int j = 0; j < NE; ++j)
    quant_slice<SPW, DEC>(act + size_t(j) * I + k0, reinterpret_cast<uint16_t*>(xs + j * SPW * 16),
                          ef + j * SPW, lane);
  __syncthreads();   // xs, and the zero operand
  float tot[NE][1][2];
#pragma unroll
  for (int j = 0; j < NE; ++j) tot[j][0][0] = tot[j][0][1] = 0.0f;
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    ExpertStep<1> e = st[s % DEPTH];
    spread_scales(sc[s / SPW / 2][s % SPW], (s / SPW) & 1, g, e.sa[0], e.sb[0]);
    fp4_step<1, DEC>(e, xq + s * xstride, ef[s], q, tot[s / SPW]);
    if (s + DEPTH < NS) load(s + DEPTH);
  }
#pragma unroll
  for (int j = 0; j < NE; ++j) {
    tot[j][0][0] += __shfl_xor_sync(FULL, tot[j][0][0], 1);
    tot[j][0][1] += __shfl_xor_sync(FULL, tot[j][0][1], 1);
    if (q == 0) {
      red[(warp * NE + j) * 16 + g] = tot[j][0][0];
      red[(warp * NE + j) * 16 + g + 8] = tot[j][0][1];
    }
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    const int r = threadIdx.x;
    float acc = 0.0f;
    for (int j = 0; j < NE; ++j) {
      float t = 0.0f;
      for (int w = 0; w < nwarps; ++w) t += red[(w * NE + j) * 16 + r];
      acc += bf16_round(t);   // fp4_gemm outputs bf16
    }
    if (add != nullptr) acc += __bfloat162float(add[r0 + r]);
    if constexpr (POST)
      down_post(acc, res, post, comb, static_cast<__nv_bfloat16*>(y), D, r0 + r);
    else if (y_f32)
      static_cast<float*>(y)[r0 + r] = acc;
    else
      static_cast<__nv_bfloat16*>(y)[r0 + r] = __float2bfloat16_rn(acc);
  }
}

}  // namespace

extern "C" {

// y [D] (float32 or bf16) from a [k, I] bf16; ws [k, D] float32 and cnt [D / 16] int32 (zeros,
// left zero) are the caller's workspace; add [D] bf16 or null. Grid (D / 16, k). all_experts:
// fp4_down_all_kernel instead (grid D / 16, no workspace; k 6 (Flash, Pro), dec 0, the (spw, depth)
// instantiated below). rows > 1 (all_experts only): rows activation rows, a [rows * k, I], idx
// [rows * k], add / y [rows, D].
int dsv4_fp4_down(const void* act, const void* idx, const void* w2, const void* s2, const void* add,
                  void* y, void* ws, void* cnt, int D, int I, int k, int y_f32, int spw, int dec,
                  int depth, int all_experts, int rows, const void* res, const float* post,
                  const float* comb, void* stream, int pdl) {
  const int warps = I / (128 * spw);
  if (warps < 1 || warps > 16 || D % 16 || I % (128 * spw) || k < 1 || rows < 1 ||
      (rows > 1 && !all_experts) ||
      (post != nullptr && (y_f32 || res == nullptr || comb == nullptr)))
    return -1;
  const auto* rp = static_cast<const __nv_bfloat16*>(res);
  const dim3 grid(D / 16, k), block(32 * warps);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const auto* ap = static_cast<const __nv_bfloat16*>(act);
  const auto* ip = static_cast<const int64_t*>(idx);
  const auto* wp = static_cast<const uint8_t*>(w2);
  const auto* sp = static_cast<const uint8_t*>(s2);
  const auto* dp = static_cast<const __nv_bfloat16*>(add);
  auto* wsp = static_cast<float*>(ws);
  auto* cp = static_cast<int*>(cnt);
  const int early = pdl == 2;
#define DSV4_DOWN_P(S, DC, R, P) \
  launch(fp4_down_kernel<S, DC, R, P>, grid, block, expert_smem_bytes<S>(warps, 1), st, pdl, ap, \
         ip, wp, sp, dp, y, wsp, cp, D, I, k, y_f32, early, rp, post, comb)
#define DSV4_DOWN(S, DC, R) \
  (post != nullptr ? DSV4_DOWN_P(S, DC, R, true) : DSV4_DOWN_P(S, DC, R, false))
#define DSV4_DOWN_ALL_P(S, E, R, P) \
  launch(fp4_down_all_kernel<S, E, 0, R, P>, dim3(D / 16, rows), block, \
         expert_smem_bytes<S * E>(warps, E), st, pdl, ap, ip, wp, sp, dp, y, D, I, y_f32, early, \
         rp, post, comb)
#define DSV4_DOWN_ALL(S, E, R) \
  (post != nullptr ? DSV4_DOWN_ALL_P(S, E, R, true) : DSV4_DOWN_ALL_P(S, E, R, false))
  if (all_experts) {
    if (dec != 0) return -1;
    switch ((k * 10 + spw) * 100 + (depth > 0 ? depth : spw)) {
      case 6202: return DSV4_DOWN_ALL(2, 6, 2);
      case 6204: return DSV4_DOWN_ALL(2, 6, 4);
      case 6206: return DSV4_DOWN_ALL(2, 6, 6);
      case 6404: return DSV4_DOWN_ALL(4, 6, 4);
      default: return -1;
    }
  }
  switch (expert_variant(spw, dec, depth)) {
    case expert_variant(1, 0, 1): return DSV4_DOWN(1, 0, 1);
    case expert_variant(2, 0, 2): return DSV4_DOWN(2, 0, 2);
    case expert_variant(2, 0, 1): return DSV4_DOWN(2, 0, 1);
    case expert_variant(4, 0, 4): return DSV4_DOWN(4, 0, 4);
    case expert_variant(4, 0, 2): return DSV4_DOWN(4, 0, 2);
    case expert_variant(2, 1, 2): return DSV4_DOWN(2, 1, 2);
    default: return -1;
  }
#undef DSV4_DOWN
#undef DSV4_DOWN_P
#undef DSV4_DOWN_ALL
#undef DSV4_DOWN_ALL_P
}

}  // extern "C"
