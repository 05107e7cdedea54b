// Weights into L2 ahead of their GEMV (dsv4_l2_prefetch; its host side: dsv4/kernels/cuda/lib.py,
// its use: dsv4/backend/fused/prefetch.py). A captured decode step launches it on a side branch
// where the main branch runs latency-bound kernels (mHC, routing, attention) that leave the memory
// idle: the next weights stream into L2 meanwhile, and their GEMV reads them from there. A hint
// only: it writes nothing, reads nothing into registers, and changes no result.
// dsv4_read_bytes, beside it: a plain streaming read of one range, the bound a weight-streaming
// kernel of that many bytes meets (dsv4.bench.layer_kernels: each op against a read of its bytes).
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
        l2_bulk_prefetch(a, size);
        continue;
      }
#endif
      for (unsigned o = 0; o < size; o += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(a + o));
    }
  }
}

// Every 16-byte word of p[0, n16) read once (weights' loads: ld_stream), four in flight a
// thread; their XOR per CTA into sink[blockIdx.x] (so the reads have a use, and a test can check
// that each word was read exactly once).
__global__ void __launch_bounds__(1024) read_bytes_kernel(const uint4* p, unsigned long long n16,
                                                          uint4* sink) {
  const unsigned long long threads = unsigned(gridDim.x) * blockDim.x;
  unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x;
  uint4 acc = make_uint4(0u, 0u, 0u, 0u);
  auto mix = [&acc](const uint4 v) {
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
  };
  for (; i + 3 * threads < n16; i += 4 * threads) {
    const uint4 a = ld_stream(p + i), b = ld_stream(p + i + threads);
    const uint4 c = ld_stream(p + i + 2 * threads), d = ld_stream(p + i + 3 * threads);
    mix(a);
    mix(b);
    mix(c);
    mix(d);
  }
  for (; i < n16; i += threads) mix(ld_stream(p + i));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    acc.x ^= __shfl_xor_sync(FULL, acc.x, o);
    acc.y ^= __shfl_xor_sync(FULL, acc.y, o);
    acc.z ^= __shfl_xor_sync(FULL, acc.z, o);
    acc.w ^= __shfl_xor_sync(FULL, acc.w, o);
  }
  __shared__ uint4 warps[32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint4 t = warps[0];
    for (unsigned w = 1; w < blockDim.x / 32; ++w) {
      t.x ^= warps[w].x;
      t.y ^= warps[w].y;
      t.z ^= warps[w].z;
      t.w ^= warps[w].w;
    }
    sink[blockIdx.x] = t;
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

int dsv4_read_bytes(const void* p, unsigned long long nbytes, void* sink, int ctas, int threads,
                    void* stream) {
  if (p == nullptr || sink == nullptr || reinterpret_cast<unsigned long long>(p) % 16 ||
      nbytes % 16 || ctas < 1 || threads < 32 || threads > 1024 || threads % 32)
    return -1;
  return launch(read_bytes_kernel, dim3(ctas), dim3(threads), 0, static_cast<cudaStream_t>(stream),
                0, static_cast<const uint4*>(p), nbytes / 16, static_cast<uint4*>(sink));
}

}  // extern "C"
