// The routed FP4 experts' up of decode tokens on tensor cores (dsv4_fp4_up): w1 and w3 of each
// routed expert, the clamped SwiGLU and the route weight, per 16-row tile (fp4_up_kernel) or over a
// fixed grid of CTAs streaming tiles (fp4_up_stream_kernel; the same bits). fp4_experts.cuh: the
// decode and the tensor-core step.
#include "dsv4_api.h"
#include "fp4_experts.cuh"

namespace {

// up's epilogue, the warp's part: its gate / up sums tot of the tile's 16 rows -> red[warp]
// ([warps][2][16]).
DEV void up_partial(float (&tot)[2][2], float* red, int warp, int g, int q) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) tot[m][h] += __shfl_xor_sync(FULL, tot[m][h], 1);
  if (q == 0) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      red[(warp * 2 + m) * 16 + g] = tot[m][0];
      red[(warp * 2 + m) * 16 + g + 8] = tot[m][1];
    }
  }
}

// up's epilogue, the rest (one warp, every warp's part in red): lane r < 16 writes row r0 + r of
// expert slot j: the warps' gate (lane r) and up (lane r + 16) sums in warp order, bf16, clamp,
// SwiGLU, route weight -> a.
DEV void up_finish(const float* red, int lane, int nwarps, const float* rw, __nv_bfloat16* out,
                   float limit, int I, int j, int r0) {
  const int r = lane & 15, m = lane >> 4;
  float sum = 0.0f;
#pragma unroll 16
  for (int w = 0; w < nwarps; ++w) sum += red[(w * 2 + m) * 16 + r];
  const float us = __shfl_down_sync(FULL, sum, 16);
  if (lane >= 16) return;
  out[size_t(j) * I + r0 + r] = up_swiglu(sum, us, limit, rw[j]);
}

// up's epilogue for one tile (expert slot j, rows r0 .. r0 + 15): the warps' gate / up sums tot
// meet in red ([warps][2][16]; a block barrier), then warp 0 adds them up and writes the rows.
DEV void up_epilogue(float (&tot)[2][2], float* red, int warp, int nwarps, int g, int q,
                     const float* rw, __nv_bfloat16* out, float limit, int I, int j, int r0) {
  up_partial(tot, red, warp, g, q);
  __syncthreads();
  if (threadIdx.x < 32) up_finish(red, threadIdx.x, nwarps, rw, out, limit, I, j, r0);
}

// a[j, r] = bf16(silu(g) * u * rw[j]), g / u = bf16(W8A8 w1 / w3 of expert idx[j] at x), u clamped
// to +-limit and g from above (limit 0: none). Grid (I / 16, k); warp w: K slice [w*128*SPW, ...).
// Pair j reads activation row j / kpr (x [k / kpr, D]: the speculative verify rows' pairs).
template <int SPW, int DEC, int DEPTH>
__global__ void __launch_bounds__(512) fp4_up_kernel(const __nv_bfloat16* x, const int64_t* idx,
                                                     const float* rw, const uint8_t* w1, const uint8_t* s1,
                                                     const uint8_t* w3, const uint8_t* s3,
                                                     __nv_bfloat16* out, float limit, int I, int D,
                                                     int kpr) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, j = blockIdx.y, r0 = blockIdx.x * 16;
  uint4* xs;
  float *ef, *red;
  int xstride;
  const uint4* xq = expert_smem<SPW>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  pdl_wait();   // the experts come from the routing kernel
  const int64_t e = idx[j];
  const int k0 = warp * 128 * SPW;
  const size_t rowa = size_t(e) * I + r0 + g;
  ExpertWarp<SPW, 2, DEC, DEPTH> ew;
  ew.wrow = size_t(D) / 2;
  ew.srow = size_t(D) / 32;
  ew.q = q;
  ew.wp[0] = w1 + rowa * ew.wrow + (k0 >> 5) * 16;
  ew.wp[1] = w3 + rowa * ew.wrow + (k0 >> 5) * 16;
  ew.sp[0] = s1 + rowa * ew.srow + (k0 >> 5);
  ew.sp[1] = s3 + rowa * ew.srow + (k0 >> 5);
  ew.prefetch();   // the first weights load while the activation is quantized
  quant_slice<SPW, DEC>(x + size_t(j / kpr) * D + k0, reinterpret_cast<uint16_t*>(xs), ef, lane);
  __syncthreads();   // xs, and the zero operand
  float tot[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  ew.run(xq, xstride, ef, tot);
  up_epilogue(tot, red, warp, nwarps, g, q, rw, out, limit, I, j, r0);
}

// fp4_up_kernel over a fixed grid: CTA c takes the (expert, 16-row) tiles c, c + G, c + 2G, ...
// (tile t: expert slot t / (I / 16), rows 16 * (t % (I / 16))), its warps' weights for the next
// tile in flight (registers A / B in turn) while the current one is computed and reduced, so an
// SM keeps loading between tiles instead of idling through each CTA's compute and epilogue. x is
// quantized once. No block barrier per tile (it cost ~20% of the kernel's time: every warp waited
// for the one whose weights came last): each warp leaves its sums in the tile parity's red buffer
// and counts itself in (shared atomic); the warp that arrives last adds them up in warp order
// (up_finish: the sums and bits of fp4_up_kernel<SPW>), resets the count and bumps the buffer's
// generation, which a warp two tiles ahead waits for before it overwrites the buffer. k <= 64
// pairs; pair j reads activation row j / kpr (TR > 1: up to TR rows, the speculative verify rows,
// each quantized once into its own slice of xs / ef: a pair's sums are those of a one-row launch).
constexpr int UP_STREAM_MAX_K = 64, UP_STREAM_ROWS = 4;
template <int SPW, int DEC, int TR>
__global__ void __launch_bounds__(512) fp4_up_stream_kernel(const __nv_bfloat16* x,
                                                            const int64_t* idx, const float* rw,
                                                            const uint8_t* w1, const uint8_t* s1,
                                                            const uint8_t* w3, const uint8_t* s3,
                                                            __nv_bfloat16* out, float limit, int I,
                                                            int D, int k, int kpr) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int64_t s_e[UP_STREAM_MAX_K];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  uint4* xs;
  float *ef, *red;
  int xstride;
  const uint4* xq = expert_smem<SPW * TR>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  const int rt = I / 16, tiles = rt * k, G = gridDim.x;
  const int k0 = warp * 128 * SPW;
  const size_t wrow = size_t(D) / 2, srow = size_t(D) / 32;
  __shared__ int s_cnt[2];            // warps done with the parity's current tile
  __shared__ volatile int s_gen[2];   // the parity's tiles added up so far
  pdl_wait();   // the experts come from the routing kernel
  if (threadIdx.x < k) s_e[threadIdx.x] = idx[threadIdx.x];
  if (threadIdx.x < 2) {
    s_cnt[threadIdx.x] = 0;
    s_gen[threadIdx.x] = 0;
  }
  __syncthreads();
  ExpertStep<2> A[SPW], B[SPW];   // the weights of a tile (sa / sb: see compute)
  uint32_t scA[SPW], scB[SPW];     // its scale words (ld_scales: lanes 0-15 w1, 16-31 w3)
  auto load = [&](ExpertStep<2>(&st)[SPW], uint32_t(&sc)[SPW], int t) {
    const size_t row0 = size_t(s_e[t / rt]) * I + (t % rt) * 16, rowa = row0 + g;
    const uint8_t* wp[2] = {w1 + rowa * wrow + (k0 >> 5) * 16 + q * 16,
                            w3 + rowa * wrow + (k0 >> 5) * 16 + q * 16};
#pragma unroll
    for (int s = 0; s < SPW; ++s)
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        st[s].wa[m] = ld_stream(wp[m] + s * 64);
        st[s].wb[m] = ld_stream(wp[m] + s * 64 + 8 * wrow);
      }
    ld_scales<SPW>((lane < 16 ? s1 : s3) + (row0 + (lane & 15)) * srow + (k0 >> 5), sc);
  };
  // red: two [warps][2][16] buffers, one per tile parity (see the expert_smem size); use: how
  // many tiles of this parity the CTA did before this one
  auto compute = [&](const ExpertStep<2>(&st)[SPW], const uint32_t(&sc)[SPW], int t, int par,
                     int use) {
    float tot[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    const int xr = TR > 1 ? (t / rt) / kpr * SPW : 0;   // the pair's row: its first step of xs
#pragma unroll
    for (int s = 0; s < SPW; ++s) {
      ExpertStep<2> e = st[s];
#pragma unroll
      for (int m = 0; m < 2; ++m) spread_scales(sc[s], m, g, e.sa[m], e.sb[m]);
      fp4_step<2, DEC>(e, xq + (xr + s) * xstride, ef[xr + s], q, tot);
    }
    float* rp = red + par * nwarps * 32;
    while (s_gen[par] != use) {   // the buffer's previous tile not yet added up (rare)
    }
    __threadfence_block();
    up_partial(tot, rp, warp, g, q);
    __syncwarp();   // the warp's writes, then lane 0's count
    int last = 0;
    if (lane == 0) {
      __threadfence_block();
      last = atomicAdd(&s_cnt[par], 1) == nwarps - 1;
      __threadfence_block();
    }
    if (__shfl_sync(FULL, last, 0)) {
      __syncwarp();
      up_finish(rp, lane, nwarps, rw, out, limit, I, t / rt, (t % rt) * 16);
      __syncwarp();   // every read of rp, then the buffer is free
      if (lane == 0) {
        s_cnt[par] = 0;
        __threadfence_block();
        s_gen[par] = use + 1;
      }
    }
  };
  int t = blockIdx.x, n = 0;
  if (t < tiles) load(A, scA, t);
  for (int r = 0; r < (TR > 1 ? k / kpr : 1); ++r)
    quant_slice<SPW, DEC>(x + size_t(r) * D + k0, reinterpret_cast<uint16_t*>(xs + r * SPW * 16),
                          ef + r * SPW, lane);
  __syncthreads();   // xs, and the zero operand
  while (t < tiles) {   // n: the CTA's tiles so far (even ones use A and red buffer 0)
    if (t + G < tiles) load(B, scB, t + G);
    compute(A, scA, t, 0, n >> 1);
    t += G;
    ++n;
    if (t >= tiles) break;
    if (t + G < tiles) load(A, scA, t + G);
    compute(B, scB, t, 1, n >> 1);
    t += G;
    ++n;
  }
}

}  // namespace

extern "C" {

// a [k, I] bf16 from x [D] bf16 and the routing idx [k] int64 / rw [k] float32; grid (I / 16, k),
// D / (128 * spw) warps; dec: the e2m1 decode (0: through e4m3 and cvt, 1: integer ops); depth:
// steps of weights in flight per warp (0: all). ctas > 0: fp4_up_stream_kernel on min(ctas, tiles)
// CTAs instead (dec 0, spw 1 or 2 (4 spills), k <= 64 and at most 4 rows; depth unused). kpr:
// pairs per activation row (pair j reads x row j / kpr).
int dsv4_fp4_up(const void* x, const void* idx, const void* rw, const void* w1, const void* s1,
                const void* w3, const void* s3, void* out, float limit, int I, int D, int k,
                int spw, int dec, int depth, int ctas, int kpr, void* stream, int pdl) {
  const int warps = D / (128 * spw);
  if (warps < 1 || warps > 16 || I % 16 || D % (128 * spw) || k < 1 || ctas < 0 || kpr < 1)
    return -1;
  const dim3 grid(I / 16, k), block(32 * warps);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const auto* xp = static_cast<const __nv_bfloat16*>(x);
  const auto* ip = static_cast<const int64_t*>(idx);
  const auto* rp = static_cast<const float*>(rw);
  const auto* w1p = static_cast<const uint8_t*>(w1);
  const auto* s1p = static_cast<const uint8_t*>(s1);
  const auto* w3p = static_cast<const uint8_t*>(w3);
  const auto* s3p = static_cast<const uint8_t*>(s3);
  auto* op = static_cast<__nv_bfloat16*>(out);
#define DSV4_UP(S, DC, R) \
  launch(fp4_up_kernel<S, DC, R>, grid, block, expert_smem_bytes<S>(warps, 2), st, pdl, xp, ip, rp, \
         w1p, s1p, w3p, s3p, op, limit, I, D, kpr)
#define DSV4_UPS(S, R) \
  launch(fp4_up_stream_kernel<S, 0, R>, dim3(ctas < (I / 16) * k ? ctas : (I / 16) * k), block, \
         expert_smem_bytes<S * R>(warps, 4), st, pdl, xp, ip, rp, w1p, s1p, w3p, s3p, op, limit, I, \
         D, k, kpr)
  if (ctas > 0) {
    const int rows = k / kpr;
    if (dec != 0 || k > UP_STREAM_MAX_K || k % kpr || rows > UP_STREAM_ROWS) return -1;
    switch (spw * 10 + (rows > 1)) {
      case 10: return DSV4_UPS(1, 1);
      case 20: return DSV4_UPS(2, 1);
      case 11: return DSV4_UPS(1, UP_STREAM_ROWS);
      case 21: return DSV4_UPS(2, UP_STREAM_ROWS);
      default: return -1;
    }
  }
  switch (expert_variant(spw, dec, depth)) {
    case expert_variant(1, 0, 1): return DSV4_UP(1, 0, 1);
    case expert_variant(2, 0, 2): return DSV4_UP(2, 0, 2);
    case expert_variant(2, 0, 1): return DSV4_UP(2, 0, 1);
    case expert_variant(4, 0, 4): return DSV4_UP(4, 0, 4);
    case expert_variant(4, 0, 3): return DSV4_UP(4, 0, 3);
    case expert_variant(4, 0, 2): return DSV4_UP(4, 0, 2);
    case expert_variant(4, 1, 4): return DSV4_UP(4, 1, 4);
    case expert_variant(4, 1, 2): return DSV4_UP(4, 1, 2);
    default: return -1;
  }
#undef DSV4_UP
#undef DSV4_UPS
}

}  // extern "C"
