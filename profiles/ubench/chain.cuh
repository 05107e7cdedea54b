// The chain microbenchmarks' GEMV (chain2.cu, chain3.cu): y = W x, bf16 W [N, K] on CUDA cores, a
// warp a row, 16-byte loads; stage_kernel is one stage as its own launch with PDL (its first
// weights requested before griddepcontrol.wait, as the library's kernels do).
#pragma once
#include <cuda_bf16.h>
#include "ubench.cuh"

constexpr int THREADS = 512, PRE = 2;   // PRE: 16-byte chunks a lane requests before the dependency

__device__ __forceinline__ float dot8(uint4 w, const float* x) {
  const uint32_t v[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s = fmaf(__uint_as_float(v[i] << 16), x[2 * i], s);
    s = fmaf(__uint_as_float(v[i] & 0xFFFF0000u), x[2 * i + 1], s);
  }
  return s;
}

// rows [0, N) of W [N, K] bf16 against x (shared memory, float), warp a row, rows strided over
// the grid's warps; first[]: the warp's first row's first PRE chunks, already requested
__device__ void gemv_rows(const __nv_bfloat16* W, const float* xs, float* y, int N, int K,
                          const uint4 (&first)[PRE]) {
  const int lane = threadIdx.x & 31, gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nw = (gridDim.x * blockDim.x) >> 5, chunks = K / 256;   // 256 elements a warp-chunk
  for (int r = gw; r < N; r += nw) {
    const __nv_bfloat16* row = W + size_t(r) * K;
    float s = 0.f;
    uint4 buf[4];
    int c = 0;
    if (r == gw) {
#pragma unroll
      for (int i = 0; i < PRE; ++i) s += dot8(first[i], xs + (i * 32 + lane) * 8);
      c = PRE;
    }
    for (; c + 4 <= chunks; c += 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) buf[i] = ldg_na(row + size_t(c + i) * 256 + lane * 8);
#pragma unroll
      for (int i = 0; i < 4; ++i) s += dot8(buf[i], xs + ((c + i) * 32 + lane) * 8);
    }
    for (; c < chunks; ++c) s += dot8(ldg_na(row + size_t(c) * 256 + lane * 8), xs + (c * 32 + lane) * 8);
#pragma unroll
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) y[r] = s * (1.0f / 64.0f);   // keeps the chain's values in range
  }
}

__device__ void prefetch_first(const __nv_bfloat16* W, int N, int K, uint4 (&first)[PRE]) {
  const int lane = threadIdx.x & 31, gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
#pragma unroll
  for (int i = 0; i < PRE; ++i)
    first[i] = gw < N ? ldg_na(W + size_t(gw) * K + size_t(i) * 256 + lane * 8) : make_uint4(0, 0, 0, 0);
}

__device__ void load_x(const float* x, float* xs, int K) {
  for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = __ldcg(x + i);   // L2: written by other CTAs
  __syncthreads();
}


__global__ void __launch_bounds__(THREADS) stage_kernel(const __nv_bfloat16* W, const float* x, float* y, int N, int K) {
  extern __shared__ float xs[];
  uint4 first[PRE];
  prefetch_first(W, N, K, first);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  load_x(x, xs, K);
  gemv_rows(W, xs, y, N, K, first);
}

