// The bf16-weight GEMV of the LM head on CUDA cores, over a fixed grid that streams the weight
// (dsv4_bf16_gemv; config and launcher on the Python side: dsv4/kernels/cuda/bf16.py): y [nx, N]
// float32 = x [nx, K] (float32 or bf16 values) @ w [N, K]^T, each product and each sum rounded to
// float32 (no FMA contraction, as the Triton kernel), in one fixed order.
//
// One tile: RT rows x all of K. Warp w takes the K slice [512 w, 512 (w + 1)) (64 chunks of 16
// bytes); lane l its chunks l and l + 32, for every row of the tile. A lane's 16 products of a row
// are added in order, the lanes meet in a shuffle butterfly (every lane ends with the same sum),
// then the warps' sums in warp order. Nothing of that order depends on the grid or on nx, so a row
// in a launch of nx rows (the speculative verify rows, reading the weight once) has the bits of a
// one-row launch, and any number of CTAs gives the same bits.
//
// CTA b takes the tiles b, b + G, b + 2G, ...; the next tile's weights are in flight (a second
// register buffer) while the current one is computed, so an SM keeps loading across its tiles.
// The activation rows are read once per CTA into shared memory (float32). Every weight byte of the
// first two tiles is requested before the PDL wait; the warps' sums go to red by tile parity (one
// barrier a tile).
#include "dsv4_api.h"
#include "dsv4_common.cuh"

#include <type_traits>

namespace {

constexpr int BF16_MAX_X = 4;          // activation rows a launch (the verify rows)
constexpr int BF16_SLICE = 512;        // K elements a warp
constexpr int BF16_RT = 4;             // rows a tile

// bf16 pair -> the two float32 values (element 2i in the low half, 2i + 1 in the high half).
DEV float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
DEV float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

template <int RT>
__global__ void __launch_bounds__(512) bf16_gemv_kernel(const __nv_bfloat16* __restrict__ w,
                                                        const void* x, float* y, int N, int K,
                                                        int nx, int x_f32, int tiles) {
  extern __shared__ __align__(16) float smem[];   // xs [nx][K], then red [2][warps][nx][RT]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int G = gridDim.x;
  const int mine = (tiles - int(blockIdx.x) + G - 1) / G;   // >= 1: the grid <= tiles
  float* xs = smem;
  float* red0 = smem + size_t(nx) * K;
  const int rsz = nwarps * nx * RT;
  const size_t k0 = size_t(warp) * BF16_SLICE + 8 * size_t(lane);   // chunk l; chunk l + 32 at +256

  uint4 wA[RT][2], wB[RT][2];
  auto load = [&](uint4(&wv)[RT][2], int i) {
    const int row0 = (int(blockIdx.x) + i * G) * RT;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const int row = min(row0 + r, N - 1);   // a tail tile's rows past N: clamped, not stored
      const __nv_bfloat16* p = w + size_t(row) * K + k0;
      wv[r][0] = ld_stream(p);
      wv[r][1] = ld_stream(p + 256);
    }
  };
  // rows t0 .. t0 + NT - 1 of x against the tile: x read once per chunk for the RT weight rows,
  // each weight pair unpacked once for the NT rows, the sums stored after every product (a
  // sum's order is the same as one row alone: chunk 0's 8 products, then chunk 1's, in order)
  auto rows_of_x = [&](const uint4(&wv)[RT][2], float* red, auto nt_tag, int t0) {
    constexpr int NT = decltype(nt_tag)::value;
    float p[NT][RT];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < RT; ++r) p[t][r] = 0.0f;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float xv[NT][8];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float* xt = xs + size_t(t0 + t) * K + k0 + 256 * c;
        const float4 xa = *reinterpret_cast<const float4*>(xt);
        const float4 xb = *reinterpret_cast<const float4*>(xt + 4);
        xv[t][0] = xa.x; xv[t][1] = xa.y; xv[t][2] = xa.z; xv[t][3] = xa.w;
        xv[t][4] = xb.x; xv[t][5] = xb.y; xv[t][6] = xb.z; xv[t][7] = xb.w;
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const uint32_t u[4] = {wv[r][c].x, wv[r][c].y, wv[r][c].z, wv[r][c].w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float wf = (e & 1) ? bf16_hi(u[e >> 1]) : bf16_lo(u[e >> 1]);
#pragma unroll
          for (int t = 0; t < NT; ++t) p[t][r] = __fadd_rn(p[t][r], __fmul_rn(wf, xv[t][e]));
        }
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        float q = p[t][r];
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) q = __fadd_rn(q, __shfl_xor_sync(FULL, q, off));
        p[t][r] = q;
      }
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int r = 0; r < RT; ++r) red[(warp * nx + t0 + t) * RT + r] = p[t][r];
    }
  };
  auto compute = [&](const uint4(&wv)[RT][2], int i) {
    const int row0 = (int(blockIdx.x) + i * G) * RT;
    float* red = red0 + (i & 1) * rsz;
    int t0 = 0;
    for (; t0 + 2 <= nx; t0 += 2) rows_of_x(wv, red, std::integral_constant<int, 2>{}, t0);
    if (t0 < nx) rows_of_x(wv, red, std::integral_constant<int, 1>{}, t0);
    __syncthreads();
    for (int j = threadIdx.x; j < nx * RT; j += blockDim.x) {
      const int t = j / RT, r = j % RT;
      if (row0 + r < N) {
        float s = 0.0f;
        for (int v = 0; v < nwarps; ++v) s = __fadd_rn(s, red[(v * nx + t) * RT + r]);
        y[size_t(t) * N + row0 + r] = s;
      }
    }
  };

  load(wA, 0);   // weights: before the PDL wait
  if (mine > 1) load(wB, 1);
  pdl_wait();
  // the activation rows, float32, into xs (every thread, then a barrier)
  for (int j = threadIdx.x; j < nx * K; j += blockDim.x)
    xs[j] = x_f32 ? static_cast<const float*>(x)[j]
                  : __bfloat162float(static_cast<const __nv_bfloat16*>(x)[j]);
  __syncthreads();
  for (int i = 0; i < mine; i += 2) {
    compute(wA, i);
    if (i + 2 < mine) load(wA, i + 2);
    if (i + 1 >= mine) break;
    compute(wB, i + 1);
    if (i + 3 < mine) load(wB, i + 3);
  }
}

}  // namespace

extern "C" {

// y [nx, N] float32 = x [nx, K] (float32 if x_f32, else bf16; rows contiguous) @ w [N, K]^T bf16;
// 1 <= nx <= 4; K a multiple of 512 up to 8,192 (K / 512 warps); ctas CTAs (clamped to the
// tiles of 4 rows) streaming the tiles. The bits depend on neither ctas nor nx.
int dsv4_bf16_gemv(const void* w, const void* x, void* y, int N, int K, int nx, int x_f32,
                   int ctas, void* stream, int pdl) {
  if (N < 1 || K < BF16_SLICE || K % BF16_SLICE || K / BF16_SLICE > 16 || nx < 1 ||
      nx > BF16_MAX_X || ctas < 1)
    return -1;
  const int warps = K / BF16_SLICE;
  const int tiles = (N + BF16_RT - 1) / BF16_RT;
  const int grid = ctas < tiles ? ctas : tiles;
  const size_t smem = (size_t(nx) * K + 2 * size_t(warps) * nx * BF16_RT) * sizeof(float);
  const cudaError_t err =
      smem_opt_in(reinterpret_cast<const void*>(bf16_gemv_kernel<BF16_RT>), smem);
  if (err != cudaSuccess) return err;
  return launch(bf16_gemv_kernel<BF16_RT>, dim3(grid), dim3(32 * warps), smem,
                static_cast<cudaStream_t>(stream), pdl, static_cast<const __nv_bfloat16*>(w), x,
                static_cast<float*>(y), N, K, nx, x_f32, tiles);
}

}  // extern "C"
