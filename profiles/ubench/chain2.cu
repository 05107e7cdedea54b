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
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  gemv_rows<PREC>(W, xs, y, N, K, [&](int i) { return ws[(warp * PREC + i) * 32 + lane]; });
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
    if (threadIdx.x == 0) grid_wait_atomic(bar, (epoch * M + i + 1) * gridDim.x);
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
    if (threadIdx.x == 0) grid_wait_atomic(bar, (epoch * M + i + 1) * gridDim.x);   // every CTA of this stage
    __syncthreads();
    x = ys + size_t(i) * N;
  }
}


int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);   // a line at a time, also through a pipe
  cudaDeviceProp prop;
  const int sms = sm_count(prop);
  printf("%s, %d SMs (chain2: shared-memory requests before the dependency)\n", prop.name, sms);
  struct Cfg { int M, N, K; };
  const Cfg cfgs[] = {{4, 4096, 4096}, {8, 1024, 4096}, {9, 2048, 4096}};
  Timer T;
  const cudaStream_t st = T.st;
  const int COPIES = 3;
  typedef void (*StageFn)(const __nv_bfloat16*, const float*, float*, int, int);
  typedef void (*ChainFn)(const __nv_bfloat16* const*, const float*, float*, int, int, int, unsigned*, unsigned);
  struct Var { const char* name; StageFn stage; ChainFn chain; int prec; };
  const Var vars[] = {{"regs 2", stage_kernel, chain_kernel, 0},
                      {"smem 4", stage_kernel_s<4>, chain_kernel_s<4>, 4},
                      {"smem 8", stage_kernel_s<8>, chain_kernel_s<8>, 8},
                      {"smem 16", stage_kernel_s<16>, chain_kernel_s<16>, 16}};
  for (const Cfg& c : cfgs) {
    const ChainData d(c.M, c.N, c.K, COPIES);
    const size_t smem0 = size_t(c.K) * 4;
    CK(cudaFuncSetAttribute(stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem0)));
    int occ0 = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ0, stage_kernel, THREADS, smem0));
    const int grid0 = sms * std::min(occ0, 2);
    // one GEMV of all M * N rows (no dependency): the floor of this GEMV
    const float t_one = T.time([&](int i) {
      Launch L(dim3(grid0), dim3(THREADS), smem0, st, false);
      L(stage_kernel, d.hp[(i % COPIES) * c.M], d.x0, d.ys2, c.N * c.M, c.K);
    });
    const float t_read = T.read(d.w, d.bytes, COPIES, d.bytes, sms);
    printf("%d stages of %d x %d bf16 (%.1f MB each, %.1f MB): read alone %.1f us, one GEMV of all rows %.1f us (grid %d)\n",
           c.M, c.N, c.K, d.per * 2 / 1e6, d.bytes / 1e6, t_read, t_one, grid0);
    std::vector<float> ref;
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
        for (int k = 0; k < COPIES; ++k) ex[k] = d.capture(st, v.stage, grid, smem, pdl, k);
        const float t_graph = T.time([&](int i) { CK(cudaGraphLaunch(ex[i % COPIES], st)); });
        CK(cudaGraphLaunch(ex[0], st));
        CK(cudaStreamSynchronize(st));
        const std::vector<float> a = fetch(d.ys, size_t(c.M) * c.N);
        if (!pdl) ref = a;
        float t_pers = 0; bool same_p = true;
        if (pdl) {
          unsigned epoch = 0;
          CK(cudaMemset(d.bar, 0, 4));
          t_pers = T.time([&](int i) { v.chain<<<grid, THREADS, smem, st>>>(d.dp + (i % COPIES) * c.M, d.x0, d.ys2, c.M, c.N, c.K, d.bar, epoch++); });
          v.chain<<<grid, THREADS, smem, st>>>(d.dp, d.x0, d.ys2, c.M, c.N, c.K, d.bar, epoch++);
          CK(cudaStreamSynchronize(st));
          same_p = fetch(d.ys2, ref.size()) == ref;
        }
        if (pdl)
          printf("  %-8s grid %3d: graph+PDL %6.1f us (%5.2f a boundary) | persistent %6.1f us (%5.2f a boundary) | same bits %s/%s\n",
                 v.name, grid, t_graph, (t_graph - t_one) / (c.M - 1), t_pers, (t_pers - t_one) / (c.M - 1),
                 a == ref ? "yes" : "NO", same_p ? "yes" : "NO");
        else
          printf("  graph without PDL, grid %3d: %6.1f us (%5.2f a boundary)\n", grid, t_graph, (t_graph - t_one) / (c.M - 1));
        for (auto& gx : ex) CK(cudaGraphExecDestroy(gx));
      }
  }
  return 0;
}
