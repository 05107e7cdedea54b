// The chain microbenchmarks' GEMV (chain2.cu, chain3.cu): y = W x, bf16 W [N, K] on CUDA cores, a
// warp a row, 16-byte loads; stage_kernel is one stage as its own launch with PDL (its first
// weights requested before griddepcontrol.wait, as the library's kernels do).
#pragma once
#include <cuda_bf16.h>
#include <cmath>
#include <vector>
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
// the grid's warps; the warp's first row's first NF chunks are first(i), already requested
template <int NF, typename First>
__device__ void gemv_rows(const __nv_bfloat16* W, const float* xs, float* y, int N, int K, First first) {
  const int lane = threadIdx.x & 31, gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nw = (gridDim.x * blockDim.x) >> 5, chunks = K / 256;   // 256 elements a warp-chunk
  for (int r = gw; r < N; r += nw) {
    const __nv_bfloat16* row = W + size_t(r) * K;
    float s = 0.f;
    uint4 buf[4];
    int c = 0;
    if (r == gw) {
#pragma unroll
      for (int i = 0; i < NF; ++i) s += dot8(first(i), xs + (i * 32 + lane) * 8);
      c = NF;
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
// ... with the first PRE chunks in registers
__device__ void gemv_rows(const __nv_bfloat16* W, const float* xs, float* y, int N, int K,
                          const uint4 (&first)[PRE]) {
  gemv_rows<PRE>(W, xs, y, N, K, [&](int i) { return first[i]; });
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


// a chain's data: `copies` sets of M bf16 matrices [N, K] (the same values, rotated over the
// replays so that L2 holds none of the next replay's weights), x0 [K], two outputs [M, N], a
// barrier counter (zeroed), the matrices' pointers (hp[k * M + i] on the host, dp on the device)
struct ChainData {
  int M, N, K, copies;
  size_t per, bytes;            // a matrix's elements, a set's bytes
  __nv_bfloat16* w;
  float *x0, *ys, *ys2;
  unsigned* bar;
  std::vector<const __nv_bfloat16*> hp;
  const __nv_bfloat16** dp;
  ChainData(int M_, int N_, int K_, int copies_)
      : M(M_), N(N_), K(K_), copies(copies_), per(size_t(N_) * K_), bytes(size_t(N_) * K_ * 2 * M_) {
    CK(cudaMalloc(&w, bytes * copies));
    std::vector<__nv_bfloat16> h(per * M);
    uint32_t s = 99;
    for (auto& v : h) { s = s * 1664525u + 1013904223u; v = __float2bfloat16(((s >> 8) & 0xFFFF) / 32768.0f - 1.0f); }
    for (int k = 0; k < copies; ++k) CK(cudaMemcpy(w + k * per * M, h.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&x0, K * 4)); CK(cudaMalloc(&ys, size_t(M) * N * 4)); CK(cudaMalloc(&ys2, size_t(M) * N * 4));
    CK(cudaMalloc(&bar, 4)); CK(cudaMemset(bar, 0, 4));
    std::vector<float> hx(K);
    for (int i = 0; i < K; ++i) hx[i] = std::sin(0.1f * i);
    CK(cudaMemcpy(x0, hx.data(), K * 4, cudaMemcpyHostToDevice));
    hp.resize(size_t(M) * copies);
    for (int k = 0; k < copies; ++k) for (int i = 0; i < M; ++i) hp[k * M + i] = w + (size_t(k) * M + i) * per;
    CK(cudaMalloc(&dp, hp.size() * sizeof(void*)));
    CK(cudaMemcpy(dp, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
  }
  ChainData(const ChainData&) = delete;
  ~ChainData() {
    cudaFree(w); cudaFree(x0); cudaFree(ys); cudaFree(ys2); cudaFree(bar); cudaFree(dp);
  }
  // stage i's input: y of stage i - 1 where the shapes chain (N == K), else x0 (the wait still
  // orders the stages, which is what is timed)
  const float* xin(const float* yb, int i) const { return i == 0 || N != K ? x0 : yb + size_t(i - 1) * N; }
  // a graph of the M stages of copy k, each a launch of `stage` (PDL or not) writing ys
  cudaGraphExec_t capture(cudaStream_t st, void (*stage)(const __nv_bfloat16*, const float*, float*, int, int),
                          int grid, size_t smem, bool pdl, int k) const {
    cudaGraph_t g;
    cudaGraphExec_t gx;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < M; ++i) {
      Launch L(dim3(grid), dim3(THREADS), smem, st, pdl);
      L(stage, hp[k * M + i], xin(ys, i), ys + size_t(i) * N, N, K);
    }
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&gx, g, 0));
    return gx;
  }
};
