// The W8A8 FP8 GEMV on CUDA cores (dsv4_fp8_gemv; configs and launchers on the Python side:
// dsv4/kernels/cuda/fp8.py): e4m3 weights with 128x128 ue8m0 scales, float32 accumulation of
// exact products, the activation quantized per 128 (ue8m0, e4m3 RNE) in the kernel; variants: two
// matrices on one x (wq_a + wkv), fused clamped SwiGLU (w1 + w3), grouped x without act quant
// (wo_a). Every weight byte is requested before the PDL wait.
#include "dsv4_api.h"
#include "fp8.cuh"

namespace {

// One CTA: ROWS = (32 / LC) * RPL rows (inside one 128-row scale block) x all of K. Warp w reads
// the K chunks [w * LC * CPL, (w + 1) * LC * CPL) (16 bytes each); lane = (lr, lc) reads chunks
// lc + LC * c (c < CPL) of rows lr + LR * i (i < RPL). Each lane dots 16 weights with 16
// activation values per (row, chunk) in float32, applies the weight scale of the chunk's block,
// then partial sums meet in a shuffle butterfly (over the LC lanes) and a fixed-order sum over warps.
// Several activation rows (nx > 1, the speculative step's verify rows; MULTI) reuse the weights held
// in registers: each row runs the arithmetic of a one-row launch (!MULTI: no row loop), so its
// output has the same bits.
template <int LC, int RPL, int CPL, bool SWIGLU, bool MULTI>
__global__ void __launch_bounds__(512) fp8_gemv_kernel(const Fp8Args a) {
  constexpr int LR = 32 / LC, ROWS = LR * RPL, NM = SWIGLU ? 2 : 1;
  extern __shared__ float red[];   // [warps][NM][ROWS]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int lr = lane / LC, lc = lane % LC;
  const int K = a.K;
  int row0 = blockIdx.x * ROWS;
  DSV4_FP8_OPERANDS(a, NM, SWIGLU)
  const int kc0 = warp * (LC * CPL) + lc;            // this lane's first 16-byte chunk along K

  // every weight and scale byte of the lane, before the PDL wait (immutable)
  uint4 wv[NM][RPL][CPL];
  uint32_t sb[NM][CPL];
#pragma unroll
  for (int m = 0; m < NM; ++m) {
#pragma unroll
    for (int i = 0; i < RPL; ++i)
#pragma unroll
      for (int c = 0; c < CPL; ++c)
        wv[m][i][c] = ld_stream(wp[m] + size_t(row0 + lr + LR * i) * K + 16 * (kc0 + LC * c));
#pragma unroll
    for (int c = 0; c < CPL; ++c)
      sb[m][c] = ld_stream_u8(sp[m] + (row0 >> 7) * (K >> 7) + ((kc0 + LC * c) >> 3));
  }
  pdl_wait();

  // the activation chunks, act-quantized per 128 (8 chunks: lanes lc ^ 1, 2, 4)
  const bool xf32 = a.flags & FLAG_X_F32;
  const size_t xoff0 = a.ng > 0 ? size_t(row0 / a.ng) * K : 0;
#pragma unroll 1
  for (int xr = 0; xr < (MULTI ? a.nx : 1); ++xr) {   // activation rows
    const size_t xoff = xoff0 + size_t(xr) * a.xs;
    // an opaque zero per row: the e4m3 decode below depends on it, so the compiler cannot hoist
    // the decoded weights (16 floats per 16-byte chunk) out of the row loop, where they spill
    uint32_t z = 0;
    if constexpr (MULTI) asm volatile("mov.b32 %0, 0;" : "=r"(z));
    float xv[CPL][16];
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      load_act<16>(a.x, xoff + 16 * size_t(kc0 + LC * c), xf32, xv[c]);
      if (a.flags & FLAG_QUANT) {
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(xv[c][j]));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 4));
        const int e = block_exponent(amax);
        const float inv = pow2f(-e), sc = pow2f(e);
#pragma unroll
        for (int j = 0; j < 16; ++j) xv[c][j] = quant_e4m3(xv[c][j], inv) * sc;
      }
    }

    float acc[NM][RPL];
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int i = 0; i < RPL; ++i) {
        float t = 0.0f;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const uint32_t words[4] = {wv[m][i][c].x ^ z, wv[m][i][c].y ^ z, wv[m][i][c].z ^ z,
                                     wv[m][i][c].w ^ z};
          float p = 0.0f;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            float f[4];
            e4m3x4_to_f32(words[q], f);
#pragma unroll
            for (int j = 0; j < 4; ++j) p = fmaf(f[j], xv[c][4 * q + j], p);
          }
          t = fmaf(p, e8m0(sb[m][c]), t);
        }
        acc[m][i] = t;
      }

    // butterfly over the LC lanes of a row group: halve the row set while there is more than one
    // row per lane, then add across the remaining lanes; the lane keeps rows base .. base + NV - 1
    constexpr int NV = RPL >= LC ? RPL / LC : 1;
    int base = 0;
    int n = RPL;
#pragma unroll
    for (int off = LC / 2; off >= 1; off >>= 1) {
      if (n > 1) {
        const int h = n / 2;
        const bool upper = lane & off;
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
          for (int j = 0; j < h; ++j) {
            const float send = upper ? acc[m][j] : acc[m][j + h];
            const float keep = upper ? acc[m][j + h] : acc[m][j];
            acc[m][j] = keep + __shfl_xor_sync(FULL, send, off);
          }
        if (upper) base += h;
        n = h;
      } else {
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[m][0] += __shfl_xor_sync(FULL, acc[m][0], off);
      }
    }
    constexpr int WMASK = RPL < LC ? LC / RPL - 1 : 0;   // lanes that only repeated a full add
    if (xr > 0) __syncthreads();   // the previous row's sums are read before red is written again
    if ((lc & WMASK) == 0) {
#pragma unroll
      for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int j = 0; j < NV; ++j) red[(warp * NM + m) * ROWS + lr + LR * (base + j)] = acc[m][j];
    }
    __syncthreads();
    if (threadIdx.x < ROWS) {
      const int r = threadIdx.x;
      float t[NM];
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        t[m] = 0.0f;
        for (int w = 0; w < nwarps; ++w) t[m] += red[(w * NM + m) * ROWS + r];
      }
      fp8_store<NM, SWIGLU>(a, t, yp, size_t(xr) * ys + row0 + r);
    }
  }
}

template <int LC, int RPL, int CPL, bool SW>
cudaError_t fp8_launch(const Fp8Args& a, int blocks, int warps, cudaStream_t st, int pdl) {
  constexpr int ROWS = (32 / LC) * RPL, NM = SW ? 2 : 1;
  return launch(a.nx > 1 ? fp8_gemv_kernel<LC, RPL, CPL, SW, true> : fp8_gemv_kernel<LC, RPL, CPL, SW, false>,
                dim3(blocks), dim3(32 * warps),
                size_t(warps) * NM * ROWS * sizeof(float), st, pdl, a);
}

// The instantiated configs: RPL * CPL * NM <= 16 weight chunks per lane.
template <int LC, int CPL, bool SW>
Fp8Launch fp8_pick_rpl(int rpl) {
  constexpr int NM = SW ? 2 : 1;
  switch (rpl) {
    case 1: return fp8_launch<LC, 1, CPL, SW>;
    case 2: return fp8_launch<LC, 2, CPL, SW>;
    case 4: return fp8_launch<LC, 4, CPL, SW>;
    case 8:
      if constexpr (8 * CPL * NM <= 16) return fp8_launch<LC, 8, CPL, SW>;
      return nullptr;
    case 16:
      if constexpr (16 * CPL * NM <= 16) return fp8_launch<LC, 16, CPL, SW>;
      return nullptr;
    default: return nullptr;
  }
}

template <int LC, bool SW>
Fp8Launch fp8_pick_cpl(int cpl, int rpl) {
  switch (cpl) {
    case 1: return fp8_pick_rpl<LC, 1, SW>(rpl);
    case 2: return fp8_pick_rpl<LC, 2, SW>(rpl);
    default: return nullptr;
  }
}

template <bool SW>
Fp8Launch fp8_pick(int lc, int cpl, int rpl) {
  switch (lc) {
    case 8: return fp8_pick_cpl<8, SW>(cpl, rpl);
    case 16: return fp8_pick_cpl<16, SW>(cpl, rpl);
    case 32: return fp8_pick_cpl<32, SW>(cpl, rpl);
    default: return nullptr;
  }
}

}  // namespace

extern "C" {


// Returns 0 or a cudaError_t; -1: no such config. Grid: blocks CTAs of 32 * warps threads, each
// ROWS = (32 / lc) * rpl rows; K == warps * lc * cpl * 16. nx activation rows (x row t at x + t * xs
// elements, its outputs at y0 / y1 + t * ys0 / ys1).
int dsv4_fp8_gemv(const void* w0, const void* s0, void* y0, const void* w1, const void* s1, void* y1,
                  const void* x, int n0, int K, int ng, float limit, int flags, int swiglu, int lc,
                  int rpl, int cpl, int warps, int blocks, int nx, int xs, int ys0, int ys1,
                  void* stream, int pdl) {
  const Fp8Launch fn = swiglu ? fp8_pick<true>(lc, cpl, rpl) : fp8_pick<false>(lc, cpl, rpl);
  if (fn == nullptr || warps < 1 || warps > 16 || blocks < 1 || nx < 1) return -1;
  return fn(fp8_args(w0, s0, y0, w1, s1, y1, x, n0, K, ng, limit, flags, nx, xs, ys0, ys1), blocks,
            warps, static_cast<cudaStream_t>(stream), pdl);
}

}  // extern "C"
