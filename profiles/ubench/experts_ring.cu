// Microbenchmark (not part of the library): the routed experts' down projection of one decode
// token (DeepSeek-V4-Flash: w2 of k = 6 of E = 256 experts, D = 4096 rows x I = 2048 K, e2m1 two a
// byte, low nibble first, an e8m0 scale per 32 K; the checkpoint's row-major bytes, not repacked;
// 26.7 MB with scales). The library's fp4_down_all_kernel streams them at ~39% of copy bandwidth
// on an H200 (16.2 us against 8.7 us for a plain read). The question: does a bulk-copy ring with
// tensor-core consumers reach the read at this size and layout? A unit is one 16-row tile of one
// expert: 16 weight rows of 1 KB and their 16 scale rows of 64 B, 32 bulk copies on one slot's
// mbarrier, each row into a padded shared-memory row (the consumers' reads conflict-free). One CTA
// an SM, one producer warp, 8 consumer warps splitting a unit's K (256 K = 8 scale groups each),
// partial sums reduced across the warps in a fixed order, the experts added in slot order. The
// consumers run mma.sync m16n8k16 on the e2m1 values decoded exactly to f16 in registers (a prmt
// lookup), the activation as f16 (the library quantizes it to e4m3: here f16, its values exact in
// f16 either way), and the e8m0 scale applied per 32-K group in float after the group's MMAs (B
// column n carries group n only, csrc/fp4_experts.cuh's trick). Timed against a plain read of as
// many bytes, a plain launch of the same unit math reading global memory (a warp a unit), and the
// ring's consumers alone (the ring's first fill consumed again and again, no producer). y of both
// kernels against a float64 host reference, and the two bit for bit. Build and run:
// bash profiles/ubench/run.sh experts_ring [RING SLOTS...] (default 4 8 11)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdint>
#include <type_traits>

#include "fp8chain.cuh"

constexpr int DOUT = 4096, KIN = 2048, NEXP = 256, TOPK = 6;
constexpr int WROWB = KIN / 2, SROWB = KIN / 32;     // a row's weight / scale bytes
constexpr int CONS = 8;                              // consumer warps (+ one producer warp)
constexpr int SLICES = KIN / 256;                    // a unit's K slices, a consumer warp each
constexpr int TILES = DOUT / 16, UNITS = TILES * TOPK;
constexpr int RS = WROWB + 64;                       // a slot's weight row stride (conflict-free)
constexpr int SS = SROWB + 16;                       // its scale row stride
constexpr int SLOT_W = 16 * RS, SLOTB = SLOT_W + 16 * SS;
constexpr unsigned UNIT_TX = 16 * (WROWB + SROWB);  // a unit's bytes (the slot's expect_tx)
constexpr int XCHUNKS = TOPK * KIN / 8;              // the activation as 16-byte chunks
constexpr int XFLOATS = (XCHUNKS * 16 + 128 + 2 * CONS * 16 * 4) / 4;   // xs, zero, red [2][CONS][16]
constexpr int PTHREADS = 256, PDEPTH = 2;            // the plain kernel's block, slices in flight
constexpr unsigned FULLM = 0xFFFFFFFFu;
static_assert(SLICES == CONS, "a consumer warp a slice");
static_assert(RS % 16 == 0 && SS % 16 == 0 && SLOTB % 16 == 0, "bulk copies: 16-byte aligned");

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}
__device__ __forceinline__ float e8m0(uint32_t b) { return __uint_as_float((b & 0xFFu) << 23); }

// 8 e2m1 codes (nibble r = element r) -> f16x2 pairs p[i] = (e_i, e_i+4), exact: the magnitude's
// high byte looked up by prmt (table 0, 0.5, 1, 1.5, 2, 3, 4, 6; low bytes 0: selector nibbles 0
// and 2 pick entry 0), the sign bit moved in. Selectors: bytes [n_i << 4, n_i+4 << 4] from the
// even (low) or odd (high) nibbles, bit 3 of each selector nibble clear (prmt's sign mode off)
__device__ __forceinline__ void e2m1x8_f16(uint32_t w, uint32_t (&p)[4]) {
  constexpr uint32_t TLO = 0x3E3C3800u, THI = 0x46444240u, SG = 0x80008000u;
  const uint32_t odd = w & 0x70707070u, even = (w << 4) & 0x70707070u;
  p[0] = prmt(TLO, THI, prmt(even, 0u, 0x20u)) | ((w << 12) & SG);
  p[1] = prmt(TLO, THI, prmt(odd, 0u, 0x20u)) | ((w << 8) & SG);
  p[2] = prmt(TLO, THI, prmt(even, 0u, 0x31u)) | ((w << 4) & SG);
  p[3] = prmt(TLO, THI, prmt(odd, 0u, 0x31u)) | (w & SG);
}


// timing probes: csrc/fp4_experts.cuh's two decodes (their own pair orders and scales)
__device__ __forceinline__ uint32_t cvt_e4m3x2(uint32_t v) {
  uint32_t r;
  asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}\n" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ void e2m1_cvt(uint32_t w, uint32_t (&p)[4]) {
  const uint32_t lo = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
  const uint32_t hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
  p[0] = cvt_e4m3x2(lo); p[1] = cvt_e4m3x2(lo >> 16); p[2] = cvt_e4m3x2(hi); p[3] = cvt_e4m3x2(hi >> 16);
}
// a timing bound: two instructions a pair (a rotate and a mask), what a nibble layout repacked at
// load for one shift per pair would cost (no such layout exists for f16: the sign's 4-bit gap)
__device__ __forceinline__ void e2m1_rot(uint32_t w, uint32_t (&p)[4]) {
  p[0] = __funnelshift_l(w, w, 9) & 0x8E008E00u;
  p[1] = __funnelshift_l(w, w, 5) & 0x8E008E00u;
  p[2] = __funnelshift_l(w, w, 1) & 0x8E008E00u;
  p[3] = __funnelshift_l(w, w, 29) & 0x8E008E00u;
}
__device__ __forceinline__ void e2m1_int(uint32_t w, uint32_t (&p)[4]) {
  p[0] = ((w << 9) & 0x0E000E00u) | ((w << 12) & 0x80008000u);
  p[1] = ((w << 5) & 0x0E000E00u) | ((w << 8) & 0x80008000u);
  p[2] = ((w << 1) & 0x0E000E00u) | ((w << 4) & 0x80008000u);
  p[3] = ((w >> 3) & 0x0E000E00u) | (w & 0x80008000u);
}

// a lane's pieces of one K slice (256 K) of a unit: for steps s = 0, 1 (128 K each) its 16 bytes of
// rows g and g + 8 at byte 64s + 16q of the slice (a[s][0], a[s][1]: one 32-K group, 4s + q), and
// the slice's 8 scale bytes of each row (sa, sb: word s = groups 4s .. 4s + 3)
struct Slice {
  uint4 a[2][2];
  uint2 sa, sb;
};

// where a lane reads its B operands: lane (q, q) the activation chunks of its group, the others a
// zero chunk. xs chunk (j, group G, word wd) lies at 256j + 4G + (wd ^ (G & 3)) and a step's four
// lanes (q, q) have G & 3 = q: their chunks fall in bank groups {wd, 4 + (wd ^ 1), wd ^ 2, 4 + (wd ^
// 3)}, the zero lanes' chunk wd ^ 1 of the 8 zero chunks in none of them (one wavefront a load)
struct XOp {
  const uint4* base;
  int stride, r;
  __device__ __forceinline__ const uint4* at(int j, int w) const { return base + stride * (16 * j + 2 * w); }
};
__device__ __forceinline__ XOp xop(const uint4* xs) {
  const int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
  return g == q ? XOp{xs + 4 * q, 16, q} : XOp{xs + XCHUNKS, 0, 1};
}

// a [TOPK][KIN] f16 into xs (XCHUNKS + 8 chunks): natural chunk c = 256j + 4G + wd to its xop
// place, its halves x0..x7 as x0 x4 x1 x5 x2 x6 x3 x7 (the pairs of e2m1x8_f16); then the zeros
__device__ __forceinline__ void load_xq(const __half* a, uint4* xs, int nthreads) {
  for (int c = threadIdx.x; c < XCHUNKS; c += nthreads) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(a) + c);
    xs[(c & ~3) | ((c & 3) ^ ((c >> 2) & 3))] =
        make_uint4(prmt(v.x, v.z, 0x5410u), prmt(v.x, v.z, 0x7632u), prmt(v.y, v.w, 0x5410u), prmt(v.y, v.w, 0x7632u));
  }
  if (threadIdx.x < 8) xs[XCHUNKS + threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
}

// one slice's dot of rows g and g + 8 (valid in the lanes q == 0). Per step, word wd of each
// lane's group feeds two MMAs (pairs (e0,e4),(e1,e5) then (e2,e6),(e3,e7) as k = 2q, 2q+1, 2q+8,
// 2q+9); B column n is zero but for lane (n, n)'s group, so C[r][n] = row r's dot with group 4s +
// n: lanes q < 2 hold columns 2q, 2q + 1 (c[0], c[1] row g; c[2], c[3] row g + 8) and scale them
// in float. The same order in every kernel
template <int MODE = 0>   // timing probes only (wrong values): 1 no e2m1 decode, 2 no MMA, 3 / 4
__device__ __forceinline__ float2 slice_dot(const Slice& sl, const uint4* xb, const XOp& xo) {
  // the library's decodes, 5 two instructions a pair, 6 / 7 decode 1 on 2 / 4 accumulator chains
  const int q = threadIdx.x & 3, sh = 16 * (q & 1);
  constexpr int CH = MODE == 6 ? 2 : MODE == 7 ? 4 : 1;
  float t0 = 0.f, t1 = 0.f;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    float cc[CH][4] = {};
    float (&c)[4] = cc[0];
    const uint32_t A[4] = {sl.a[s][0].x, sl.a[s][0].y, sl.a[s][0].z, sl.a[s][0].w};
    const uint32_t B[4] = {sl.a[s][1].x, sl.a[s][1].y, sl.a[s][1].z, sl.a[s][1].w};
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      const uint4 x = xb[s * xo.stride + (wd ^ xo.r)];
      uint32_t pa[4], pb[4];
      if (MODE == 1) {
        pa[0] = A[wd]; pa[1] = A[wd] >> 4; pa[2] = A[wd] << 4; pa[3] = A[wd] >> 8;
        pb[0] = B[wd]; pb[1] = B[wd] >> 4; pb[2] = B[wd] << 4; pb[3] = B[wd] >> 8;
      } else if (MODE == 3) {   // the library's decode 0: e4m3 bytes by bit ops, then cvt (another pair order)
        e2m1_cvt(A[wd], pa);
        e2m1_cvt(B[wd], pb);
      } else if (MODE == 4 || MODE == 6 || MODE == 7) {   // the library's decode 1: f16 patterns by integer ops (another scale)
        e2m1_int(A[wd], pa);
        e2m1_int(B[wd], pb);
      } else if (MODE == 5) {
        e2m1_rot(A[wd], pa);
        e2m1_rot(B[wd], pb);
      } else {
        e2m1x8_f16(A[wd], pa);
        e2m1x8_f16(B[wd], pb);
      }
      if (MODE == 2) {
        c[0] += __uint_as_float((pa[0] ^ pb[1] ^ x.x) & 0x3FFFFFFFu);
        c[1] += __uint_as_float((pa[1] ^ pb[0] ^ x.y) & 0x3FFFFFFFu);
        c[2] += __uint_as_float((pa[2] ^ pb[3] ^ x.z) & 0x3FFFFFFFu);
        c[3] += __uint_as_float((pa[3] ^ pb[2] ^ x.w) & 0x3FFFFFFFu);
      } else {
        mma16816(cc[(CH == 4 ? 2 * wd : wd) % CH], pa[0], pb[0], pa[1], pb[1], x.x, x.y);
        mma16816(cc[(CH == 4 ? 2 * wd + 1 : wd) % CH], pa[2], pb[2], pa[3], pb[3], x.z, x.w);
      }
    }
#pragma unroll
    for (int h = 1; h < CH; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[i] += cc[h][i];
    const uint32_t ua = s ? sl.sa.y : sl.sa.x, ub = s ? sl.sb.y : sl.sb.x;
    if (q < 2) {
      t0 = fmaf(c[0], e8m0(ua >> sh), t0);
      t0 = fmaf(c[1], e8m0(ua >> (sh + 8)), t0);
      t1 = fmaf(c[2], e8m0(ub >> sh), t1);
      t1 = fmaf(c[3], e8m0(ub >> (sh + 8)), t1);
    }
  }
  t0 += __shfl_xor_sync(FULLM, t0, 1);
  t1 += __shfl_xor_sync(FULLM, t1, 1);
  return make_float2(t0, t1);
}

// a warp's Slice (its K slice wg of rows g, g + 8) from a slot of the ring: weight rows rs bytes
// apart, the scale rows from byte sw of the slot, ss apart
__device__ __forceinline__ Slice slot_slice(const unsigned char* slot, int rs, int ss, int sw, int wg) {
  const int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
  const unsigned char* wr = slot + g * rs + 128 * wg + 16 * q;
  const unsigned char* sr = slot + sw + g * ss + 8 * wg;
  Slice sl;
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    sl.a[st][0] = *reinterpret_cast<const uint4*>(wr + 64 * st);
    sl.a[st][1] = *reinterpret_cast<const uint4*>(wr + 8 * rs + 64 * st);
  }
  sl.sa = *reinterpret_cast<const uint2*>(sr);
  sl.sb = *reinterpret_cast<const uint2*>(sr + 8 * ss);
  return sl;
}

// (2) a warp a unit (tile, slot j), units strided over the grid's warps, from global memory, the
// slices in order (PDEPTH in flight); a tile's k units meet through ws [TOPK][DOUT] and a
// semaphore cnt [TILES] (reset by the last, which sums ws in slot order into y)
__global__ void __launch_bounds__(PTHREADS, 2) down_plain(const uint8_t* w2, const uint8_t* s2, const int* idx,
                                                          const __half* a, float* ws, unsigned* cnt, float* y) {
  __shared__ __align__(128) uint4 xs[XCHUNKS + 8];
  load_xq(a, xs, PTHREADS);
  __syncthreads();
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
  const XOp xo = xop(xs);
  for (int u = gw; u < UNITS; u += nw) {
    const int tile = u / TOPK, j = u % TOPK;
    const size_t row = size_t(__ldg(idx + j)) * DOUT + tile * 16 + g;
    const uint8_t* wp = w2 + row * WROWB + 16 * q;
    const uint8_t* sp = s2 + row * SROWB;
    auto load = [&](int w) {
      Slice s;
#pragma unroll
      for (int st = 0; st < 2; ++st) {
        s.a[st][0] = ldg_na(wp + 128 * w + 64 * st);
        s.a[st][1] = ldg_na(wp + 8 * WROWB + 128 * w + 64 * st);
      }
      s.sa = __ldg(reinterpret_cast<const uint2*>(sp + 8 * w));
      s.sb = __ldg(reinterpret_cast<const uint2*>(sp + 8 * SROWB + 8 * w));
      return s;
    };
    Slice sl[SLICES];
#pragma unroll
    for (int w = 0; w < PDEPTH; ++w) sl[w] = load(w);
    float p0 = 0.f, p1 = 0.f;
#pragma unroll
    for (int w = 0; w < SLICES; ++w) {
      if (w + PDEPTH < SLICES) sl[w + PDEPTH] = load(w + PDEPTH);
      const float2 v = slice_dot(sl[w], xo.at(j, w), xo);
      p0 += v.x;
      p1 += v.y;
    }
    if (q == 0) {
      ws[j * DOUT + tile * 16 + g] = p0;
      ws[j * DOUT + tile * 16 + g + 8] = p1;
    }
    __threadfence();
    __syncwarp();
    unsigned last = 0;
    if (lane == 0) last = atomicAdd(cnt + tile, 1u) == TOPK - 1;
    if (__shfl_sync(FULLM, last, 0)) {
      __threadfence();
      if (lane < 16) {
        float acc = 0.f;
        for (int jj = 0; jj < TOPK; ++jj) acc += __ldcg(ws + jj * DOUT + tile * 16 + lane);
        y[tile * 16 + lane] = acc;
      }
      if (lane == 0) cnt[tile] = 0;
    }
  }
}

// the producer warp: use p of the ring <- expert e's 16-row tile `tile` of w2: 32 copies into
// padded rows (lanes 0-15 the weight rows, 16-31 the scale rows), or PACKED 2 (the tile's rows are
// contiguous in the checkpoint: lane 0 the weights, lane 16 the scales)
template <bool PACKED>
__device__ __forceinline__ void fill_unit(Ring& rg, int p, const uint8_t* w2, const uint8_t* s2, int e,
                                          int tile) {
  const int lane = threadIdx.x & 31;
  int slot = 0;
  if (lane == 0) {
    slot = rg.acquire(p);
    mbar_expect(&rg.full[slot], UNIT_TX);
  }
  slot = __shfl_sync(FULLM, slot, 0);
  unsigned char* dst = rg.rows + size_t(slot) * SLOTB;
  const size_t row = size_t(e) * DOUT + tile * 16 + (lane & 15);
  if (PACKED) {
    if (lane == 0) bulk_g2s(dst, w2 + row * WROWB, 16 * WROWB, &rg.full[slot]);
    else if (lane == 16) bulk_g2s(dst + 16 * WROWB, s2 + row * SROWB, 16 * SROWB, &rg.full[slot]);
  } else if (lane < 16) {
    bulk_g2s(dst + lane * RS, w2 + row * WROWB, WROWB, &rg.full[slot]);
  } else {
    bulk_g2s(dst + SLOT_W + (lane - 16) * SS, s2 + row * SROWB, SROWB, &rg.full[slot]);
  }
}

// (3) persistent: one CTA an SM, tiles split evenly (even_rows), each tile's k units in slot order
// through a ring of nbuf slots [16 weight rows of RS | 16 scale rows of SS]. The producer warp: lane
// 0 takes the slot and expects the unit's bytes, lanes 0-15 copy the weight rows, 16-31 the scale
// rows. Every consumer warp takes its slice of every unit; the partials go through red (two
// buffers: one consumer barrier a unit), summed over warps in order by threads 0-15, which add the
// experts in slot order. SOLO (4): the producer fills min(units, nbuf) slots once and the consumers
// take them again and again, `passes` times the CTA's units
template <bool SOLO>
__global__ void __launch_bounds__((CONS + 1) * 32, 1) down_ring(const uint8_t* w2, const uint8_t* s2, const int* idx,
                                                                const __half* a, float* y, int nbuf, int passes) {
  extern __shared__ __align__(128) unsigned char sm[];
  Ring rg = ring_init(sm, XFLOATS, SLOTB, nbuf);
  uint4* xs = reinterpret_cast<uint4*>(rg.xs);
  float* reds = reinterpret_cast<float*>(xs + XCHUNKS + 8);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  int t0, t1;
  even_rows(TILES, t0, t1);
  const int units = (t1 - t0) * TOPK, nfill = min(units, nbuf);
  if (warp == CONS) {
    for (int u = 0; u < (SOLO ? nfill : units); ++u)
      fill_unit<false>(rg, u, w2, s2, __ldg(idx + u % TOPK), t0 + u / TOPK);
    return;
  }
  load_xq(a, xs, CONS * 32);
  cons_sync<CONS>();
  const XOp xo = xop(xs);
  if (SOLO)
    for (int i = 0; i < nfill; ++i) rg.wait(i);
  float acc = 0.f;
  for (int v = 0; v < (SOLO ? passes : 1) * units; ++v) {
    const int u = v % units, tile = t0 + u / TOPK, j = u % TOPK;
    const int slot = SOLO ? v % nfill : rg.wait(v);
    const Slice sl = slot_slice(rg.rows + size_t(slot) * SLOTB, RS, SS, SLOT_W, warp);
    const float2 p = slice_dot(sl, xo.at(j, warp), xo);
    float* red = reds + (v & 1) * CONS * 16;
    if (q == 0) {
      red[warp * 16 + g] = p.x;
      red[warp * 16 + g + 8] = p.y;
    }
    cons_sync<CONS>();
    if (!SOLO && threadIdx.x == 0) rg.release(slot);
    if (threadIdx.x < 16) {
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < CONS; ++w) t += red[w * 16 + threadIdx.x];
      acc += t;
      if (j == TOPK - 1) {
        y[tile * 16 + threadIdx.x] = acc;
        acc = 0.f;
      }
    }
  }
}


// (5) the ring with G groups of 8 consumer warps (8G + 1 warps): group gi takes the CTA's tiles
// gi, gi + G, ... and all k units of each; a warp keeps its slice's dot summed over the k experts
// in registers (slot order) and the group meets once a tile (a named barrier of its own, red
// double-buffered), not once a unit. A slot is free once its group's 8 warps have read it (empty
// mbarriers count 8). The producer fills a round of G tiles' units j-major, so a group's next
// unit is G fills after its last: with nbuf >= G, wait_after (the slot's use before released,
// then the parity wait) cannot take an older use of the slot for this one. Sums in
// another order than (2) / (3): checked against float64 only. SOLO: as in (3)
constexpr int XFLOATS2 = (XCHUNKS * 16 + 128 + 3 * 2 * 8 * 16 * 4) / 4;   // xs, zero, red [G][2][8][16]
template <bool SOLO, int G, int MODE = 0, bool PACKED = false>
__global__ void __launch_bounds__((8 * G + 1) * 32, 1) down_ring2(const uint8_t* w2, const uint8_t* s2, const int* idx,
                                                                  const __half* a, float* y, int nbuf, int passes) {
  constexpr int NC = 8 * G;
  extern __shared__ __align__(128) unsigned char sm[];
  Ring rg = ring_init(sm, XFLOATS2, SLOTB, nbuf, 8);   // a slot is free after its group's 8 warps
  uint4* xs = reinterpret_cast<uint4*>(rg.xs);
  float* reds = reinterpret_cast<float*>(xs + XCHUNKS + 8);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int grp = warp >> 3, wg = warp & 7;
  int t0, t1;
  even_rows(TILES, t0, t1);
  const int ntile = t1 - t0, units = ntile * TOPK, nfill = min(units, nbuf);
  if (warp == NC) {   // fill order: rounds of G tiles, a round's units j-major (group-interleaved)
    for (int p = 0, r = 0; r * G < ntile; ++r) {
      const int nr = min(G, ntile - r * G);
      for (int u2 = 0; u2 < TOPK * nr && !(SOLO && p >= nfill); ++u2, ++p)
        fill_unit<PACKED>(rg, p, w2, s2, __ldg(idx + u2 / nr), t0 + r * G + u2 % nr);
    }
    return;
  }
  load_xq(a, xs, NC * 32);
  cons_sync<NC>();
  const XOp xo = xop(xs);
  if (SOLO)
    for (int i = 0; i < nfill; ++i) rg.wait(i);
  int n = 0;   // the group's tiles so far (red's buffer parity)
  for (int pass = 0; pass < (SOLO ? passes : 1); ++pass)
    for (int tl = grp; tl < ntile; tl += G, ++n) {
      float p0 = 0.f, p1 = 0.f;
#pragma unroll 1
      for (int j = 0; j < TOPK; ++j) {
        const int r = tl / G, nr = min(G, ntile - r * G), u = r * G * TOPK + j * nr + grp;
        const int slot = SOLO ? u % nfill : rg.wait_after(u);   // sound for nbuf >= G (see the fill order)
        const Slice sl = PACKED ? slot_slice(rg.rows + size_t(slot) * SLOTB, WROWB, SROWB, 16 * WROWB, wg)
                                : slot_slice(rg.rows + size_t(slot) * SLOTB, RS, SS, SLOT_W, wg);
        __syncwarp();
        if (!SOLO && lane == 0) rg.release(slot);
        const float2 p = slice_dot<MODE>(sl, xo.at(j, wg), xo);
        p0 += p.x;
        p1 += p.y;
      }
      float* red = reds + (grp * 2 + (n & 1)) * 8 * 16;
      if (q == 0) {
        red[wg * 16 + g] = p0;
        red[wg * 16 + g + 8] = p1;
      }
      asm volatile("bar.sync %0, 256;\n" ::"r"(2 + grp) : "memory");
      if (wg == 0 && lane < 16) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) t += red[w * 16 + lane];
        y[(t0 + tl) * 16 + lane] = t;
      }
    }
}

static double e2m1_val(int c) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (c & 8) ? -mag[c & 7] : mag[c & 7];
}

int main(int argc, char** argv) {   // argv: the ring sizes in units (default 4 8 11)
  std::vector<int> nbufs;
  for (int i = 1; i < argc; ++i) nbufs.push_back(atoi(argv[i]));
  if (nbufs.empty()) nbufs = {4, 8, 11};
  const int sms = chain_start("experts_ring: FP4 routed down, a bulk-copy ring with mma.sync consumers against the read");
  Timer T;
  const cudaStream_t st = T.st;
  // COPIES sets of k distinct experts (all distinct: no replay finds the next set's bytes in L2)
  constexpr int COPIES = 4, PASSES = 8;
  const size_t wexp = size_t(DOUT) * WROWB, sexp = size_t(DOUT) * SROWB, bytes = TOPK * (wexp + sexp);
  uint32_t rs = 12345;
  auto rnd = [&] { rs = rs * 1664525u + 1013904223u; return rs >> 8; };
  std::vector<int> hidx;
  while (int(hidx.size()) < COPIES * TOPK) {
    const int e = int(rnd() % NEXP);
    if (std::find(hidx.begin(), hidx.end(), e) == hidx.end()) hidx.push_back(e);
  }
  uint8_t *w2, *s2;
  CK(cudaMalloc(&w2, NEXP * wexp)); CK(cudaMalloc(&s2, NEXP * sexp));
  CK(cudaMemset(w2, 0, NEXP * wexp)); CK(cudaMemset(s2, 0, NEXP * sexp));
  std::vector<uint8_t> hw(TOPK * wexp), hs(TOPK * sexp);   // set 0's experts, slot order (the reference)
  std::vector<uint8_t> tw(wexp), ts(sexp);
  for (int i = 0; i < COPIES * TOPK; ++i) {   // all byte values; scales 2^-7 .. 2^0
    uint8_t* pw = i < TOPK ? &hw[i * wexp] : tw.data();
    uint8_t* ps = i < TOPK ? &hs[i * sexp] : ts.data();
    for (size_t b = 0; b < wexp; ++b) pw[b] = uint8_t(rnd());
    for (size_t b = 0; b < sexp; ++b) ps[b] = uint8_t(120 + rnd() % 8);
    CK(cudaMemcpy(w2 + hidx[i] * wexp, pw, wexp, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s2 + hidx[i] * sexp, ps, sexp, cudaMemcpyHostToDevice));
  }
  std::vector<__half> ha(TOPK * KIN);
  for (auto& v : ha) v = __float2half_rn(float(int(rnd() % 2001) - 1000) / 1000.f);
  int* didx;
  __half* da;
  float *ws, *y2, *y3;
  unsigned* cnt;
  CK(cudaMalloc(&didx, hidx.size() * 4)); CK(cudaMalloc(&da, ha.size() * 2));
  CK(cudaMalloc(&ws, TOPK * DOUT * 4)); CK(cudaMalloc(&y2, DOUT * 4)); CK(cudaMalloc(&y3, DOUT * 4));
  CK(cudaMalloc(&cnt, TILES * 4)); CK(cudaMemset(cnt, 0, TILES * 4));
  CK(cudaMemcpy(didx, hidx.data(), hidx.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(da, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  std::vector<double> ref(DOUT, 0.0);   // set 0 in float64
  double big = 0;
  for (int r = 0; r < DOUT; ++r) {
    for (int j = 0; j < TOPK; ++j)
      for (int k = 0; k < KIN; ++k) {
        const int c = (hw[j * wexp + size_t(r) * WROWB + k / 2] >> (4 * (k & 1))) & 15;
        ref[r] += e2m1_val(c) * std::ldexp(1.0, hs[j * sexp + size_t(r) * SROWB + k / 32] - 127) *
                  __half2float(ha[j * KIN + k]);
      }
    big = std::max(big, std::fabs(ref[r]));
  }
  auto err = [&](const std::vector<float>& y) {
    double e = 0;
    for (int r = 0; r < DOUT; ++r) e = std::max(e, std::fabs(y[r] - ref[r]));
    return e / big;
  };
  // (1) the read of as many bytes, contiguous, COPIES places 32 MiB apart
  const float t_read = T.read(w2, bytes, COPIES, size_t(32) << 20, sms);
  printf("w2 of %d of %d experts, %d x %d e2m1 + e8m0 per 32 (%.1f MB): the read of as many bytes %.1f us (%.2f TB/s)\n",
         TOPK, NEXP, DOUT, KIN, bytes / 1e6, t_read, bytes / t_read / 1e6);
  // (2) the plain launch
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, down_plain, PTHREADS, 0));
  const int grid2 = std::min(sms * std::max(occ, 1), UNITS * 32 / PTHREADS);
  auto plain = [&](int k, float* y) {
    down_plain<<<grid2, PTHREADS, 0, st>>>(w2, s2, didx + k * TOPK, da, ws, cnt, y);
  };
  const float t_plain = T.time([&](int i) { plain(i % COPIES, y2); });
  CK(cudaMemsetAsync(y2, 0xFF, DOUT * 4, st));
  plain(0, y2);
  CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
  const std::vector<float> yp = fetch(y2, DOUT);
  printf("  plain launch (%d CTAs of %d, a warp a 16-row tile of an expert): %.1f us (%.0f%% of the read) | "
         "against float64: max err / max |y| %.1e\n", grid2, PTHREADS, t_plain, 100.0 * t_read / t_plain, err(yp));
  // (3), (4) the persistent ring
  const int threads = (CONS + 1) * 32;
  for (int nbuf : nbufs) {
    const size_t smem = size_t(XFLOATS) * 4 + size_t(nbuf) * SLOTB + size_t(nbuf) * 16;
    if (nbuf < 1 || smem > 227 * 1024) { printf("  ring %d: 1 .. 11 slots (227 KB)\n", nbuf); continue; }
    CK(cudaFuncSetAttribute(down_ring<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    CK(cudaFuncSetAttribute(down_ring<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    auto ring = [&](bool solo, int k, float* y) {
      (solo ? down_ring<true> : down_ring<false>)<<<sms, threads, smem, st>>>(w2, s2, didx + k * TOPK, da, y, nbuf,
                                                                                PASSES);
    };
    const float t_ring = T.time([&](int i) { ring(false, i % COPIES, y3); });
    const float t_solo = T.time([&](int i) { ring(true, i % COPIES, y3); }) / PASSES;
    CK(cudaMemsetAsync(y3, 0xFF, DOUT * 4, st));
    ring(false, 0, y3);
    CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
    const std::vector<float> yr = fetch(y3, DOUT);
    printf("  ring %2d units (%3zu KB): %.1f us (%.0f%% of the read) | against float64 %.1e | same bits as the plain "
           "launch %s | the consumers alone (%d passes of the first fill) %.1f us a pass (%.0f%% of the read)\n",
           nbuf, smem / 1024, t_ring, 100.0 * t_read / t_ring, err(yr), yr == yp ? "yes" : "NO", PASSES, t_solo,
           100.0 * t_read / t_solo);
  }

  // (5) grouped consumers
  for (int nbuf : nbufs) {
    const size_t smem = size_t(XFLOATS2) * 4 + size_t(nbuf) * SLOTB + size_t(nbuf) * 16;
    if (nbuf < 1 || smem > 227 * 1024) { printf("  ring2 %d: too big\n", nbuf); continue; }
    auto run2 = [&](auto solo_t, auto g_t) {
      constexpr bool SOLO = decltype(solo_t)::value;
      constexpr int G = decltype(g_t)::value;
      CK(cudaFuncSetAttribute(down_ring2<SOLO, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      return [&, smem](int k, float* y) {
        down_ring2<SOLO, G><<<sms, (8 * G + 1) * 32, smem, st>>>(w2, s2, didx + k * TOPK, da, y, nbuf, PASSES);
      };
    };
    auto one = [&](auto g_t) {
      constexpr int G = decltype(g_t)::value;
      auto ring = run2(std::false_type{}, g_t);
      auto solo = run2(std::true_type{}, g_t);
      const float t_ring = T.time([&](int i) { ring(i % COPIES, y3); });
      const float t_solo = T.time([&](int i) { solo(i % COPIES, y3); }) / PASSES;
      CK(cudaMemsetAsync(y3, 0xFF, DOUT * 4, st));
      ring(0, y3);
      CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
      const std::vector<float> yr = fetch(y3, DOUT);
      printf("  ring2 %2d units, %d consumer warps: %.1f us (%.0f%% of the read) | against float64 %.1e | the "
             "consumers alone %.1f us a pass (%.0f%% of the read)\n", nbuf, 8 * G, t_ring, 100.0 * t_read / t_ring,
             err(yr), t_solo, 100.0 * t_read / t_solo);
    };
    one(std::integral_constant<int, 1>{});
    one(std::integral_constant<int, 2>{});
    one(std::integral_constant<int, 3>{});
    if (nbuf == nbufs[0]) {   // the consumers alone, 16 warps, without the decode / without the MMAs
      const size_t sm2 = smem;
      auto probe = [&](auto m_t) {
        constexpr int MODE = decltype(m_t)::value;
        CK(cudaFuncSetAttribute(down_ring2<true, 2, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm2)));
        const float t = T.time([&](int i) {
          down_ring2<true, 2, MODE><<<sms, 17 * 32, sm2, st>>>(w2, s2, didx + (i % COPIES) * TOPK, da, y3, nbuf, PASSES);
        }) / PASSES;
        printf("  ring2 consumers alone, 16 warps, %s: %.1f us a pass\n", MODE == 1 ? "no e2m1 decode" : MODE == 2 ?
               "no MMA" : MODE == 3 ? "the library's decode 0 (bit ops + cvt)" : MODE == 4 ? "the library's decode 1 (integer ops)" :
               MODE == 5 ? "two instructions a pair (rotate, mask)" : MODE == 6 ? "decode 1, 2 accumulator chains" :
               "decode 1, 4 accumulator chains", t);
      };
      probe(std::integral_constant<int, 1>{});
      probe(std::integral_constant<int, 2>{});
      probe(std::integral_constant<int, 3>{});
      probe(std::integral_constant<int, 4>{});
      probe(std::integral_constant<int, 5>{});
      probe(std::integral_constant<int, 6>{});
      probe(std::integral_constant<int, 7>{});

    }
    // the whole ring, packed slots (2 bulk copies a unit, rows 1 KB apart: the consumers' loads
    // conflict), 16 consumer warps: with the prmt decode (checked) and decode 1 (timing only)
    auto whole = [&](auto m_t, auto g_t) {
      constexpr int MODE = decltype(m_t)::value, G = decltype(g_t)::value;
      CK(cudaFuncSetAttribute(down_ring2<false, G, MODE, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(down_ring2<true, G, MODE, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      const float t = T.time([&](int i) {
        down_ring2<false, G, MODE, true><<<sms, (8 * G + 1) * 32, smem, st>>>(w2, s2, didx + (i % COPIES) * TOPK, da, y3, nbuf, 1);
      });
      const float ts = T.time([&](int i) {
        down_ring2<true, G, MODE, true><<<sms, (8 * G + 1) * 32, smem, st>>>(w2, s2, didx + (i % COPIES) * TOPK, da, y3, nbuf, PASSES);
      }) / PASSES;
      CK(cudaMemsetAsync(y3, 0xFF, DOUT * 4, st));
      down_ring2<false, G, MODE, true><<<sms, (8 * G + 1) * 32, smem, st>>>(w2, s2, didx, da, y3, nbuf, 1);
      CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
      const std::vector<float> yr = fetch(y3, DOUT);
      printf("  ring2 packed slots, %2d units, %d warps, %s: %.1f us (%.0f%% of the read), consumers alone %.1f us a pass | against float64 %.1e\n",
             nbuf, 8 * G, MODE == 0 ? "prmt decode" : MODE == 4 ? "decode 1 (wrong values)" : MODE == 5 ? "rotate+mask (wrong values)" : "decode 1, 2 chains (wrong values)", t, 100.0 * t_read / t, ts, err(yr));
    };
    whole(std::integral_constant<int, 0>{}, std::integral_constant<int, 2>{});
    whole(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{});
    whole(std::integral_constant<int, 4>{}, std::integral_constant<int, 3>{});
    whole(std::integral_constant<int, 5>{}, std::integral_constant<int, 2>{});
    whole(std::integral_constant<int, 6>{}, std::integral_constant<int, 2>{});
  }
  CK(cudaFree(w2)); CK(cudaFree(s2)); CK(cudaFree(didx)); CK(cudaFree(da));
  CK(cudaFree(ws)); CK(cudaFree(y2)); CK(cudaFree(y3)); CK(cudaFree(cnt));
  return 0;
}
