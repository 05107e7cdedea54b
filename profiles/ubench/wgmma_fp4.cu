// Microbenchmark (not part of the library): the routed experts' FP4 (e2m1, per-32 e8m0 scales)
// GEMV on Hopper's wgmma, A (the weights) from registers as e4m3 after the e2m1 decode (no cvt, one
// wgmma per 64 rows x 32 K of a warpgroup), B (the act-quantized e4m3 activation) from shared
// memory with the column trick of csrc/fp4_experts.cuh (column n carries scale group n). 24,576 x
// 4,096 FP4 rows = 6 experts x (w1, w3) x 2,048: the bytes of Flash's routed up (53.5 MB with
// scales). Compare with bench_kernels' experts.up (~20 us on 132 CTAs, ~25 on 100, one H200).
// Build and run: profiles/ubench/run.sh wgmma_fp4 (the descriptor reading of wgmma_gemv's lbo_k 1).
// wg_fp4: a warpgroup a CTA, each block's wgmmas waited for; wg_fp4_multi: 2-4 warpgroups a
// CTA, a block's wgmmas in flight while the next is decoded; wg_fp4_ring: the same consumers fed
// from shared memory by a producer warp's bulk copies of units packed at load (one CTA an SM).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include "ring.cuh"
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>
#include <string>


__device__ __forceinline__ void wgmma_ra(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(acc));
}
__device__ __forceinline__ uint32_t ldg_u32(const void* p) {
  uint32_t r;
  asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];\n" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
  hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}
__device__ __forceinline__ float e8m0(uint32_t b) { return __uint_as_float((b & 0xFFu) << 23); }

// A lane's operands of one 128-block from its 16 bytes of rows g (A) and g + 8 (B): la / lb the
// even elements, ha / hb the odd ones, as e4m3 (word kk feeds wgmma kk).
__device__ __forceinline__ void decode_block(const uint4& A, const uint4& B, uint32_t (&la)[4], uint32_t (&ha)[4],
                                             uint32_t (&lb)[4], uint32_t (&hb)[4]) {
  e2m1x8_to_e4m3(A.x, la[0], ha[0]); e2m1x8_to_e4m3(B.x, lb[0], hb[0]);
  e2m1x8_to_e4m3(A.y, la[1], ha[1]); e2m1x8_to_e4m3(B.y, lb[1], hb[1]);
  e2m1x8_to_e4m3(A.z, la[2], ha[2]); e2m1x8_to_e4m3(B.z, lb[2], hb[2]);
  e2m1x8_to_e4m3(A.w, la[3], ha[3]); e2m1x8_to_e4m3(B.w, lb[3], hb[3]);
}

// DEPTH 128-blocks of a lane's weights in flight in registers (wg_fp4, wg_fp4_multi): block j of
// the lane's chain in slot j % DEPTH, its 16 bytes of rows r and r + 8 (wa / wb) and, for lanes q
// < 2, their scale words (groups 4kb .. 4kb + 3; ka / kb8).
template <int DEPTH> struct LaneBlocks {
  uint4 wa[DEPTH], wb[DEPTH];
  uint32_t ka[DEPTH], kb8[DEPTH];
  __device__ __forceinline__ void load(int slot, const uint8_t* W, const uint8_t* S, size_t r, int kb, int q, size_t wrow,
                                       size_t srow) {
    const uint8_t* p = W + r * wrow + kb * 64 + q * 16;
    wa[slot] = ldg_na(p);
    wb[slot] = ldg_na(p + 8 * wrow);
    const uint8_t* sp = S + r * srow + kb * 4;
    ka[slot] = q < 2 ? ldg_u32(sp) : 0u;
    kb8[slot] = q < 2 ? ldg_u32(sp + 8 * srow) : 0u;
  }
};

// t0 / t1 (rows g, g + 8) += a block's column sums d, scaled by f (the activation block's scale
// and the decode's 2^6) and, lanes q < 2 (columns 2q, 2q + 1 = groups 4kb + 2q, + 1), by the rows'
// group scales sa / sb
__device__ __forceinline__ void scale_add(float& t0, float& t1, const float (&d)[4], uint32_t sa, uint32_t sb, float f,
                                          int q) {
  const int sh = 16 * (q & 1);
  t0 += (d[0] * e8m0(sa >> sh) + d[1] * e8m0(sa >> (sh + 8))) * f;
  t1 += (d[2] * e8m0(sb >> sh) + d[3] * e8m0(sb >> (sh + 8))) * f;
}

// One CTA = one warpgroup; tile = 64 rows x all K; warp w rows 16w..16w+15; lane (g, q) loads
// the 16 bytes of group q of each 128-block for rows g and g + 8 (4 words: word kk feeds wgmma kk).
// DEPTH 128-blocks of weights in flight in registers. xs: B for every 128-block (1 KB each).
template <int DEPTH>
__global__ void __launch_bounds__(128) wg_fp4(const uint8_t* __restrict__ W, const uint8_t* __restrict__ S,
                                              const uint8_t* __restrict__ xsg, const float* __restrict__ sx,
                                              float* __restrict__ y, int N, int K, int lbo_k) {
  extern __shared__ __align__(1024) uint8_t xs[];
  const int KB = K / 128, tid = threadIdx.x;
  for (int i = tid; i < KB * 64; i += 128) reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(xsg)[i];
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  const int tiles = N / 64, G = gridDim.x;
  const int mine = tiles > (int)blockIdx.x ? (tiles - 1 - blockIdx.x) / G + 1 : 0;
  const int L = mine * KB;
  const size_t wrow = size_t(K) / 2, srow = size_t(K) / 32;
  LaneBlocks<DEPTH> lb8;
  auto rows = [&](int j) { return size_t(blockIdx.x + (j / KB) * G) * 64 + warp * 16 + g; };
  auto load = [&](int j) {
    if (j < L) lb8.load(j % DEPTH, W, S, rows(j), j % KB, q, wrow, srow);
  };
#pragma unroll
  for (int j = 0; j < DEPTH; ++j) load(j);
  const uint32_t lbo = lbo_k ? 128 : 256, sbo = lbo_k ? 256 : 128;
  const uint32_t xb = smem_u32(xs);
  float t0 = 0.f, t1 = 0.f;
#pragma unroll 1
  for (int j0 = 0; j0 < L; j0 += DEPTH) {
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) {
      const int j = j0 + u;
      if (j >= L) break;
      const int kb = j % KB;
      const size_t r = rows(j);
      const uint32_t sa = lb8.ka[u], sb = lb8.kb8[u];
      uint32_t la[4], ha[4], lb[4], hb[4];
      decode_block(lb8.wa[u], lb8.wb[u], la, ha, lb, hb);
      load(j + DEPTH);   // the registers of block u are decoded: refill them
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)   // the operands computed before the fence (CUTLASS's warpgroup_fence_operand)
        asm volatile("" : "+r"(la[kk]), "+r"(lb[kk]), "+r"(ha[kk]), "+r"(hb[kk])::"memory");
      asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_ra(d, la[kk], lb[kk], ha[kk], hb[kk], desc(xb + kb * 1024 + kk * 256, lbo, sbo), kk > 0);
      wg_commit();
      wg_wait0();
      asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
      scale_add(t0, t1, d, sa, sb, sx[kb] * 64.0f, q);   // the e2m1 -> e4m3 decode leaves out 2^6
      if (kb == KB - 1) {
        const float s0 = t0 + __shfl_xor_sync(0xffffffffu, t0, 1), s1 = t1 + __shfl_xor_sync(0xffffffffu, t1, 1);
        if (q == 0) { y[r] = s0; y[r + 8] = s1; }
        t0 = t1 = 0.f;
      }
    }
  }
}

__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// wg_fp4 with WGS warpgroups a CTA, each taking its own 64-row tiles (warpgroup w of CTA b: tiles
// b * WGS + w, then every gridDim.x * WGS), and a block's wgmmas in flight while the next block is
// decoded and issued: two accumulators and two sets of A registers alternate (block u of a group
// uses set u & 1), and wait_group 1 retires block u - 1, whose column sums are then scaled. The
// DEPTH blocks of a group are unrolled (every register index fixed) and the group ends with
// wait_group 0, so no wgmma is in flight across the loop's back edge and none sits in a branch.
template <int DEPTH, int WGS>
__global__ void __launch_bounds__(128 * WGS) wg_fp4_multi(const uint8_t* __restrict__ W, const uint8_t* __restrict__ S,
                                                         const uint8_t* __restrict__ xsg, const float* __restrict__ sx,
                                                         float* __restrict__ y, int N, int K, int lbo_k) {
  static_assert(DEPTH % 2 == 0, "blocks alternate between two register sets");
  extern __shared__ __align__(1024) uint8_t xs[];
  const int KB = K / 128, tid = threadIdx.x;   // KB % DEPTH == 0 (the host checks)
  for (int i = tid; i < KB * 64; i += 128 * WGS) reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(xsg)[i];
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int t = tid % 128, warp = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
  const int tiles = N / 64, G = gridDim.x * WGS, me = blockIdx.x * WGS + tid / 128;
  const int mine = tiles > me ? (tiles - 1 - me) / G + 1 : 0;
  const int L = mine * KB;
  const size_t wrow = size_t(K) / 2, srow = size_t(K) / 32;
  LaneBlocks<DEPTH> lb8;
  auto rows = [&](int j) { return size_t(me + (j / KB) * G) * 64 + warp * 16 + g; };
  auto load = [&](int j) {
    if (j < L) lb8.load(j % DEPTH, W, S, rows(j), j % KB, q, wrow, srow);
  };
#pragma unroll
  for (int j = 0; j < DEPTH; ++j) load(j);
  const uint32_t lbo = lbo_k ? 128 : 256, sbo = lbo_k ? 256 : 128;
  const uint32_t xb = smem_u32(xs);
  float t0 = 0.f, t1 = 0.f;
  float d[2][4];
  uint32_t la[2][4], ha[2][4], lb[2][4], hb[2][4], sa[2], sb[2];
  auto finish = [&](int j, const float (&dd)[4], uint32_t sa_, uint32_t sb_) {
    const int kb = j % KB;
    scale_add(t0, t1, dd, sa_, sb_, sx[kb] * 64.0f, q);
    if (kb == KB - 1) {
      const float s0 = t0 + __shfl_xor_sync(0xffffffffu, t0, 1), s1 = t1 + __shfl_xor_sync(0xffffffffu, t1, 1);
      const size_t r = rows(j);
      if (q == 0) { y[r] = s0; y[r + 8] = s1; }
      t0 = t1 = 0.f;
    }
  };
#pragma unroll 1
  for (int j0 = 0; j0 < L; j0 += DEPTH) {
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) {
      const int s = u & 1;
      decode_block(lb8.wa[u], lb8.wb[u], la[s], ha[s], lb[s], hb[s]);
      sa[s] = lb8.ka[u];
      sb[s] = lb8.kb8[u];
      load(j0 + u + DEPTH);   // block u's registers are decoded (and its scales kept): refill them
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        asm volatile("" : "+r"(la[s][kk]), "+r"(lb[s][kk]), "+r"(ha[s][kk]), "+r"(hb[s][kk])::"memory");
      asm volatile("" : "+f"(d[s][0]), "+f"(d[s][1]), "+f"(d[s][2]), "+f"(d[s][3])::"memory");
      wg_fence();
      const int kb = (j0 + u) % KB;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_ra(d[s], la[s][kk], lb[s][kk], ha[s][kk], hb[s][kk], desc(xb + kb * 1024 + kk * 256, lbo, sbo), kk > 0);
      wg_commit();
      if (u > 0) {
        wg_wait1();   // block u - 1 retired; block u still in flight
        asm volatile("" : "+f"(d[s ^ 1][0]), "+f"(d[s ^ 1][1]), "+f"(d[s ^ 1][2]), "+f"(d[s ^ 1][3])::"memory");
        finish(j0 + u - 1, d[s ^ 1], sa[s ^ 1], sb[s ^ 1]);
      }
    }
    wg_wait0();
    constexpr int s = (DEPTH - 1) & 1;
    asm volatile("" : "+f"(d[s][0]), "+f"(d[s][1]), "+f"(d[s][2]), "+f"(d[s][3])::"memory");
    finish(j0 + DEPTH - 1, d[s], sa[s], sb[s]);
  }
}

// wg_fp4_multi's consumers fed through shared memory: one CTA an SM, WGS consumer warpgroups, each
// with a producer warp (after the consumers; lane 0 works) and a ring of NBUF slots of its own. A
// unit = 64 rows (a tile) x KC columns, packed at load in the order the consumers read it, so one
// bulk copy brings its weights and one its scales: weights [block][warp][lane][row g / g + 8] 16
// bytes (a lane's 16 bytes of the block, as wg_fp4 loads them), scales [block][warp][g / g + 8][g]
// the row's 4 group bytes of the block. Warpgroup me of the grid takes units [me U / G, (me + 1) U /
// G) in tile-major order (U = N / 64 * K / KC, G warpgroups): even shares, split K where a share
// starts or ends inside a tile, its rows' sums added into y (zeroed first; float atomics, so the
// order of a split tile's two adds may vary: a timing ubench). A slot is released once its last
// block is read into registers. MODE (RING_PACKED above) RING_ROWS: the weights in the
// checkpoint's row-major layout instead (no packing): the producer warp's lanes copy each of the
// unit's 64 rows (KC / 2 bytes, and its KC / 32 scale bytes) on their own, into slot rows padded
// to RS bytes (RS % 128 == 64: a quarter-warp's 16-byte reads fall on distinct banks). RING_TMA:
// the checkpoint's layout through 2-D tensor copies (tw, ts: tensor maps of the weights [N, K / 2]
// and the scales [N, K / 32] bytes, boxes of 64 rows x KC / 2 and KC / 32), one copy a unit for
// each, into dense slot rows (RS = KC / 2, no swizzle: two-way bank conflicts).
enum { RING_PACKED = 0, RING_ROWS = 1, RING_TMA = 2 };
template <int KC, int MODE> struct RingUnit {
  static constexpr int RS = MODE == RING_ROWS ? KC / 2 + 64 : MODE == RING_TMA ? KC / 2 : 0;
  static constexpr int WB = MODE == RING_PACKED ? 32 * KC : 64 * RS, SB = 2 * KC, UB = WB + SB;
};
__device__ __forceinline__ void tma2d(void* dst, const CUtensorMap* m, int c0, int c1, uint64_t* bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
               ::"r"(smem_u32(dst)), "l"(m), "r"(c0), "r"(c1), "r"(smem_u32(bar)) : "memory");
}
template <int WGS, int NBUF, int KC, int MODE = RING_PACKED>
__global__ void __launch_bounds__(WGS * 160, 1) wg_fp4_ring(const uint8_t* __restrict__ Wp, const uint8_t* __restrict__ Sp,
                                                           const uint8_t* __restrict__ xsg, const float* __restrict__ sx,
                                                           float* __restrict__ y, int N, int K, int lbo_k,
                                                           const __grid_constant__ CUtensorMap tw,
                                                           const __grid_constant__ CUtensorMap ts) {
  static_assert(MODE == RING_PACKED || KC >= 512, "a row's scales of a unit: at least a 16-byte copy");
  constexpr int BPU = KC / 128, RS = RingUnit<KC, MODE>::RS, WB = RingUnit<KC, MODE>::WB;
  constexpr int SB = RingUnit<KC, MODE>::SB, UB = RingUnit<KC, MODE>::UB;
  extern __shared__ __align__(1024) uint8_t sm[];
  const int KB = K / 128, tid = threadIdx.x;
  uint8_t* xs = sm;
  uint8_t* slots = sm + size_t(KB) * 1024;
  uint64_t* bars = reinterpret_cast<uint64_t*>(slots + size_t(WGS) * NBUF * UB);   // full, then empty
  if (tid == 0) {
    for (int j = 0; j < WGS * NBUF; ++j) { mbar_init(&bars[j], 1); mbar_init(&bars[WGS * NBUF + j], 4); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid < WGS * 128) {   // the consumers load B while the producers start their copies
    for (int i = tid; i < KB * 64; i += WGS * 128) reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(xsg)[i];
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync 1, %0;\n" ::"r"(WGS * 128) : "memory");
  }
  const bool producer = tid >= WGS * 128;
  const int wgi = producer ? (tid - WGS * 128) / 32 : tid / 128;
  const int CPT = K / KC, U = (N / 64) * CPT, G = gridDim.x * WGS, me = blockIdx.x * WGS + wgi;
  const int u0 = int((long long)me * U / G), u1 = int((long long)(me + 1) * U / G);
  uint64_t* full = bars + wgi * NBUF;
  uint64_t* empty = bars + WGS * NBUF + wgi * NBUF;
  uint8_t* ring = slots + size_t(wgi) * NBUF * UB;
  if (producer) {
    const int pl = tid & 31;
    for (int u = u0, t = 0; u < u1; ++u, ++t) {
      const int s = t % NBUF;
      if (MODE == RING_PACKED) {
        if (pl == 0) {
          mbar_wait(&empty[s], ((t / NBUF) & 1) ^ 1);
          mbar_expect(&full[s], UB);
          bulk_g2s(ring + s * UB, Wp + size_t(u) * WB, WB, &full[s]);
          bulk_g2s(ring + s * UB + WB, Sp + size_t(u) * SB, SB, &full[s]);
        }
        continue;
      }
      if (MODE == RING_TMA) {
        if (pl == 0) {
          mbar_wait(&empty[s], ((t / NBUF) & 1) ^ 1);
          mbar_expect(&full[s], UB);
          tma2d(ring + s * UB, &tw, (u % CPT) * (KC / 2), (u / CPT) * 64, &full[s]);
          tma2d(ring + s * UB + WB, &ts, (u % CPT) * (KC / 32), (u / CPT) * 64, &full[s]);
        }
        continue;
      }
      if (pl == 0) {   // the slot free, and the bytes to come counted before any copy lands
        mbar_wait(&empty[s], ((t / NBUF) & 1) ^ 1);
        mbar_expect(&full[s], 64 * (KC / 2 + KC / 32));
      }
      __syncwarp();
      const int tile = u / CPT, c = u % CPT;
      for (int r = pl; r < 64; r += 32) {
        const size_t row = size_t(tile) * 64 + r;
        bulk_g2s(ring + s * UB + r * RS, Wp + row * (K / 2) + c * (KC / 2), KC / 2, &full[s]);
        bulk_g2s(ring + s * UB + WB + r * (KC / 32), Sp + row * (K / 32) + c * (KC / 32), KC / 32, &full[s]);
      }
    }
    return;
  }
  const int t = tid % 128, warp = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
  const uint32_t lbo = lbo_k ? 128 : 256, sbo = lbo_k ? 256 : 128;
  const uint32_t xb = smem_u32(xs);
  float t0 = 0.f, t1 = 0.f;
  float d[2][4];
  uint32_t la[2][4], ha[2][4], lb[2][4], hb[2][4], sa[2], sb[2];
  auto finish = [&](int kb, const float (&dd)[4], uint32_t sa_, uint32_t sb_) {
    scale_add(t0, t1, dd, sa_, sb_, sx[kb] * 64.0f, q);
  };
  auto flush = [&](int tile) {
    const float s0 = t0 + __shfl_xor_sync(0xffffffffu, t0, 1), s1 = t1 + __shfl_xor_sync(0xffffffffu, t1, 1);
    const size_t r = size_t(tile) * 64 + warp * 16 + g;
    if (q == 0) { atomicAdd(y + r, s0); atomicAdd(y + r + 8, s1); }
    t0 = t1 = 0.f;
  };
  int cur = u0 < u1 ? u0 / CPT : -1;
#pragma unroll 1
  for (int u = u0, tt = 0; u < u1; ++u, ++tt) {
    const int tile = u / CPT, c = u % CPT, s = tt % NBUF;
    if (tile != cur) { flush(cur); cur = tile; }
    mbar_wait(&full[s], (tt / NBUF) & 1);
    const uint8_t* slot = ring + s * UB;
#pragma unroll
    for (int blk = 0; blk < BPU; ++blk) {
      const int p = blk & 1;
      uint4 A, B;
      if (MODE != RING_PACKED) {   // rows 16 warp + g and + 8, the block's 64 bytes, the lane's 16
        const uint8_t* wr = slot + (warp * 16 + g) * RS + blk * 64 + q * 16;
        A = *reinterpret_cast<const uint4*>(wr);
        B = *reinterpret_cast<const uint4*>(wr + 8 * RS);
        const uint8_t* sr = slot + WB + (warp * 16 + g) * (KC / 32) + blk * 4;
        sa[p] = q < 2 ? *reinterpret_cast<const uint32_t*>(sr) : 0u;
        sb[p] = q < 2 ? *reinterpret_cast<const uint32_t*>(sr + 8 * (KC / 32)) : 0u;
      } else {
        const uint4* wp = reinterpret_cast<const uint4*>(slot) + ((blk * 4 + warp) * 32 + lane) * 2;
        A = wp[0];
        B = wp[1];
        const uint32_t* sp = reinterpret_cast<const uint32_t*>(slot + WB) + (blk * 4 + warp) * 16;
        sa[p] = q < 2 ? sp[g] : 0u;
        sb[p] = q < 2 ? sp[8 + g] : 0u;
      }
      decode_block(A, B, la[p], ha[p], lb[p], hb[p]);
      if (blk == BPU - 1) {   // the unit is in registers: its slot is free
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        asm volatile("" : "+r"(la[p][kk]), "+r"(lb[p][kk]), "+r"(ha[p][kk]), "+r"(hb[p][kk])::"memory");
      asm volatile("" : "+f"(d[p][0]), "+f"(d[p][1]), "+f"(d[p][2]), "+f"(d[p][3])::"memory");
      wg_fence();
      const int kb = c * BPU + blk;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_ra(d[p], la[p][kk], lb[p][kk], ha[p][kk], hb[p][kk], desc(xb + kb * 1024 + kk * 256, lbo, sbo), kk > 0);
      wg_commit();
      if (blk > 0) {
        wg_wait1();
        asm volatile("" : "+f"(d[p ^ 1][0]), "+f"(d[p ^ 1][1]), "+f"(d[p ^ 1][2]), "+f"(d[p ^ 1][3])::"memory");
        finish(kb - 1, d[p ^ 1], sa[p ^ 1], sb[p ^ 1]);
      }
    }
    wg_wait0();
    constexpr int pl = (BPU - 1) & 1;
    asm volatile("" : "+f"(d[pl][0]), "+f"(d[pl][1]), "+f"(d[pl][2]), "+f"(d[pl][3])::"memory");
    finish(c * BPU + BPU - 1, d[pl], sa[pl], sb[pl]);
  }
  if (cur >= 0) flush(cur);
}

static double e4m3_val(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}
static double e2m1_val(int c) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (c & 8) ? -mag[c & 7] : mag[c & 7];
}

// One launch checked against the float64 reference (its first `rows` outputs; dy filled with the
// byte `fill` first: 0xFF, NaN, fails a row the kernel does not write; 0 for kernels that add into
// y), then REPS launches timed, launch(c) reading copy c of the weights (rotated: L2 holds none of
// the next one's) -> us a launch; max |error| / max |y| into err.
template <typename Launch>
static float check_and_time(Launch launch, float* dy, int rows, int fill, const std::vector<double>& ref, int copies,
                            double& err) {
  CK(cudaMemset(dy, fill, size_t(rows) * 4));
  launch(0);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  std::vector<float> hy(rows);
  CK(cudaMemcpy(hy.data(), dy, size_t(rows) * 4, cudaMemcpyDeviceToHost));
  double maxerr = 0, maxref = 0;
  for (int r = 0; r < rows; ++r) {
    const double e = std::fabs(hy[r] - ref[r]);
    maxerr = std::max(maxerr, e == e ? e : INFINITY);
    maxref = std::max(maxref, std::fabs(ref[r]));
  }
  err = maxerr / maxref;
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  const int REPS = 60;
  CK(cudaEventRecord(e0));
  for (int i = 0; i < REPS; ++i) launch(i % copies);
  CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
  float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
  return ms * 1000 / REPS;
}

template <int D>
static void run(const char* tag, int grid, uint8_t* dw, uint8_t* ds, uint8_t* dxs, float* dsx, float* dy, int N, int K,
                size_t wbytes, size_t sbytes, int copies, int lbo_k, const std::vector<double>& ref, float read_us) {
  const size_t smem = size_t(K / 128) * 1024;
  CK(cudaFuncSetAttribute(wg_fp4<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  double err;
  const float us = check_and_time([&](int c) {
    wg_fp4<D><<<grid, 128, smem>>>(dw + c * wbytes, ds + c * sbytes, dxs, dsx, dy, N, K, lbo_k);
  }, dy, N, 0xFF, ref, copies, err);
  printf("  %s depth %d grid %4d: %6.1f us (%.2f TB/s, %.0f%% of the read)  max err / max |y| %.2e\n", tag, D, grid, us,
         (wbytes + sbytes) / us / 1e6, 100 * read_us / us, err);
}

template <int D, int WGS>
static void run_multi(int grid, uint8_t* dw, uint8_t* ds, uint8_t* dxs, float* dsx, float* dy, int N, int K,
                      size_t wbytes, size_t sbytes, int copies, int lbo_k, const std::vector<double>& ref, float read_us) {
  const size_t smem = size_t(K / 128) * 1024;
  auto kern = wg_fp4_multi<D, WGS>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  double err;
  const float us = check_and_time([&](int c) {
    kern<<<grid, 128 * WGS, smem>>>(dw + c * wbytes, ds + c * sbytes, dxs, dsx, dy, N, K, lbo_k);
  }, dy, N, 0xFF, ref, copies, err);
  printf("  multi: %d warpgroups a CTA, depth %d, grid %4d: %6.1f us (%.2f TB/s, %.0f%% of the read)  max err / max |y| %.2e\n",
         WGS, D, grid, us, (wbytes + sbytes) / us / 1e6, 100 * read_us / us, err);
}

// the unit packing of wg_fp4_ring (see there) of row-major weights hw [N, K / 2] and scales hs [N, K / 32]
static void pack_units(const std::vector<uint8_t>& hw, const std::vector<uint8_t>& hs, int N, int K, int KC,
                       std::vector<uint8_t>& pw, std::vector<uint8_t>& ps) {
  const int BPU = KC / 128, CPT = K / KC;
  pw.assign(hw.size(), 0);
  ps.assign(hs.size(), 0);
  for (int tile = 0; tile < N / 64; ++tile)
    for (int c = 0; c < CPT; ++c) {
      const size_t u = size_t(tile) * CPT + c;
      for (int blk = 0; blk < BPU; ++blk)
        for (int w = 0; w < 4; ++w)
          for (int g = 0; g < 8; ++g)
            for (int h = 0; h < 2; ++h) {
              const size_t row = size_t(tile) * 64 + 16 * w + g + 8 * h;
              const int kb = c * BPU + blk;
              for (int q = 0; q < 4; ++q)
                std::copy_n(&hw[row * K / 2 + kb * 64 + q * 16], 16,
                            &pw[((((u * BPU + blk) * 4 + w) * 32 + 4 * g + q) * 2 + h) * 16]);
              std::copy_n(&hs[row * K / 32 + kb * 4], 4, &ps[((((u * BPU + blk) * 4 + w) * 2 + h) * 8 + g) * 4]);
            }
    }
}

// a 2-D tensor map of bytes [rows, inner] (row-major), boxes of box_rows x box_inner
static CUtensorMap byte_map(const void* base, uint64_t inner, uint64_t rows, uint32_t box_inner, uint32_t box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  CUtensorMap m;
  cuuint64_t dims[2] = {inner, rows}, strides[1] = {inner};
  cuuint32_t box[2] = {box_inner, box_rows}, es[2] = {1, 1};
  const CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, es,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: error %d\n", int(r)); exit(1); }
  return m;
}

template <int WGS, int NBUF, int KC, int MODE = RING_PACKED>
static void run_ring(int grid, uint8_t* dw, uint8_t* ds, uint8_t* dxs, float* dsx, float* dy, int N, int K,
                     size_t wbytes, size_t sbytes, int copies, int lbo_k, const std::vector<double>& ref, float read_us,
                     int rows = 0) {
  // rows: the first `rows` of N only (the units are tile-major), against the read scaled to them
  const int NR = rows ? rows : N;
  const double part = double(NR) / N;
  const size_t smem = size_t(K / 128) * 1024 + size_t(WGS) * NBUF * RingUnit<KC, MODE>::UB + 16 * WGS * NBUF;
  auto kern = wg_fp4_ring<WGS, NBUF, KC, MODE>;
  std::vector<CUtensorMap> tw, ts;   // a pair per copy of the weights (MODE RING_TMA reads them)
  for (int c = 0; c < copies; ++c) {
    CUtensorMap none{};
    tw.push_back(MODE == RING_TMA ? byte_map(dw + c * wbytes, K / 2, N, KC / 2, 64) : none);
    ts.push_back(MODE == RING_TMA ? byte_map(ds + c * sbytes, K / 32, N, KC / 32, 64) : none);
  }
  if (smem > 232448) { printf("  ring: %d warpgroups, %d slots of %d K: %zu bytes of shared memory, too many\n", WGS, NBUF, KC, smem); return; }
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  double err;
  const float us = check_and_time([&](int c) {
    kern<<<grid, 160 * WGS, smem>>>(dw + c * wbytes, ds + c * sbytes, dxs, dsx, dy, NR, K, lbo_k, tw[c], ts[c]);
  }, dy, NR, 0, ref, copies, err);   // 0: the warpgroups add their rows' sums into y
  printf("  ring%s: %d warpgroups a CTA, %d slots of %4d K, grid %4d, %5d rows: %6.1f us (%.2f TB/s, %.0f%% of the read)  max err / max |y| %.2e\n",
         MODE == RING_ROWS ? " (rows)" : MODE == RING_TMA ? " (2-D TMA)" : "", WGS, NBUF, KC, grid, NR, us, (wbytes + sbytes) * part / us / 1e6, 100 * read_us * part / us, err);
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);   // a line at a time, also through a pipe
  const int lbo_k = argc > 1 ? atoi(argv[1]) : 1;
  cudaDeviceProp prop;
  const int sms = sm_count(prop);
  // argv: lbo_k, K (4096: up's w1 + w3; 2048: down's w2, 6 experts x 4,096 rows), `ring`: the
  // ring kernel only
  const int K = argc > 2 ? atoi(argv[2]) : 4096;
  const bool ring_only = argc > 3 && std::string(argv[3]) == "ring";
  const int N = 24576, KB = K / 128, COPIES = 3;
  const size_t wbytes = size_t(N) * K / 2, sbytes = size_t(N) * K / 32;
  printf("%s, %d SMs; FP4 %d x %d (%.1f MB with scales); lbo_k %d\n", prop.name, sms, N, K, (wbytes + sbytes) / 1e6, lbo_k);
  std::vector<uint8_t> hw(wbytes), hs(sbytes), hx(K);
  uint32_t st = 777;
  auto rnd = [&]() { st = st * 1664525u + 1013904223u; return st >> 24; };
  for (auto& b : hw) b = uint8_t(rnd());
  for (auto& b : hs) b = uint8_t(124 + rnd() % 7);
  for (auto& b : hx) { uint8_t v; do v = uint8_t(rnd()); while ((v & 0x7F) == 0x7F); b = v; }
  std::vector<float> hsx(KB);
  for (int i = 0; i < KB; ++i) hsx[i] = std::ldexp(1.0f, (i % 5) - 2);
  // B of every 128-block: [kb][kk][c][n][16]; column n < 4 carries group n's elements 8kk + 2i
  // (c = 0, byte 4n + i) and 8kk + 2i + 1 (c = 1)
  std::vector<uint8_t> hxs(size_t(KB) * 1024, 0);
  for (int kb = 0; kb < KB; ++kb)
    for (int kk = 0; kk < 4; ++kk)
      for (int n = 0; n < 4; ++n)
        for (int i = 0; i < 4; ++i)
          for (int c = 0; c < 2; ++c)
            hxs[size_t(kb) * 1024 + kk * 256 + c * 128 + n * 16 + 4 * n + i] = hx[kb * 128 + n * 32 + 8 * kk + 2 * i + c];
  std::vector<double> ref(N), xv(K);
  for (int k = 0; k < K; ++k) xv[k] = e4m3_val(hx[k]) * hsx[k / 128];
  for (int r = 0; r < N; ++r) {
    double s = 0;
    for (int k = 0; k < K; ++k) {
      const uint8_t b = hw[size_t(r) * K / 2 + k / 2];
      const int c = (k & 1) ? b >> 4 : b & 15;
      s += e2m1_val(c) * std::ldexp(1.0, int(hs[size_t(r) * K / 32 + k / 32]) - 127) * xv[k];
    }
    ref[r] = s;
  }
  uint8_t *dw, *ds, *dxs; float *dsx, *dy; uint32_t* dummy;
  CK(cudaMalloc(&dw, wbytes * COPIES)); CK(cudaMalloc(&ds, sbytes * COPIES)); CK(cudaMalloc(&dxs, hxs.size()));
  CK(cudaMalloc(&dsx, KB * 4)); CK(cudaMalloc(&dy, N * 4)); CK(cudaMalloc(&dummy, 4));
  for (int c = 0; c < COPIES; ++c) {
    CK(cudaMemcpy(dw + c * wbytes, hw.data(), wbytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ds + c * sbytes, hs.data(), sbytes, cudaMemcpyHostToDevice));
  }
  CK(cudaMemcpy(dxs, hxs.data(), hxs.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dsx, hsx.data(), KB * 4, cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  float read_us = 1e9;
  for (int blocks : {sms * 2, sms * 4, sms * 8}) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < 60; ++i) read_all<<<blocks, 512>>>(reinterpret_cast<const uint4*>(dw + (i % COPIES) * wbytes), wbytes / 16, dummy);
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); read_us = std::min(read_us, ms * 1000 / 60);
  }
  printf("read alone (weights only, %.1f MB): %.1f us (%.2f TB/s)\n", wbytes / 1e6, read_us, wbytes / read_us / 1e6);
  int last = 0;
  if (!ring_only) {
    for (int cps : {1, 2, 3, 4, 6, 8}) {   // a CTA a 64-row tile (no split K): at most N / 64 CTAs
      const int grid = std::min(N / 64, sms * cps);
      if (grid == last) break;
      last = grid;
      run<2>("wgmma", grid, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
      run<4>("wgmma", grid, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
    }
    // the multi-warpgroup kernel: N / 64 warpgroups at most (each grid once)
    const int tiles = N / 64;
    for (int cps : {1, 2, 3}) {
      const int grid = std::min((tiles + 1) / 2, sms * cps);
      if (cps > 1 && grid == std::min((tiles + 1) / 2, sms * (cps - 1))) break;
      run_multi<4, 2>(grid, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
      run_multi<8, 2>(grid, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
    }
    // 3 warpgroups a CTA, one CTA an SM: a tile a warpgroup on (nearly) every SM, no SM with two CTAs
    run_multi<4, 3>(std::min((tiles + 2) / 3, sms), dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
    run_multi<2, 3>(std::min((tiles + 2) / 3, sms), dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
    run_multi<4, 3>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
    run_multi<4, 4>(std::min((tiles + 3) / 4, sms), dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
    run_multi<2, 4>(std::min((tiles + 3) / 4, sms), dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
  }
  // the ring on the checkpoint's layout (a copy a row), then on units packed at load; one CTA an SM
  run_ring<4, 2, 512, RING_TMA>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
  run_ring<3, 3, 512, RING_TMA>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
  run_ring<4, 2, 512, RING_ROWS>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
  run_ring<2, 2, 1024, RING_ROWS>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
  for (int KC : {256, 512, 1024}) {
    if (K % KC) continue;
    std::vector<uint8_t> pw, ps;
    pack_units(hw, hs, N, K, KC, pw, ps);
    for (int c = 0; c < COPIES; ++c) {
      CK(cudaMemcpy(dw + c * wbytes, pw.data(), wbytes, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(ds + c * sbytes, ps.data(), sbytes, cudaMemcpyHostToDevice));
    }
    if (KC == 256) {
      run_ring<4, 3, 256>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
      run_ring<5, 3, 256>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
    } else if (KC == 512) {
      run_ring<1, 8, 512>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
      run_ring<2, 4, 512>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
      run_ring<3, 3, 512>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
      run_ring<4, 2, 512>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
      // the same on a half and a quarter of the rows: time against bytes, the fixed cost its intercept
      run_ring<4, 2, 512>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us, N / 2);
      run_ring<4, 2, 512>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us, N / 4);
    } else {
      run_ring<1, 5, 1024>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
      run_ring<2, 2, 1024>(sms, dw, ds, dxs, dsx, dy, N, K, wbytes, sbytes, COPIES, lbo_k, ref, read_us);
    }
  }
  return 0;
}
