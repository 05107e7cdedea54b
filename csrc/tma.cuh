// sm_90's asynchronous pieces shared by the ring kernels (fp4_down.cu, fp4_up_wg.cu): mbarriers,
// the bulk copies of the SM's copy engine (TMA: 1-D, and 2-D through a tensor map) that complete
// on an mbarrier, and Hopper's warpgroup MMA (wgmma, sm_90a only) with its shared-memory
// descriptor. Internal linkage, as dsv4_common.cuh.
#pragma once

#include <cuda.h>   // CUtensorMap

#include "dsv4_common.cuh"

namespace {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
DEV uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
DEV void mbar_init(uint64_t* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(n) : "memory");
}
DEV void mbar_wait(uint64_t* b, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(b)), "r"(parity) : "memory");
}
DEV void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
DEV void mbar_expect(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes)
               : "memory");
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global into shared memory by the
// copy engine of the SM (TMA, 1-D), completing on mbarrier b
DEV void bulk_g2s(void* dst, const void* src, unsigned bytes, uint64_t* b) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(b))
      : "memory");
}
// one box of the 2-D tensor map m (a kernel parameter, __grid_constant__) at coordinates (c0 the
// inner, c1 the outer) into shared memory (dst 128-byte aligned), completing on mbarrier b; a box
// past the tensor's end reads zeros
DEV void tma_2d(void* dst, const CUtensorMap* m, int c0, int c1, uint64_t* b) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(m), "r"(c0), "r"(c1), "r"(smem_u32(b))
      : "memory");
}
DEV void tma_prefetch_map(const CUtensorMap* m) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(m) : "memory");
}
// the generic proxy's writes to shared memory made visible to the async proxy (wgmma's operand
// reads); each writing thread, before the barrier that orders them
DEV void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
DEV void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEV void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
DEV void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
DEV void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// a shared-memory matrix descriptor without swizzle: start, LBO (the K-direction stride between
// core matrices of 8 rows x 16 bytes) and SBO (the M / N-direction one), in bytes
DEV uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}
// d (64 x 8 float32, the warpgroup's fragment) (+)= A (64 x 32 e4m3 from registers: a0 / a2 row g
// K 4q .. 4q + 3 / 16 + 4q .., a1 / a3 the same of row g + 8) x B (32 x 8 e4m3, descriptor db);
// acc 0: d = A B
DEV void wgmma_e4m3_rs(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t db,
                       int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(acc));
}
#endif

}  // namespace
