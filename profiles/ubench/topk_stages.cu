// Microbenchmark (not part of the library): where the indexer's top-k of one decode row goes
// (csrc/topk.cu's topk_bf16_regs_kernel, a cluster of 8 CTAs, its keys in registers). Its stage
// marks (TOPK_MARK) record each CTA's clock after each stage; printed as us from the kernel's
// start, averaged over the cluster, for a 1M-token context's 260,000 scores drawn as the bench's
// (normal, std 0.7, bf16), wider, as a row of few distinct values and as rows whose tail is -inf
// (not yet visible). Also the whole launch back to back, against the cluster kernel that reads its
// segment on every pass (topk_bf16_cluster_kernel; the same output, checked index for index).
// Build and run: profiles/ubench/run.sh topk_stages [N]
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <random>
#include <vector>

__device__ long long* g_marks = nullptr;
#define TOPK_MARK(i) do { if (threadIdx.x == 0 && g_marks) g_marks[blockIdx.x * 16 + (i)] = clock64(); } while (0)
#include "../../csrc/topk.cu"
#include "ubench.cuh"

int main(int argc, char** argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 260000, k = 512;
  int dev = 0, clk = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, dev));   // kHz
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("%s: topk_stages, %d scores, k %d, SM clock %.2f GHz (clock64 -> us at that rate)\n", prop.name, n, k, clk / 1e6);
  uint16_t* sc; int64_t* out; long long* marks;
  CK(cudaMalloc(&sc, n * 2)); CK(cudaMalloc(&out, k * 8)); CK(cudaMalloc(&marks, 8 * 16 * 8));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::mt19937 rng(1);
  for (int dist = 0; dist < 5; ++dist) {
    std::vector<uint16_t> h(n);
    std::normal_distribution<float> nd(0.f, dist == 1 ? 7.f : 0.7f);
    for (int i = 0; i < n; ++i) {
      const bool masked = (dist == 3 && i >= n * 6 / 10) || (dist == 4 && i >= 300);   // not yet visible
      const float v = masked ? -INFINITY : dist == 2 ? float(rng() % 5) * 0.25f : nd(rng);
      const __nv_bfloat16 b = __float2bfloat16(v);
      h[i] = *reinterpret_cast<const uint16_t*>(&b);
    }
    CK(cudaMemcpy(sc, h.data(), n * 2, cudaMemcpyHostToDevice));
    const char* name = dist == 0 ? "normal, std 0.7" : dist == 1 ? "normal, std 7" : dist == 2 ? "5 distinct values"
                     : dist == 3 ? "-inf past 60%" : "-inf past 300";
    // the whole launch: back to back (each waits for the one before), then one alone
    for (int w = 0; w < 5; ++w) CK(cudaError_t(dsv4_topk_bf16(sc, n, k, out, 1, st, 0)));
    CK(cudaEventRecord(e0, st));
    const int reps = 200;
    for (int r = 0; r < reps; ++r) CK(cudaError_t(dsv4_topk_bf16(sc, n, k, out, 1, st, 0)));
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    // the kernel before it, launched directly: its time and its output against this one's
    std::vector<int64_t> got(k), want(k);
    CK(cudaMemcpy(got.data(), out, k * 8, cudaMemcpyDeviceToHost));
    const int seg = ((n + CLUSTER - 1) / CLUSTER + 7) / 8 * 8;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(CLUSTER, 1); cfg.blockDim = dim3(1024); cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CLUSTER; attr[0].val.clusterDim.y = 1; attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr; cfg.numAttrs = 1;
    const uint16_t* csc = sc;
    CK(cudaLaunchKernelEx(&cfg, topk_bf16_cluster_kernel, csc, n, seg, k, out));
    CK(cudaEventRecord(e0, st));
    for (int r = 0; r < reps; ++r) CK(cudaLaunchKernelEx(&cfg, topk_bf16_cluster_kernel, csc, n, seg, k, out));
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
    float ms_old; CK(cudaEventElapsedTime(&ms_old, e0, e1));
    CK(cudaMemcpy(want.data(), out, k * 8, cudaMemcpyDeviceToHost));
    long long* mp = marks;
    CK(cudaMemcpyToSymbol(g_marks, &mp, sizeof(mp)));
    CK(cudaMemset(marks, 0, 8 * 16 * 8));
    std::vector<double> acc(10, 0.0);
    const int runs = 20;
    for (int r = 0; r < runs; ++r) {
      CK(cudaError_t(dsv4_topk_bf16(sc, n, k, out, 1, st, 0)));
      CK(cudaStreamSynchronize(st));
      std::vector<long long> m(8 * 16);
      CK(cudaMemcpy(m.data(), marks, m.size() * 8, cudaMemcpyDeviceToHost));
      for (int b = 0; b < 8; ++b)
        for (int i = 0; i < 10; ++i) acc[i] += double(m[b * 16 + i] - m[b * 16]) / 8 / runs;
    }
    long long* z = nullptr;
    CK(cudaMemcpyToSymbol(g_marks, &z, sizeof(z)));
    printf("%-18s back to back %.1f us each (the kernel before it: %.1f us, same output %s) | stages (us from the start, cluster mean):", name, ms * 1000 / reps, ms_old * 1000 / reps,
           got == want ? "yes" : "NO");
    const char* what[10] = {"start", "hist", "sync", "own", "slice", "hist2", "thr", "counts", "written", "end"};
    for (int i = 1; i < 10; ++i) printf(" %s %.2f", what[i], acc[i] / (clk / 1e3));
    printf("\n");
  }
  return 0;
}
