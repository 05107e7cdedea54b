// The W8A8 FP8 GEMV on tensor cores (dsv4_fp8_gemv_mma): mma.m16n8k16 with f16 operands (the e4m3
// weights and act-quantized activations are exact in f16) for up to 8 activation rows, one per B
// column: the speculative verify rows for about the time of one.
#include "dsv4_api.h"
#include "fp8.cuh"

namespace {

// The W8A8 FP8 GEMV of up to MMA_MAX_X activation rows on tensor cores (mma.m16n8k16, f16 operands,
// float32 accumulation): A = 16 weight rows (e4m3 -> f16 by cvt: exact), B column n = activation
// row n act-quantized per 128 (the e4m3 values, exact in f16; columns >= nx are zero), so a row's
// result never depends on the other columns: one row in a launch of nx gets the bits of a one-row
// launch. C restarts at zero for every 128-block, is scaled by the weight's and the row's block
// scales (powers of two: exact) and added into float32 sums in block order; warps split K and meet
// in a fixed-order sum. Every weight and scale byte is requested before the PDL wait.
//
// One CTA: 16 rows (inside one 128-row scale block; FLAG_TWO: of one matrix) x all of K; warp w
// takes the 128-blocks [w * SPW, (w + 1) * SPW). Lane (g, q) (g = lane / 4, q = lane % 4) holds
// the 16-byte chunks q and q + 4 of every block of rows g and g + 8: word j of chunk c is the A
// operand of one MMA for the four lanes q (bytes 0, 1 at k = 2q, 2q + 1; bytes 2, 3 at k = 2q + 8,
// 2q + 9), so B's lane (g, q) needs activation row g at the same 4 K positions, in natural order:
// the warp first act-quantizes its K slice of each row into shared memory (xs, f16).
constexpr int MMA_MAX_X = 8;

// Halves per xs row: a 16-byte pad puts the rows' reads in different banks.
template <int SPW>
__host__ __device__ constexpr int mma_xrow() { return 128 * SPW + 8; }

// Bytes of fp8_mma_kernel's shared memory: per warp xs [nx][mma_xrow] f16 and ef [nx][SPW] float
// (the row's block scales), then red [warps][NM][16][8] float.
template <int SPW, int NM>
constexpr size_t fp8_mma_smem(int warps, int nx) {
  return size_t(warps) * nx * (2 * mma_xrow<SPW>() + 4 * SPW) + size_t(warps) * NM * 128 * 4;
}

// The pieces of fp8_mma_stream_kernel below. fp8_mma_kernel shares the epilogue (mma_partial,
// mma_finish: its registers and instructions unchanged) and writes out the statements of the
// others (mma_load, mma_quant_x, mma_blocks): with those moved into functions its register
// allocation changed (a spill in the spw-2 instance), and it is the tuned kernel. The stream
// kernel's test holds the two to the same bits.
//
// The weights of blocks [kb, kb + NB) of the tile whose first row (in its matrix) is row0, lane
// (g, q)'s part: [matrix][block][row g / g + 8][chunk q / q + 4], and the blocks' scale bytes.
template <int NB, int NM>
DEV void mma_load(const uint8_t* const (&wp)[NM], const uint8_t* const (&sp)[NM], int row0, int K,
                  int kb, int g, int q, uint4 (&wv)[NM][NB][2][2], uint32_t (&sw)[NM][NB]) {
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int s = 0; s < NB; ++s) {
      const uint8_t* p = wp[m] + size_t(row0 + g) * K + size_t(kb + s) * 128 + 16 * q;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < 2; ++c) wv[m][s][h][c] = ld_stream(p + size_t(8 * h) * K + 64 * c);
      sw[m][s] = ld_stream_u8(sp[m] + (row0 >> 7) * (K >> 7) + kb + s);
    }
}

// The warp's K slice of every activation row as f16 operands into its xs / ef (lane l: elements
// [4 SPW l, +4 SPW) of the slice): act-quantized (FLAG_QUANT: the e4m3 values, ef = the block's
// scale), or (bf16 x, no act quant: wo_a) scaled by a power of two that puts the block's largest
// magnitude in [2^15, 2^16): every bf16 value of the block down to 2^-33 of that magnitude is
// exact in f16. xoff: the element of row 0 the lane's slice starts at.
template <int SPW>
DEV void mma_quant_x(const Fp8Args& a, size_t xoff, int lane, __half* xs, float* ef) {
  constexpr int EPL = 4 * SPW, LPB = 32 / SPW, XR = mma_xrow<SPW>();
  const bool xf32 = a.flags & FLAG_X_F32, quant = a.flags & FLAG_QUANT;
  for (int n = 0; n < a.nx; ++n) {
    float v[EPL];
    load_act<EPL>(a.x, size_t(n) * a.xs + xoff, xf32, v);
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < EPL; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
    for (int off = 1; off < LPB; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, off));
    const int e = quant ? block_exponent(amax)
                        : max(int((__float_as_uint(amax) >> 23) & 0xFFu) - 127 - 15, -126);
    const float inv = pow2f(-e);
    uint32_t* dst = reinterpret_cast<uint32_t*>(xs + n * XR + lane * EPL);
    if (quant) {
#pragma unroll
      for (int j = 0; j < EPL; j += 2) dst[j / 2] = f32x2_to_e4m3_f16x2(v[j] * inv, v[j + 1] * inv);
    } else {
#pragma unroll
      for (int j = 0; j < EPL; j += 2) {
        const __half2 h = __floats2half2_rn(v[j] * inv, v[j + 1] * inv);
        dst[j / 2] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    if (lane % LPB == 0) ef[n * SPW + lane / LPB] = pow2f(e);
  }
}

// The warp's blocks s0 .. s0 + NB - 1 of its SPW (weights wv / sw, the operands in xs / ef) added
// into tot [matrix][row g / g + 8][column 2q / 2q + 1], block after block: C restarts at zero for
// every block, then is scaled by the weight's and the row's block scales.
template <int SPW, int NB, int NM>
DEV void mma_blocks(const uint4 (&wv)[NM][NB][2][2], const uint32_t (&sw)[NM][NB],
                    const __half* xs, const float* ef, int s0, int nx, int g, int q,
                    float (&tot)[NM][2][2]) {
  constexpr int XR = mma_xrow<SPW>();
#pragma unroll
  for (int s = 0; s < NB; ++s) {
    float c[NM][4];
#pragma unroll
    for (int m = 0; m < NM; ++m) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
#pragma unroll
    for (int ch = 0; ch < 2; ++ch) {
      uint4 b[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
      if (g < nx) {
        const uint4* xp =
            reinterpret_cast<const uint4*>(xs + g * XR + (s0 + s) * 128 + 16 * (q + 4 * ch));
        b[0] = xp[0];
        b[1] = xp[1];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t b0 = j == 0 ? b[0].x : j == 1 ? b[0].z : j == 2 ? b[1].x : b[1].z;
        const uint32_t b1 = j == 0 ? b[0].y : j == 1 ? b[0].w : j == 2 ? b[1].y : b[1].w;
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          const uint4& ra = wv[m][s][0][ch];
          const uint4& rb = wv[m][s][1][ch];
          const uint32_t wa = j == 0 ? ra.x : j == 1 ? ra.y : j == 2 ? ra.z : ra.w;
          const uint32_t wb = j == 0 ? rb.x : j == 1 ? rb.y : j == 2 ? rb.z : rb.w;
          uint32_t alo, ahi, blo, bhi;
          e4m3x4_to_f16x4(wa, alo, ahi);
          e4m3x4_to_f16x4(wb, blo, bhi);
          mma_f16(c[m], alo, blo, ahi, bhi, b0, b1);
        }
      }
    }
    // C[r][n]: c[0] (g, 2q), c[1] (g, 2q + 1), c[2] (g + 8, 2q), c[3] (g + 8, 2q + 1)
    const float f0 = 2 * q < nx ? ef[(2 * q) * SPW + s0 + s] : 0.0f;
    const float f1 = 2 * q + 1 < nx ? ef[(2 * q + 1) * SPW + s0 + s] : 0.0f;
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const float ws = e8m0(sw[m][s]);
      tot[m][0][0] = fmaf(c[m][0], ws * f0, tot[m][0][0]);
      tot[m][0][1] = fmaf(c[m][1], ws * f1, tot[m][0][1]);
      tot[m][1][0] = fmaf(c[m][2], ws * f0, tot[m][1][0]);
      tot[m][1][1] = fmaf(c[m][3], ws * f1, tot[m][1][1]);
    }
  }
}

// The warp's sums into red[warp][m][row][column] (the caller's barrier follows).
template <int NM>
DEV void mma_partial(const float (&tot)[NM][2][2], float* red, int warp, int g, int q) {
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* rp = red + ((warp * NM + m) * 16 + g + 8 * h) * 8 + 2 * q;
      rp[0] = tot[m][h][0];
      rp[1] = tot[m][h][1];
    }
}

// After the barrier: thread (column n, row r) adds the warps' sums in warp order (the SwiGLU on
// the bf16 values) and writes the tile's output rows row0 .. row0 + 15 of yp (row stride ys).
template <int NM, bool SWIGLU>
DEV void mma_finish(const Fp8Args& a, const float* red, int nwarps, void* yp, int ys, int row0) {
  for (int t = threadIdx.x; t < 16 * a.nx; t += blockDim.x) {
    const int r = t & 15, n = t >> 4;
    float v[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      v[m] = 0.0f;
      for (int w = 0; w < nwarps; ++w) v[m] += red[((w * NM + m) * 16 + r) * 8 + n];
    }
    fp8_store<NM, SWIGLU>(a, v, yp, size_t(n) * ys + row0 + r);
  }
}

template <int SPW, bool SWIGLU>
__global__ void __launch_bounds__(512) fp8_mma_kernel(const Fp8Args a) {
  constexpr int NM = SWIGLU ? 2 : 1, XR = mma_xrow<SPW>();
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, nx = a.nx, K = a.K;
  int row0 = blockIdx.x * 16;
  DSV4_FP8_OPERANDS(a, NM, SWIGLU)
  const int kb0 = warp * SPW;   // the warp's first 128-block

  // weights [matrix][block][row g / g + 8][chunk q / q + 4] and the blocks' scale bytes
  uint4 wv[NM][SPW][2][2];
  uint32_t sw[NM][SPW];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int s = 0; s < SPW; ++s) {
      const uint8_t* p = wp[m] + size_t(row0 + g) * K + size_t(kb0 + s) * 128 + 16 * q;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < 2; ++c) wv[m][s][h][c] = ld_stream(p + size_t(8 * h) * K + 64 * c);
      sw[m][s] = ld_stream_u8(sp[m] + (row0 >> 7) * (K >> 7) + kb0 + s);
    }
  pdl_wait();

  // the warp's K slice of every activation row as f16 operands (lane l: elements [4 SPW l, +4 SPW)
  // of the slice): act-quantized (FLAG_QUANT: the e4m3 values, ef = the block's scale), or
  // (bf16 x, no act quant: wo_a) scaled by a power of two that puts the block's largest magnitude
  // in [2^15, 2^16): every bf16 value of the block down to 2^-33 of that magnitude is exact in f16
  __half* xs = reinterpret_cast<__half*>(smem) + size_t(warp) * nx * XR;
  float* ef = reinterpret_cast<float*>(smem + size_t(nwarps) * nx * XR * 2) + warp * nx * SPW;
  float* red = reinterpret_cast<float*>(smem + size_t(nwarps) * nx * (2 * XR + 4 * SPW));
  {
    constexpr int EPL = 4 * SPW, LPB = 32 / SPW;   // elements per lane, lanes per 128-block
    const bool xf32 = a.flags & FLAG_X_F32, quant = a.flags & FLAG_QUANT;
    const size_t xoff =
        (a.ng > 0 ? size_t(row0 / a.ng) * K : 0) + size_t(kb0) * 128 + size_t(lane) * EPL;
    for (int n = 0; n < nx; ++n) {
      float v[EPL];
      load_act<EPL>(a.x, size_t(n) * a.xs + xoff, xf32, v);
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < EPL; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
      for (int off = 1; off < LPB; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, off));
      const int e = quant ? block_exponent(amax)
                          : max(int((__float_as_uint(amax) >> 23) & 0xFFu) - 127 - 15, -126);
      const float inv = pow2f(-e);
      uint32_t* dst = reinterpret_cast<uint32_t*>(xs + n * XR + lane * EPL);
      if (quant) {
#pragma unroll
        for (int j = 0; j < EPL; j += 2)
          dst[j / 2] = f32x2_to_e4m3_f16x2(v[j] * inv, v[j + 1] * inv);
      } else {
#pragma unroll
        for (int j = 0; j < EPL; j += 2) {
          const __half2 h = __floats2half2_rn(v[j] * inv, v[j + 1] * inv);
          dst[j / 2] = *reinterpret_cast<const uint32_t*>(&h);
        }
      }
      if (lane % LPB == 0) ef[n * SPW + lane / LPB] = pow2f(e);
    }
  }
  __syncwarp();

  float tot[NM][2][2] = {};   // [matrix][row g / g + 8][column 2q / 2q + 1]
#pragma unroll
  for (int s = 0; s < SPW; ++s) {
    float c[NM][4];
#pragma unroll
    for (int m = 0; m < NM; ++m) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
#pragma unroll
    for (int ch = 0; ch < 2; ++ch) {
      uint4 b[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
      if (g < nx) {
        const uint4* xp = reinterpret_cast<const uint4*>(xs + g * XR + s * 128 + 16 * (q + 4 * ch));
        b[0] = xp[0];
        b[1] = xp[1];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t b0 = j == 0 ? b[0].x : j == 1 ? b[0].z : j == 2 ? b[1].x : b[1].z;
        const uint32_t b1 = j == 0 ? b[0].y : j == 1 ? b[0].w : j == 2 ? b[1].y : b[1].w;
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          const uint4& ra = wv[m][s][0][ch];
          const uint4& rb = wv[m][s][1][ch];
          const uint32_t wa = j == 0 ? ra.x : j == 1 ? ra.y : j == 2 ? ra.z : ra.w;
          const uint32_t wb = j == 0 ? rb.x : j == 1 ? rb.y : j == 2 ? rb.z : rb.w;
          uint32_t alo, ahi, blo, bhi;
          e4m3x4_to_f16x4(wa, alo, ahi);
          e4m3x4_to_f16x4(wb, blo, bhi);
          mma_f16(c[m], alo, blo, ahi, bhi, b0, b1);
        }
      }
    }
    // C[r][n]: c[0] (g, 2q), c[1] (g, 2q + 1), c[2] (g + 8, 2q), c[3] (g + 8, 2q + 1)
    const float f0 = 2 * q < nx ? ef[(2 * q) * SPW + s] : 0.0f;
    const float f1 = 2 * q + 1 < nx ? ef[(2 * q + 1) * SPW + s] : 0.0f;
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const float ws = e8m0(sw[m][s]);
      tot[m][0][0] = fmaf(c[m][0], ws * f0, tot[m][0][0]);
      tot[m][0][1] = fmaf(c[m][1], ws * f1, tot[m][0][1]);
      tot[m][1][0] = fmaf(c[m][2], ws * f0, tot[m][1][0]);
      tot[m][1][1] = fmaf(c[m][3], ws * f1, tot[m][1][1]);
    }
  }

  // red[warp][m][row][column]; then thread (column n, row r) adds the warps' sums in warp order
  mma_partial<NM>(tot, red, warp, g, q);
  __syncthreads();
  mma_finish<NM, SWIGLU>(a, red, nwarps, yp, ys, row0);
}

// fp8_mma_kernel over a fixed grid of G CTAs: CTA b takes the tiles b, b + G, b + 2G, ... of the
// `tiles` 16-row tiles, each tile's SPW blocks a warp in U units of NB = SPW / U blocks (U = 2 for
// SPW >= 2), the next unit's weights (of this tile or the next) in flight while the current one
// is computed, so that an SM keeps loading across its tiles and their epilogues instead of idling
// through each CTA's compute, epilogue and exit (the per-tile kernel at wo_b's shape: 256 CTAs of
// 512 threads, one an SM, in two waves). The activation slice is quantized once (with x groups,
// again when a tile's group differs from the one before); the epilogue's red in two buffers by
// tile parity (one barrier a tile). The sums are fp8_mma_kernel's (a warp's blocks in order, the
// warps in order): the same bits.
template <int SPW, bool SWIGLU>
__global__ void __launch_bounds__(512) fp8_mma_stream_kernel(const Fp8Args a, int tiles) {
  constexpr int NM = SWIGLU ? 2 : 1, XR = mma_xrow<SPW>();
  constexpr int NB = SPW >= 2 ? SPW / 2 : 1, U = SPW / NB;
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, nx = a.nx, K = a.K, G = gridDim.x;
  const int kb0 = warp * SPW;
  const int units = (tiles - int(blockIdx.x) + G - 1) / G * U;   // >= U: the grid <= tiles
  __half* xs = reinterpret_cast<__half*>(smem) + size_t(warp) * nx * XR;
  float* ef = reinterpret_cast<float*>(smem + size_t(nwarps) * nx * XR * 2) + warp * nx * SPW;
  float* red0 = reinterpret_cast<float*>(smem + size_t(nwarps) * nx * (2 * XR + 4 * SPW));
  const int rsz = nwarps * NM * 128;   // floats of one red buffer
  uint4 wA[NM][NB][2][2], wB[NM][NB][2][2];
  uint32_t sA[NM][NB], sB[NM][NB];
  auto load = [&](uint4(&wv)[NM][NB][2][2], uint32_t(&sw)[NM][NB], int u) {
    int row0 = (int(blockIdx.x) + u / U * G) * 16;
    DSV4_FP8_OPERANDS(a, NM, SWIGLU)
    (void)yp;
    (void)ys;
    mma_load<NB, NM>(wp, sp, row0, K, kb0 + u % U * NB, g, q, wv, sw);
  };
  float tot[NM][2][2];
  int group = -1;   // the x group quantized into xs (ng > 0)
  auto compute = [&](const uint4(&wv)[NM][NB][2][2], const uint32_t(&sw)[NM][NB], int u) {
    const int i = u / U, h = u % U;
    int row0 = (int(blockIdx.x) + i * G) * 16;
    DSV4_FP8_OPERANDS(a, NM, SWIGLU)
    if (h == 0) {
      const int gr = a.ng > 0 ? row0 / a.ng : 0;
      if (gr != group) {   // once, or where the tile's x group changes
        __syncwarp();
        mma_quant_x<SPW>(a, size_t(gr) * (a.ng > 0 ? K : 0) + size_t(kb0) * 128 +
                                size_t(lane) * 4 * SPW, lane, xs, ef);
        __syncwarp();
        group = gr;
      }
#pragma unroll
      for (int m = 0; m < NM; ++m) tot[m][0][0] = tot[m][0][1] = tot[m][1][0] = tot[m][1][1] = 0.0f;
    }
    mma_blocks<SPW, NB, NM>(wv, sw, xs, ef, h * NB, nx, g, q, tot);
    if (h == U - 1) {   // the tile's sums: red by tile parity, one barrier
      float* red = red0 + (i & 1) * rsz;
      mma_partial<NM>(tot, red, warp, g, q);
      __syncthreads();
      mma_finish<NM, SWIGLU>(a, red, nwarps, yp, ys, row0);
    }
  };
  load(wA, sA, 0);   // weights: before the PDL wait
  if (units > 1) load(wB, sB, 1);
  pdl_wait();
  for (int u = 0; u < units; u += 2) {
    compute(wA, sA, u);
    if (u + 2 < units) load(wA, sA, u + 2);
    if (u + 1 >= units) break;
    compute(wB, sB, u + 1);
    if (u + 3 < units) load(wB, sB, u + 3);
  }
}

template <int SPW, bool SW>
cudaError_t fp8_mma_launch(const Fp8Args& a, int blocks, int warps, int ctas, cudaStream_t st,
                           int pdl) {
  constexpr int NM = SW ? 2 : 1;
  const bool stream = ctas > 0 && ctas < blocks;   // the fixed grid over the blocks' tiles
  // the stream kernel's second red buffer
  const size_t smem = fp8_mma_smem<SPW, NM>(warps, a.nx) + (stream ? size_t(warps) * NM * 512 : 0);
  const void* fn = stream ? reinterpret_cast<const void*>(fp8_mma_stream_kernel<SPW, SW>)
                          : reinterpret_cast<const void*>(fp8_mma_kernel<SPW, SW>);
  const cudaError_t err = smem_opt_in(fn, smem);
  if (err != cudaSuccess) return err;
  if (stream)
    return launch(fp8_mma_stream_kernel<SPW, SW>, dim3(ctas), dim3(32 * warps), smem, st, pdl, a,
                  blocks);
  return launch(fp8_mma_kernel<SPW, SW>, dim3(blocks), dim3(32 * warps), smem, st, pdl, a);
}

using MmaLaunch = cudaError_t (*)(const Fp8Args&, int, int, int, cudaStream_t, int);

// The instantiated tensor-core configs: SPW * NM <= 4 blocks of weights per lane (64 registers).
MmaLaunch fp8_mma_pick(int spw, bool sw) {
  switch (spw * 2 + sw) {
    case 2: return fp8_mma_launch<1, false>;
    case 3: return fp8_mma_launch<1, true>;
    case 4: return fp8_mma_launch<2, false>;
    case 5: return fp8_mma_launch<2, true>;
    case 8: return fp8_mma_launch<4, false>;
    default: return nullptr;
  }
}

}  // namespace

extern "C" {


// The same GEMV on tensor cores (fp8_mma_kernel): 1 <= nx <= 8 activation rows, act-quantized
// (FLAG_QUANT) or bf16 x (grouped or not); blocks tiles of 16 rows, 32 * warps threads;
// K == warps * 128 * spw. 0 < ctas < blocks: fp8_mma_stream_kernel on ctas CTAs (the same bits).
int dsv4_fp8_gemv_mma(const void* w0, const void* s0, void* y0, const void* w1, const void* s1,
                      void* y1, const void* x, int n0, int K, int ng, float limit, int flags,
                      int swiglu, int spw, int warps, int blocks, int nx, int xs, int ys0, int ys1,
                      int ctas, void* stream, int pdl) {
  const MmaLaunch fn = fp8_mma_pick(spw, swiglu != 0);
  if (fn == nullptr || warps < 1 || warps > 16 || blocks < 1 || nx < 1 || nx > MMA_MAX_X || ctas < 0 ||
      K != warps * 128 * spw || (!(flags & FLAG_QUANT) && (flags & FLAG_X_F32)) || ng < 0 ||
      ng % 16 || (ng && (flags & FLAG_TWO)) || (swiglu && (flags & FLAG_TWO)))
    return -1;
  return fn(fp8_args(w0, s0, y0, w1, s1, y1, x, n0, K, ng, limit, flags, nx, xs, ys0, ys1), blocks,
            warps, ctas, static_cast<cudaStream_t>(stream), pdl);
}

}  // extern "C"
