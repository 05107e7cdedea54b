// Weights into L2 ahead of their GEMV (dsv4_l2_prefetch; its host side: dsv4/kernels/cuda/lib.py,
// its use: dsv4/backend/fused/prefetch.py). A captured decode step launches it on a side branch
// where the main branch runs latency-bound kernels (mHC, routing, attention) that leave the memory
// idle: the next weights stream into L2 meanwhile, and their GEMV reads them from there. A hint
// only: it writes nothing, reads nothing into registers, and changes no result.
#include "dsv4_api.h"
#include "dsv4_common.cuh"

namespace {

struct PrefetchRanges {
  const char* p[DSV4_PREFETCH_MAX];   // 16-byte aligned starts
  unsigned long long n[DSV4_PREFETCH_MAX];   // bytes, multiples of 16
  int count;
};

// Thread t of the grid takes pieces t, t + threads, ... of every range (pieces of `piece` bytes,
// the last one shorter): mode 0 as one bulk prefetch each (the copy engine, sm_90), mode 1 as a
// prefetch.global.L2 per 128-byte line.
__global__ void l2_prefetch_kernel(const PrefetchRanges r, unsigned piece, int mode) {
  const unsigned long long threads = unsigned(gridDim.x) * blockDim.x;
  const unsigned long long t = blockIdx.x * blockDim.x + threadIdx.x;
  for (int i = 0; i < r.count; ++i) {
    const unsigned long long pieces = (r.n[i] + piece - 1) / piece;
    for (unsigned long long j = t; j < pieces; j += threads) {
      const char* a = r.p[i] + j * piece;
      const unsigned size = unsigned(min(static_cast<unsigned long long>(piece), r.n[i] - j * piece));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (mode == 0) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(a), "r"(size) : "memory");
        continue;
      }
#endif
      for (unsigned o = 0; o < size; o += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a + o));
    }
  }
}

}  // namespace

extern "C" {

int dsv4_l2_prefetch(const void* const* ptrs, const unsigned long long* bytes, int count, int mode,
                     int ctas, int threads, int piece, void* stream) {
  if (count < 0 || count > DSV4_PREFETCH_MAX || mode < 0 || mode > 1 || ctas < 1 || threads < 32 ||
      threads > 1024 || piece < 128 || piece % 128)
    return -1;
  PrefetchRanges r = {};
  for (int i = 0; i < count; ++i) {
    const unsigned long long p = reinterpret_cast<unsigned long long>(ptrs[i]);
    const unsigned long long a = (p + 15) & ~15ull, e = (p + bytes[i]) & ~15ull;   // aligned inside
    r.p[r.count] = reinterpret_cast<const char*>(a);
    r.n[r.count] = e > a ? e - a : 0;
    r.count += e > a;
  }
  if (r.count == 0) return 0;
  return launch(l2_prefetch_kernel, dim3(ctas), dim3(threads), 0, static_cast<cudaStream_t>(stream),
                0, r, unsigned(piece), mode);
}

}  // extern "C"
