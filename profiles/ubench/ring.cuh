// The persistent chains' pieces (chain3.cu, chain4.cu, chain5.cu): mbarriers, a bulk copy (TMA,
// 1-D) into shared memory that completes on an mbarrier, a bulk prefetch into L2, the consumer warps' named barrier, and the ring of
// row slots a producer warp fills and consumer warps drain.
#pragma once
#include "ubench.cuh"

__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(b)) : "memory");
}
// one bulk prefetch of [p, p + bytes) into L2 (the copy engine; p 16-byte aligned, bytes a multiple of 16)
__device__ __forceinline__ void l2_bulk_prefetch(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}
template <int CONS> __device__ __forceinline__ void cons_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(CONS * 32) : "memory"); }

// dynamic shared memory as xs [K] f32 | ring [nbuf][rowb] | full [nbuf] | empty [nbuf]: slot
// use t (the CTA's t-th row) is slot t % nbuf, its (t / nbuf)-th use. Consumers that take uses t
// == their warp (mod CONS) need nbuf a multiple of CONS for `wait`: an mbarrier's parity wait
// cannot tell use k from k - 2, and then the use before a slot's k-th was the same warp's. Any
// nbuf >= CONS takes `wait_after` (the slot's use before released first, then the parity wait).
struct Ring {
  float* xs;
  unsigned char* rows;
  uint64_t* full;
  uint64_t* empty;
  size_t rowb;
  int nbuf;
  // the producer: wait until use t's slot is free -> the slot
  __device__ __forceinline__ int acquire(int t) {
    const int slot = t % nbuf;
    mbar_wait(&empty[slot], ((t / nbuf) & 1) ^ 1);
    return slot;
  }
  // the producer: copy rowb bytes from src into the slot
  __device__ __forceinline__ void fill(int slot, const void* src) {
    mbar_expect(&full[slot], unsigned(rowb));
    bulk_g2s(rows + slot * rowb, src, unsigned(rowb), &full[slot]);
  }
  // a consumer: wait for use t's row -> the slot
  __device__ __forceinline__ int wait(int t) {
    const int slot = t % nbuf;
    mbar_wait(&full[slot], (t / nbuf) & 1);
    return slot;
  }
  // a consumer whose use t - nbuf may have been another warp's (nbuf >= CONS, not a multiple):
  // wait until use t - nbuf was released (as acquire does; released uses of the slot are then t /
  // nbuf - 1 or t / nbuf), then for use t's row (fills completed t / nbuf or t / nbuf + 1) -> the
  // slot. The full wait alone would pass on t - nbuf's copy still landing (the same parity)
  __device__ __forceinline__ int wait_after(int t) {
    const int slot = t % nbuf;
    mbar_wait(&empty[slot], ((t / nbuf) & 1) ^ 1);
    mbar_wait(&full[slot], (t / nbuf) & 1);
    return slot;
  }
  __device__ __forceinline__ const void* row(int slot) const { return rows + slot * rowb; }
  // a consumer's lane 0: the slot is free again
  __device__ __forceinline__ void release(int slot) { mbar_arrive(&empty[slot]); }
};

// every thread: the ring carved from sm (K floats of xs first) with its mbarriers initialized
// (empty: `readers` arrivals free a slot)
__device__ __forceinline__ Ring ring_init(unsigned char* sm, int K, size_t rowb, int nbuf, unsigned readers = 1) {
  Ring g;
  g.xs = reinterpret_cast<float*>(sm);
  g.rows = sm + size_t(K) * 4;
  g.full = reinterpret_cast<uint64_t*>(g.rows + rowb * nbuf);
  g.empty = g.full + nbuf;
  g.rowb = rowb;
  g.nbuf = nbuf;
  if (threadIdx.x == 0) {
    for (int j = 0; j < nbuf; ++j) { mbar_init(&g.full[j], 1); mbar_init(&g.empty[j], readers); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  return g;
}

// the first nthreads threads: xs [K] = x (from L2: written by other CTAs)
__device__ __forceinline__ void load_xs(const float* x, float* xs, int K, int nthreads) {
  for (int i = threadIdx.x; i < K; i += nthreads) xs[i] = __ldcg(x + i);
}

// this CTA's rows [r0, r1) of N, split evenly over the grid
__device__ __forceinline__ void even_rows(int N, int& r0, int& r1) {
  r0 = int((long long)blockIdx.x * N / gridDim.x);
  r1 = int((long long)(blockIdx.x + 1) * N / gridDim.x);
}
