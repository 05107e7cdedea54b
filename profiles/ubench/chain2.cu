// Microbenchmark (not part of the library): what a chain of M dependent weight streams
// (y_i = W_i y_(i-1), bf16 GEMVs of 33.6 / 8.4 / 16.8 MB a stage) loses at its boundaries, against
// one GEMV of all M matrices' rows (no dependency: the floor) and a plain read of the bytes:
//   graph without PDL, and graph+PDL (each stage launched early, its first weights requested
//   before griddepcontrol.wait, as the library's kernels do): "regs 2" requests 2 x 16 bytes a
//   lane into registers; "smem PREC" copies the first PREC 512-byte chunks of each warp's first
//   row into shared memory (cp.async) before the wait;
//   persistent: one kernel, every CTA resident, a grid barrier between stages, the next stage's
//   first weights requested (registers or shared memory) before the barrier.
// Every variant's y checked bit for bit against the graph without PDL. Results: BENCHMARKS.md
// (issue 45, twenty-first session). Build and run: profiles/ubench/run.sh chain2
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>

#include "chain.cuh"

__device__ __forceinline__ void cp_async16(void* s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(s)), "l"(g) : "memory");
}
template <int PREC>
__device__ void prefetch_smem(const __nv_bfloat16* W, int N, int K, uint4* ws) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (gw < N) {
#pragma unroll
    for (int i = 0; i < PREC; ++i) cp_async16(ws + (warp * PREC + i) * 32 + lane, W + size_t(gw) * K + size_t(i) * 256 + lane * 8);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// as gemv_rows, the first row's first PREC chunks from shared memory (each lane reads back only
// what it copied itself: its own wait_group is enough)
template <int PREC>
__device__ void gemv_rows_s(const __nv_bfloat16* W, const float* xs, float* y, int N, int K, const uint4* ws) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nw = (gridDim.x * blockDim.x) >> 5, chunks = K / 256;
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  for (int r = gw; r < N; r += nw) {
    const __nv_bfloat16* row = W + size_t(r) * K;
    float s = 0.f;
    uint4 buf[4];
    int c = 0;
    if (r == gw) {
#pragma unroll
      for (int i = 0; i < PREC; ++i) s += dot8(ws[(warp * PREC + i) * 32 + lane], xs + (i * 32 + lane) * 8);
      c = PREC;
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
    if (lane == 0) y[r] = s * (1.0f / 64.0f);
  }
}
template <int PREC>
__global__ void __launch_bounds__(THREADS) stage_kernel_s(const __nv_bfloat16* W, const float* x, float* y, int N, int K) {
  extern __shared__ float xs[];
  uint4* ws = reinterpret_cast<uint4*>(xs + K);
  prefetch_smem<PREC>(W, N, K, ws);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  load_x(x, xs, K);
  gemv_rows_s<PREC>(W, xs, y, N, K, ws);
}
template <int PREC>
__global__ void __launch_bounds__(THREADS) chain_kernel_s(const __nv_bfloat16* const* Ws, const float* x0, float* ys,
                                                          int M, int N, int K, unsigned* bar, unsigned epoch) {
  extern __shared__ float xs[];
  uint4* ws = reinterpret_cast<uint4*>(xs + K);
  prefetch_smem<PREC>(Ws[0], N, K, ws);
  const float* x = x0;
  for (int i = 0; i < M; ++i) {
    load_x(i == 0 || N == K ? x : x0, xs, K);
    gemv_rows_s<PREC>(Ws[i], xs, ys + size_t(i) * N, N, K, ws);
    __syncthreads();   // every warp done with xs
    if (i + 1 < M) prefetch_smem<PREC>(Ws[i + 1], N, K, ws);
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned target = (epoch * M + i + 1) * gridDim.x;
      atomicAdd(bar, 1u);
      unsigned v;
      do { asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(bar)); } while (v < target);
    }
    __syncthreads();
    x = ys + size_t(i) * N;
  }
}

// all stages in one kernel: a grid barrier between them (every CTA resident)
__global__ void __launch_bounds__(THREADS) chain_kernel(const __nv_bfloat16* const* Ws, const float* x0, float* ys,
                                                        int M, int N, int K, unsigned* bar, unsigned epoch) {
  extern __shared__ float xs[];
  uint4 first[PRE];
  prefetch_first(Ws[0], N, K, first);
  const float* x = x0;
  for (int i = 0; i < M; ++i) {
    load_x(i == 0 || N == K ? x : x0, xs, K);
    gemv_rows(Ws[i], xs, ys + size_t(i) * N, N, K, first);
    if (i + 1 < M) prefetch_first(Ws[i + 1], N, K, first);
    __syncthreads();
    if (threadIdx.x == 0) {   // the grid barrier: count in, wait for every CTA of this stage
      __threadfence();
      const unsigned target = (epoch * M + i + 1) * gridDim.x;
      atomicAdd(bar, 1u);
      unsigned v;
      do { asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(bar)); } while (v < target);
    }
    __syncthreads();
    x = ys + size_t(i) * N;
  }
}


int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);   // a line at a time, also through a pipe
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, dev));
  printf("%s, %d SMs (chain2: shared-memory requests before the dependency)\n", prop.name, sms);
  struct Cfg { int M, N, K; };
  const Cfg cfgs[] = {{4, 4096, 4096}, {8, 1024, 4096}, {9, 2048, 4096}};
  uint32_t* dummy; CK(cudaMalloc(&dummy, 4));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  const int REPS = 50, COPIES = 3;
  typedef void (*StageFn)(const __nv_bfloat16*, const float*, float*, int, int);
  typedef void (*ChainFn)(const __nv_bfloat16* const*, const float*, float*, int, int, int, unsigned*, unsigned);
  struct Var { const char* name; StageFn stage; ChainFn chain; int prec; };
  const Var vars[] = {{"regs 2", stage_kernel, chain_kernel, 0},
                      {"smem 4", stage_kernel_s<4>, chain_kernel_s<4>, 4},
                      {"smem 8", stage_kernel_s<8>, chain_kernel_s<8>, 8},
                      {"smem 16", stage_kernel_s<16>, chain_kernel_s<16>, 16}};
  for (const Cfg& c : cfgs) {
    const size_t per = size_t(c.N) * c.K, bytes = per * 2 * c.M;
    __nv_bfloat16* w; CK(cudaMalloc(&w, bytes * COPIES));
    {
      std::vector<__nv_bfloat16> h(per * c.M);
      uint32_t s = 99;
      for (auto& v : h) { s = s * 1664525u + 1013904223u; v = __float2bfloat16(((s >> 8) & 0xFFFF) / 32768.0f - 1.0f); }
      for (int k = 0; k < COPIES; ++k) CK(cudaMemcpy(w + k * per * c.M, h.data(), bytes, cudaMemcpyHostToDevice));
    }
    float *x0, *ys, *ys2; unsigned* bar;
    CK(cudaMalloc(&x0, c.K * 4)); CK(cudaMalloc(&ys, size_t(c.M) * c.N * 4)); CK(cudaMalloc(&ys2, size_t(c.M) * c.N * 4));
    CK(cudaMalloc(&bar, 4)); CK(cudaMemset(bar, 0, 4));
    {
      std::vector<float> hx(c.K);
      for (int i = 0; i < c.K; ++i) hx[i] = std::sin(0.1f * i);
      CK(cudaMemcpy(x0, hx.data(), c.K * 4, cudaMemcpyHostToDevice));
    }
    std::vector<const __nv_bfloat16*> hp(size_t(c.M) * COPIES);
    for (int k = 0; k < COPIES; ++k) for (int i = 0; i < c.M; ++i) hp[k * c.M + i] = w + (size_t(k) * c.M + i) * per;
    const __nv_bfloat16** dp; CK(cudaMalloc(&dp, hp.size() * sizeof(void*)));
    CK(cudaMemcpy(dp, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
    auto xin = [&](float* yb, int i) -> const float* { return i == 0 || c.N != c.K ? x0 : yb + size_t(i - 1) * c.N; };
    auto time = [&](auto&& fn) {
      for (int i = 0; i < 5; ++i) fn(i);
      CK(cudaStreamSynchronize(st));
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < REPS; ++i) fn(i);
      CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); return ms * 1000 / REPS;
    };
    const size_t smem0 = size_t(c.K) * 4;
    CK(cudaFuncSetAttribute(stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem0)));
    int occ0 = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ0, stage_kernel, THREADS, smem0));
    const int grid0 = sms * std::min(occ0, 2);
    const float t_one = time([&](int i) {
      cudaLaunchConfig_t lc = {};
      lc.gridDim = dim3(grid0); lc.blockDim = dim3(THREADS); lc.dynamicSmemBytes = smem0; lc.stream = st;
      CK(cudaLaunchKernelEx(&lc, stage_kernel, hp[(i % COPIES) * c.M], x0, ys2, c.N * c.M, c.K));
    });
    float t_read = 1e9;
    for (int b : {sms * 2, sms * 4, sms * 8})
      t_read = std::min(t_read, time([&](int i) {
        read_all<<<b, 512, 0, st>>>(reinterpret_cast<const uint4*>(w + (i % COPIES) * per * c.M), bytes / 16, dummy);
      }));
    printf("%d stages of %d x %d bf16 (%.1f MB each, %.1f MB): read alone %.1f us, one GEMV of all rows %.1f us (grid %d)\n",
           c.M, c.N, c.K, per * 2 / 1e6, bytes / 1e6, t_read, t_one, grid0);
    std::vector<float> ref(size_t(c.M) * c.N);
    for (int pdl = 0; pdl < 2; ++pdl)
      for (const Var& v : vars) {
        if (!pdl && v.prec) continue;
        const size_t smem = smem0 + size_t(THREADS / 32) * v.prec * 512;
        CK(cudaFuncSetAttribute(v.stage, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        CK(cudaFuncSetAttribute(v.chain, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        int occ = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v.chain, THREADS, smem));
        const int grid = sms * std::min(occ, 2);
        std::vector<cudaGraphExec_t> ex(COPIES);
        for (int k = 0; k < COPIES; ++k) {
          cudaGraph_t g;
          CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
          for (int i = 0; i < c.M; ++i) {
            cudaLaunchConfig_t lc = {};
            lc.gridDim = dim3(grid); lc.blockDim = dim3(THREADS); lc.dynamicSmemBytes = smem; lc.stream = st;
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            lc.attrs = at; lc.numAttrs = pdl;
            CK(cudaLaunchKernelEx(&lc, v.stage, hp[k * c.M + i], xin(ys, i), ys + size_t(i) * c.N, c.N, c.K));
          }
          CK(cudaStreamEndCapture(st, &g));
          CK(cudaGraphInstantiate(&ex[k], g, 0));
        }
        const float t_graph = time([&](int i) { CK(cudaGraphLaunch(ex[i % COPIES], st)); });
        CK(cudaGraphLaunch(ex[0], st));
        CK(cudaStreamSynchronize(st));
        std::vector<float> a(ref.size());
        CK(cudaMemcpy(a.data(), ys, a.size() * 4, cudaMemcpyDeviceToHost));
        if (!pdl) ref = a;
        float t_pers = 0; bool same_p = true;
        if (pdl) {
          unsigned epoch = 0;
          CK(cudaMemset(bar, 0, 4));
          t_pers = time([&](int i) { v.chain<<<grid, THREADS, smem, st>>>(dp + (i % COPIES) * c.M, x0, ys2, c.M, c.N, c.K, bar, epoch++); });
          v.chain<<<grid, THREADS, smem, st>>>(dp, x0, ys2, c.M, c.N, c.K, bar, epoch++);
          CK(cudaStreamSynchronize(st));
          std::vector<float> b(ref.size());
          CK(cudaMemcpy(b.data(), ys2, b.size() * 4, cudaMemcpyDeviceToHost));
          same_p = b == ref;
        }
        if (pdl)
          printf("  %-8s grid %3d: graph+PDL %6.1f us (%5.2f a boundary) | persistent %6.1f us (%5.2f a boundary) | same bits %s/%s\n",
                 v.name, grid, t_graph, (t_graph - t_one) / (c.M - 1), t_pers, (t_pers - t_one) / (c.M - 1),
                 a == ref ? "yes" : "NO", same_p ? "yes" : "NO");
        else
          printf("  graph without PDL, grid %3d: %6.1f us (%5.2f a boundary)\n", grid, t_graph, (t_graph - t_one) / (c.M - 1));
        for (auto& gx : ex) CK(cudaGraphExecDestroy(gx));
      }
    CK(cudaFree(w)); CK(cudaFree(x0)); CK(cudaFree(ys)); CK(cudaFree(ys2)); CK(cudaFree(bar)); CK(cudaFree(dp));
  }
  return 0;
}
