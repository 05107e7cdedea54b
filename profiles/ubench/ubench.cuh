// Shared pieces of the microbenchmarks in this folder (not part of the library): error check,
// 16-byte streaming loads, a plain read of the bytes (the yardstick), grid barriers, the wgmma
// helpers and the shared-memory descriptor (no swizzle: start, LBO = the K-direction stride, SBO =
// the M/N one); on the host, the GPU's name and SMs, and the timer of the chains.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ uint4 ldg_na(const void* p) {
  uint4 r;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// the bytes alone: each thread reads 16-byte pieces, grid-stride
__global__ void read_all(const uint4* __restrict__ p, size_t n, uint32_t* out) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = ldg_na(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

// spin until *p >= target (acquire at GPU scope)
__device__ __forceinline__ void spin_until(const unsigned* p, unsigned target) {
  unsigned v;
  do { asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(p)); } while (v < target);
}
// a grid barrier (every CTA resident), one thread a CTA after its CTA's barrier: count in, then
// wait for `target` arrivals; grid_wait counts in by red.release, grid_wait_atomic by a fence and
// atomicAdd (the two cost the same: BENCHMARKS.md, the twenty-first session)
__device__ __forceinline__ void grid_wait(unsigned* bar, unsigned target) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(bar) : "memory");
  spin_until(bar, target);
}
__device__ __forceinline__ void grid_wait_atomic(unsigned* bar, unsigned target) {
  __threadfence();
  atomicAdd(bar, 1u);
  spin_until(bar, target);
}

__device__ __forceinline__ uint64_t desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) | (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}
// c += A (16 x 16 f16, row) B (16 x 8 f16, col) in f32 (mma.sync m16n8k16: chain5, experts_ring)
__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// the current GPU: its properties (name) and SM count
inline int sm_count(cudaDeviceProp& prop) {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  return sms;
}

// n floats from the device
inline std::vector<float> fetch(const float* p, size_t n) {
  std::vector<float> h(n);
  CK(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return h;
}

// a launch config, with programmatic dependent launch (the kernel may start while the one before
// it ends) unless pdl is false; not copied (lc points into it)
struct Launch {
  cudaLaunchAttribute at[1];
  cudaLaunchConfig_t lc = {};
  Launch(dim3 grid, dim3 block, size_t smem, cudaStream_t st, bool pdl = true) {
    lc.gridDim = grid; lc.blockDim = block; lc.dynamicSmemBytes = smem; lc.stream = st;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    lc.attrs = at; lc.numAttrs = pdl ? 1 : 0;
  }
  Launch(const Launch&) = delete;
  template <typename... P, typename... A>
  void operator()(void (*kern)(P...), A... args) { CK(cudaLaunchKernelEx(&lc, kern, P(args)...)); }
};

// the chains' timer: launches on its own stream, REPS timed after WARM warm ones -> us a call
struct Timer {
  static constexpr int WARM = 5, REPS = 50;
  cudaStream_t st;
  cudaEvent_t e0, e1;
  uint32_t* dummy;
  Timer() {
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    CK(cudaMalloc(&dummy, 4));
  }
  template <typename F>   // fn(i): the i-th call's launches on st
  float time(F&& fn) {
    for (int i = 0; i < WARM; ++i) fn(i);
    CK(cudaStreamSynchronize(st));
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < REPS; ++i) fn(i);
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); return ms * 1000 / REPS;
  }
  // a plain read of `bytes` at base + (i % copies) * stride, the fastest of 2, 4, 8 CTAs an SM
  float read(const void* base, size_t bytes, int copies, size_t stride, int sms) {
    float best = 1e9f;
    for (int b : {sms * 2, sms * 4, sms * 8})
      best = std::min(best, time([&](int i) {
        read_all<<<b, 512, 0, st>>>(reinterpret_cast<const uint4*>(static_cast<const char*>(base) + (i % copies) * stride),
                                   bytes / 16, dummy);
      }));
    return best;
  }
};
