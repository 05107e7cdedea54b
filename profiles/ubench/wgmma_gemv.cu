// Microbenchmark (not part of the library): an FP8 (e4m3) GEMV y[N] = W[N, K] x[K] streamed through
// shared memory by cp.async into Hopper's wgmma (m64n8k32, e4m3 operands from shared memory, no
// per-element instructions), against a plain read of the same bytes. Question it answers: does a
// wgmma GEMV break the ~3 TB/s per-SM ceiling of our HMMA GEMVs (BENCHMARKS.md, "An L2 prefetch
// beside the latency-bound kernels": from L2 they are no faster)?
// Build and run: profiles/ubench/run.sh wgmma_gemv [lbo_k: 1, LBO = the K stride (right); 0, swapped]
// Weight scales per 128x128 block, activation scale per 128 (powers of two), x column 0 of B.
#include <cuda.h>
#include <cuda_runtime.h>
#include "ubench.cuh"
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>



__device__ __forceinline__ void cp16(void* s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(s)), "l"(g));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// no-swizzle K-major descriptor: start, lbo, sbo in bytes

__device__ __forceinline__ void wgmma_e4m3(float (&d)[4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(accumulate));
}

// One CTA = one warpgroup (128 threads). Tile = 64 rows x KS K-blocks of 128 (split K: KB / KS
// slices, partials atomically added: a microbenchmark, not deterministic). A stage = one K-block of
// the tile: 64 rows x 128 bytes = 8 KB, layout [row group 8][k chunk 8][row 8][16 B] (core
// matrices of 8 rows x 16 B). xs: x's e4m3 (column 0 of B; columns 1-7 zero), [kb][chunk 8][n 8][16 B].
template <int S>
__global__ void __launch_bounds__(128) wg_gemv(const uint8_t* __restrict__ W, const float* __restrict__ sw,
                                               const uint8_t* __restrict__ xq, const float* __restrict__ sx,
                                               float* __restrict__ y, int N, int K, int KS, int lbo_k) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int KB = K / 128, tid = threadIdx.x;
  uint8_t* xs = smem;                          // KB * 1024 bytes
  uint8_t* ring = smem + size_t(KB) * 1024;    // S * 8192 bytes
  for (int i = tid; i < KB * 64; i += 128) {   // 16-byte pieces of xs
    const int kb = i / 64, c = (i / 8) % 8, n = i % 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (n == 0) v = *reinterpret_cast<const uint4*>(xq + size_t(kb) * 128 + c * 16);
    *reinterpret_cast<uint4*>(xs + size_t(kb) * 1024 + c * 128 + n * 16) = v;
  }
  const int slices = KB / KS, tiles = (N / 64) * slices, G = gridDim.x;
  const int mine = tiles > (int)blockIdx.x ? (tiles - 1 - blockIdx.x) / G + 1 : 0;
  const int L = mine * KS;   // the CTA's K-blocks in order
  auto load = [&](int j) {
    if (j < L) {
      const int t = blockIdx.x + (j / KS) * G, kb = (t % slices) * KS + j % KS, r0 = (t / slices) * 64;
      uint8_t* st = ring + (j % S) * 8192;
#pragma unroll
      for (int p = 0; p < 4; ++p) {           // 512 pieces of 16 B, 4 a thread
        const int i = tid + p * 128, r = i / 8, c = i % 8;
        cp16(st + (r / 8) * 1024 + c * 128 + (r % 8) * 16, W + size_t(r0 + r) * K + kb * 128 + c * 16);
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int j = 0; j < S - 1; ++j) load(j);
  fence_async_smem();
  __syncthreads();
  const uint32_t lbo = lbo_k ? 128 : 1024, sbo = lbo_k ? 1024 : 128;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  float tot0 = 0.f, tot1 = 0.f;
  for (int j = 0; j < L; ++j) {
    const int tj = blockIdx.x + (j / KS) * G, kbj = (tj % slices) * KS + j % KS;
    const float f = sw[size_t((tj / slices) * 64 / 128) * KB + kbj] * sx[kbj];   // before the waits
    cp_wait<S - 2>();
    fence_async_smem();
    __syncthreads();          // stage j complete for all; stage j-1 free
    load(j + S - 1);
    const int t = blockIdx.x + (j / KS) * G, kb = (t % slices) * KS + j % KS, r0 = (t / slices) * 64;
    const uint32_t sa = smem_u32(ring + (j % S) * 8192), sb = smem_u32(xs + size_t(kb) * 1024);
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_e4m3(d, desc(sa + kk * 256, lbo, sbo), desc(sb + kk * 256, lbo, sbo), kk > 0);
    wg_commit();
    wg_wait0();
    asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
    tot0 = fmaf(d[0], f, tot0);   // column 0: lanes q == 0 (d[0] row g, d[2] row g + 8)
    tot1 = fmaf(d[2], f, tot1);
    if (j % KS == KS - 1) {
      if (q == 0) {
        const int r = r0 + warp * 16 + g;
        if (KS == KB) { y[r] = tot0; y[r + 8] = tot1; }
        else { atomicAdd(y + r, tot0); atomicAdd(y + r + 8, tot1); }
      }
      tot0 = tot1 = 0.f;
    }
  }
}

static float e4m3_to_f(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return s ? -v : v;
}
static uint8_t rand_e4m3(uint32_t& st) {
  for (;;) { st = st * 1664525u + 1013904223u; const uint8_t b = st >> 24; if ((b & 0x7F) != 0x7F) return b; }
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);   // a line at a time, also through a pipe
  const int lbo_k = argc > 1 ? atoi(argv[1]) : 1;
  cudaDeviceProp prop;
  const int sms = sm_count(prop);
  printf("%s, %d SMs; descriptor lbo = %s\n", prop.name, sms, lbo_k ? "K stride (128), sbo = M stride (1024)" : "M stride, sbo = K stride");
  struct Shape { int N, K; const char* name; };
  const Shape shapes[] = {{32768, 1024, "wq_b-like 32768 x 1024"}, {4096, 8192, "wo_b-like 4096 x 8192"},
                          {8192, 4096, "8192 x 4096"}};
  uint32_t* dummy; CK(cudaMalloc(&dummy, 4));
  for (const Shape& sh : shapes) {
    const int N = sh.N, K = sh.K, KB = K / 128, COPIES = 4;
    const size_t wbytes = size_t(N) * K;
    std::vector<uint8_t> hw(wbytes), hx(K);
    std::vector<float> hsw(size_t(N / 128) * KB), hsx(KB);
    uint32_t st = 12345;
    for (auto& b : hw) b = rand_e4m3(st);
    for (auto& b : hx) b = rand_e4m3(st);
    for (size_t i = 0; i < hsw.size(); ++i) hsw[i] = std::ldexp(1.0f, int(i % 7) - 3);
    for (int i = 0; i < KB; ++i) hsx[i] = std::ldexp(1.0f, (i % 5) - 2);
    std::vector<double> ref(N, 0.0), lut(256), xv(K);
    for (int b = 0; b < 256; ++b) lut[b] = e4m3_to_f(uint8_t(b));
    for (int k = 0; k < K; ++k) xv[k] = lut[hx[k]];
    for (int r = 0; r < N; ++r) {
      double s = 0;
      for (int kb = 0; kb < KB; ++kb) {
        double b = 0;
        for (int k = kb * 128; k < kb * 128 + 128; ++k) b += lut[hw[size_t(r) * K + k]] * xv[k];
        s += b * hsw[size_t(r / 128) * KB + kb] * hsx[kb];
      }
      ref[r] = s;
    }
    uint8_t *dw, *dx; float *dsw, *dsx, *dy;
    CK(cudaMalloc(&dw, wbytes * COPIES)); CK(cudaMalloc(&dx, K)); CK(cudaMalloc(&dsw, hsw.size() * 4));
    CK(cudaMalloc(&dsx, KB * 4)); CK(cudaMalloc(&dy, N * 4));
    for (int c = 0; c < COPIES; ++c) CK(cudaMemcpy(dw + c * wbytes, hw.data(), wbytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx, hx.data(), K, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsw, hsw.data(), hsw.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsx, hsx.data(), KB * 4, cudaMemcpyHostToDevice));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    const int REPS = 60;
    // the read alone
    float best_read = 1e9;
    for (int blocks : {sms * 2, sms * 4, sms * 8}) {
      CK(cudaEventRecord(e0));
      for (int i = 0; i < REPS; ++i) read_all<<<blocks, 512>>>(reinterpret_cast<const uint4*>(dw + (i % COPIES) * wbytes), wbytes / 16, dummy);
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best_read = std::min(best_read, ms * 1000 / REPS);
    }
    printf("%s: %.1f MB; read alone %.1f us (%.2f TB/s)\n", sh.name, wbytes / 1e6, best_read, wbytes / best_read / 1e6);
    constexpr int S = 4;
    for (int KS : {KB, std::max(1, KB / 2), std::max(1, KB / 4), std::max(1, KB / 8)}) {
      if (KB % KS) continue;
      const size_t smem = size_t(KB) * 1024 + S * 8192;
      CK(cudaFuncSetAttribute(wg_gemv<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      const int tiles = (N / 64) * (KB / KS);
      for (int cps : {1, 2, 3, 4}) {
        if (smem * cps > 227 * 1024) continue;
        const int grid = std::min(tiles, sms * cps);
        CK(cudaMemset(dy, 0, N * 4));
        wg_gemv<S><<<grid, 128, smem>>>(dw, dsw, dx, dsx, dy, N, K, KS, lbo_k);
        CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
        std::vector<float> hy(N);
        CK(cudaMemcpy(hy.data(), dy, N * 4, cudaMemcpyDeviceToHost));
        double maxerr = 0, maxref = 0;
        for (int r = 0; r < N; ++r) { maxerr = std::max(maxerr, std::fabs(hy[r] - ref[r])); maxref = std::max(maxref, std::fabs(ref[r])); }
        CK(cudaEventRecord(e0));
        for (int i = 0; i < REPS; ++i) {
          if (KS != KB) cudaMemsetAsync(dy, 0, N * 4);
          wg_gemv<S><<<grid, 128, smem>>>(dw + (i % COPIES) * wbytes, dsw, dx, dsx, dy, N, K, KS, lbo_k);
        }
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
        const float us = ms * 1000 / REPS;
        printf("  wgmma KS %2d (tiles %5d) grid %4d (%d a SM): %6.1f us (%.2f TB/s, %.0f%% of the read)  max err / max |y| %.2e\n",
               KS, tiles, grid, cps, us, wbytes / us / 1e6, 100 * best_read / us, maxerr / maxref);
      }
    }
    CK(cudaFree(dw)); CK(cudaFree(dx)); CK(cudaFree(dsw)); CK(cudaFree(dsx)); CK(cudaFree(dy));
  }
  return 0;
}
