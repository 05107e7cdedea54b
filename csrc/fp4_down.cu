// The routed FP4 experts' down of decode tokens on tensor cores (dsv4_fp4_down): w2 of each routed
// expert, the experts summed in slot order through a per-row-tile semaphore (fp4_down_kernel), all
// experts of a row tile in one CTA (fp4_down_all_kernel), or a fixed grid of CTAs whose producer
// bulk-copies the experts' tiles into a shared-memory ring for two groups of consumer warps
// (fp4_down_ring_kernel, sm_90); the same bits; plus the shared expert's output. fp4_experts.cuh:
// the decode and the tensor-core step. early (the launch's pdl 2): idx and the weights it addresses
// are requested before the PDL wait (idx comes from the routing, which completed before up, the
// kernel waited for, passed its own wait), so the weights stream while up finishes; the activation
// and everything else after it.
#include "dsv4_api.h"
#include "fp4_experts.cuh"
#include "tma.cuh"

namespace {

// The block's mHC post of down's output (post != null): v, y's element r before its rounding to
// bf16, put into the row's 4 streams: y [4, D] bf16 (the streams after), res [4, D] bf16 (before),
// post [4], comb [4, 4] (mhc_post_one: the float order of every kernel that takes the post).
DEV void down_post(float v, const __nv_bfloat16* res, const float* post, const float* comb,
                   __nv_bfloat16* y, int D, int r) {
  float rr[MHC_STREAMS];
#pragma unroll
  for (int i = 0; i < MHC_STREAMS; ++i) rr[i] = __bfloat162float(res[size_t(i) * D + r]);
  const float vb = bf16_round(v);
#pragma unroll
  for (int j = 0; j < MHC_STREAMS; ++j)
    y[size_t(j) * D + r] = __float2bfloat16_rn(mhc_post_one(vb, rr, post, comb, j));
}

// Activation row b's add, output and post operands of the all-experts kernels (fp4_down_all_kernel,
// fp4_down_ring_kernel): add and y [rows, D] (y float32 or bf16), or, POST, y and res [rows, 4, D]
// bf16 with post [rows, 4] and comb [rows, 4, 4].
template <bool POST>
DEV void down_row(size_t b, int D, int y_f32, const __nv_bfloat16*& add, void*& y,
                  const __nv_bfloat16*& res, const float*& post, const float*& comb) {
  if (add != nullptr) add += b * D;
  if constexpr (POST) {
    res += b * MHC_STREAMS * D;
    post += b * MHC_STREAMS;
    comb += b * MHC_STREAMS * MHC_STREAMS;
    y = static_cast<char*>(y) + b * MHC_STREAMS * D * 2;
  } else {
    y = static_cast<char*>(y) + b * D * (y_f32 ? 4 : 2);
  }
}

// The all-experts epilogue (fp4_down_all_kernel, fp4_down_ring_kernel), a warp's part: its sums
// tot of each expert's rows g and g + 8 -> red [warps][NE][16] (lanes q == 0).
template <int NE>
DEV void down_all_partial(float (&tot)[NE][1][2], float* red, int warp, int g, int q) {
#pragma unroll
  for (int j = 0; j < NE; ++j) {
    tot[j][0][0] += __shfl_xor_sync(FULL, tot[j][0][0], 1);
    tot[j][0][1] += __shfl_xor_sync(FULL, tot[j][0][1], 1);
    if (q == 0) {
      red[(warp * NE + j) * 16 + g] = tot[j][0][0];
      red[(warp * NE + j) * 16 + g + 8] = tot[j][0][1];
    }
  }
}

// The rest, row r0 + r of the tile (one thread a row, every warp's part in red): per expert the
// warps in order, then bf16 (fp4_gemm outputs bf16); the experts in slot order; + add; then y
// (float32 or bf16) or, POST, the block's mHC post into y's streams.
template <int NE, bool POST>
DEV void down_all_finish(const float* red, int nwarps, int r, int r0, const __nv_bfloat16* add,
                         void* y, int D, int y_f32, const __nv_bfloat16* res, const float* post,
                         const float* comb) {
  float acc = 0.0f;
  for (int j = 0; j < NE; ++j) {
    float t = 0.0f;
    for (int w = 0; w < nwarps; ++w) t += red[(w * NE + j) * 16 + r];
    acc += bf16_round(t);
  }
  if (add != nullptr) acc += __bfloat162float(add[r0 + r]);
  if constexpr (POST)
    down_post(acc, res, post, comb, static_cast<__nv_bfloat16*>(y), D, r0 + r);
  else if (y_f32)
    static_cast<float*>(y)[r0 + r] = acc;
  else
    static_cast<__nv_bfloat16*>(y)[r0 + r] = __float2bfloat16_rn(acc);
}

// y[r] = sum_j bf16(W8A8 w2[idx[j]] @ a[j])[r] in float32, slot order j = 0..k-1, (+ add[r]),
// rounded to y's dtype. Grid (D / 16, k): CTA (t, j) writes expert j's bf16 rows of tile t to
// ws[j, :]; the last CTA of tile t (semaphore cnt[t], reset by it) adds them up in slot order.
// POST: y [4, D] bf16 gets the block's mHC post of that output instead (down_post; an
// instantiation of its own, so the kernel without it keeps its code).
template <int SPW, int DEC, int DEPTH, bool POST>
__global__ void __launch_bounds__(512) fp4_down_kernel(const __nv_bfloat16* act, const int64_t* idx,
                                                       const uint8_t* w2, const uint8_t* s2,
                                                       const __nv_bfloat16* add, void* y,
                                                       float* ws, int* cnt, int D, int I, int k,
                                                       int y_f32, int early,
                                                       const __nv_bfloat16* res,
                                                       const float* post, const float* comb) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, j = blockIdx.y, r0 = blockIdx.x * 16;
  uint4* xs;
  float *ef, *red;
  int xstride;
  const uint4* xq = expert_smem<SPW>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  if (!early) pdl_wait();
  const int64_t e = idx[j];
  const int k0 = warp * 128 * SPW;
  const size_t rowa = size_t(e) * D + r0 + g;
  ExpertWarp<SPW, 1, DEC, DEPTH> ew;
  ew.wrow = size_t(I) / 2;
  ew.srow = size_t(I) / 32;
  ew.q = q;
  ew.wp[0] = w2 + rowa * ew.wrow + (k0 >> 5) * 16;
  ew.sp[0] = s2 + rowa * ew.srow + (k0 >> 5);
  ew.prefetch();
  if (early) pdl_wait();   // the weights of idx requested; now the activation (up's output)
  quant_slice<SPW, DEC>(act + size_t(j) * I + k0, reinterpret_cast<uint16_t*>(xs), ef, lane);
  __syncthreads();   // xs, and the zero operand
  float tot[1][2] = {{0.0f, 0.0f}};
  ew.run(xq, xstride, ef, tot);
  tot[0][0] += __shfl_xor_sync(FULL, tot[0][0], 1);
  tot[0][1] += __shfl_xor_sync(FULL, tot[0][1], 1);
  if (q == 0) {
    red[warp * 16 + g] = tot[0][0];
    red[warp * 16 + g + 8] = tot[0][1];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float t = 0.0f;
    for (int w = 0; w < nwarps; ++w) t += red[w * 16 + threadIdx.x];
    ws[size_t(j) * D + r0 + threadIdx.x] = bf16_round(t);   // fp4_gemm outputs bf16
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int done = atomicAdd(cnt + blockIdx.x, 1);
    last = done == k - 1;
    if (last) cnt[blockIdx.x] = 0;   // ready for the next launch
  }
  __syncthreads();
  if (last && threadIdx.x < 16) {
    __threadfence();
    const int r = r0 + threadIdx.x;
    float t = 0.0f;
    for (int jj = 0; jj < k; ++jj) t += __ldcg(ws + size_t(jj) * D + r);
    if (add != nullptr) t += __bfloat162float(add[r]);
    if constexpr (POST)
      down_post(t, res, post, comb, static_cast<__nv_bfloat16*>(y), D, r);
    else if (y_f32)
      static_cast<float*>(y)[r] = t;
    else
      static_cast<__nv_bfloat16*>(y)[r] = __float2bfloat16_rn(t);
  }
}

// fp4_down_kernel with all NE experts of a row tile in one CTA: y[r] = sum_j bf16(W8A8 w2[idx[j]] @
// a[j])[r] in float32, slot order j = 0..NE-1, (+ add[r]). Grid D / 16; warp w takes the K slice
// [w*128*SPW, ...) of every expert and streams its NE * SPW steps (expert-major) with DEPTH steps
// of weights in flight across the expert boundaries. The sums are those of fp4_down_kernel with
// the same SPW (per expert: warps in order, then bf16; experts in slot order), without its
// workspace, semaphore and second pass, and with one CTA per row tile instead of NE. Grid axis y:
// the activation row b (the speculative verify rows): act, idx, add and y move to row b's.
// POST: as fp4_down_kernel's (y [rows, 4, D]; res, post, comb row b's).
template <int SPW, int NE, int DEC, int DEPTH, bool POST>
__global__ void __launch_bounds__(512) fp4_down_all_kernel(const __nv_bfloat16* act,
                                                           const int64_t* idx, const uint8_t* w2,
                                                           const uint8_t* s2,
                                                           const __nv_bfloat16* add, void* y,
                                                           int D, int I, int y_f32, int early,
                                                           const __nv_bfloat16* res,
                                                           const float* post, const float* comb) {
  constexpr int NS = NE * SPW;
  static_assert(NE % 2 == 0, "the scale loads take two experts");
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, r0 = blockIdx.x * 16;
  act += size_t(blockIdx.y) * NE * I;
  idx += size_t(blockIdx.y) * NE;
  down_row<POST>(blockIdx.y, D, y_f32, add, y, res, post, comb);
  uint4* xs;
  float *ef, *red;   // the expert_smem layout with NS steps per warp; red [warps][NE][16]
  int xstride;
  const uint4* xq = expert_smem<NS>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  if (!early) pdl_wait();
  const int k0 = warp * 128 * SPW;
  const size_t wrow = size_t(I) / 2, srow = size_t(I) / 32;
  const uint8_t* wp[NE];
#pragma unroll
  for (int j = 0; j < NE; ++j) {
    const size_t row = size_t(idx[j]) * D + r0 + g;
    wp[j] = w2 + row * wrow + (k0 >> 5) * 16 + q * 16;
  }
  ExpertStep<1> st[DEPTH];   // sa / sb: see the step loop
  auto load = [&](int s) {
    ExpertStep<1>& e = st[s % DEPTH];
    const int j = s / SPW, t = s % SPW;
    e.wa[0] = ld_stream(wp[j] + t * 64);
    e.wb[0] = ld_stream(wp[j] + t * 64 + 8 * wrow);
  };
#pragma unroll
  for (int s = 0; s < DEPTH && s < NS; ++s) load(s);
  uint32_t sc[NE / 2][SPW];   // experts 2i (lanes 0-15) and 2i + 1 (lanes 16-31), ld_scales
#pragma unroll
  for (int i = 0; i < NE / 2; ++i)
    ld_scales<SPW>(s2 + (size_t(idx[2 * i + (lane >> 4)]) * D + r0 + (lane & 15)) * srow + (k0 >> 5),
                   sc[i]);
  if (early) pdl_wait();   // the weights of idx requested; now the activation (up's output)
#pragma unroll
  for (int j = 0; j < NE; ++j)
    quant_slice<SPW, DEC>(act + size_t(j) * I + k0, reinterpret_cast<uint16_t*>(xs + j * SPW * 16),
                          ef + j * SPW, lane);
  __syncthreads();   // xs, and the zero operand
  float tot[NE][1][2];
#pragma unroll
  for (int j = 0; j < NE; ++j) tot[j][0][0] = tot[j][0][1] = 0.0f;
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    ExpertStep<1> e = st[s % DEPTH];
    spread_scales(sc[s / SPW / 2][s % SPW], (s / SPW) & 1, g, e.sa[0], e.sb[0]);
    fp4_step<1, DEC>(e, xq + s * xstride, ef[s], q, tot[s / SPW]);
    if (s + DEPTH < NS) load(s + DEPTH);
  }
  down_all_partial<NE>(tot, red, warp, g, q);
  __syncthreads();
  if (threadIdx.x < 16)
    down_all_finish<NE, POST>(red, nwarps, threadIdx.x, r0, add, y, D, y_f32, res, post, comb);
}


// ---- the ring kernel ------------------------------------------------------------------------------


// The ring kernel's shared memory: the expert_smem layout (xs of NE * SPW steps a warp of a group,
// red [G][2][wg][NE][16]), then nbuf slots of a unit (16 weight rows, then their 16 scale rows:
// the checkpoint's bytes of one expert's row tile, contiguous), then the full / empty mbarriers.
template <int SPW, int NE, int G>
size_t down_ring_smem(int wg, int I, int nbuf) {
  const size_t head = (expert_smem_bytes<NE * SPW>(wg, 2 * G * NE) + 127) / 128 * 128;
  return head + size_t(nbuf) * 16 * (I / 2 + I / 32) + size_t(nbuf) * 16;
}

// fp4_down_all_kernel's sums (the same bits) through a ring in shared memory: a fixed grid of
// CTAs (one an SM), each with a contiguous share of the row tiles. Its last warp is the producer:
// one thread bulk-copies units (one expert's 16-row tile: 16 * I / 2 weight bytes and 16 * I / 32
// scale bytes, contiguous in the checkpoint's layout: two copies) into nbuf slots, in rounds of G
// tiles, a round's units expert-major; with early (pdl 2) it reads idx and starts before the PDL
// wait, so the first units land while up finishes. The other warps form G groups of wg = I /
// (128 * SPW) warps; group h takes the CTA's tiles h, h + G, ... and all NE experts of each, warp
// w its K slice [w * 128 * SPW, ...) of every expert from the slots, with fp4_down_all_kernel's
// step (the weights and scale words from shared memory instead of global), then the tile's sums
// meet once in red (a named barrier of the group's) in that kernel's order: per expert warps in
// order then bf16, experts in slot order, + add, the post. A slot is free again once its group's
// wg warps have read it (empty: wg arrivals); a group's next unit comes G fills after its last,
// so with nbuf >= G the parity waits (the slot's use before released, then this use landed)
// cannot take an older use for this one. rows activation rows (the speculative verify rows) in
// turn: the producer streams row b's units after row b - 1's, the consumers quantize row b's
// activation once every consumer is done with row b - 1's (a barrier), so each row gets the bits
// of its one-row launch. sm_90 (bulk copies, mbarriers).
template <int SPW, int NE, int G, bool POST>
__global__ void __launch_bounds__(G == 2 ? 800 : 544, 1) fp4_down_ring_kernel(
    const __nv_bfloat16* act, const int64_t* idx, const uint8_t* w2, const uint8_t* s2,
    const __nv_bfloat16* add, void* y, int D, int I, int y_f32, int early,
    const __nv_bfloat16* res, const float* post, const float* comb, int nbuf, int rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int NS = NE * SPW;
  extern __shared__ __align__(128) uint8_t smem[];
  const int WG = I / (128 * SPW), NC = WG * G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int grp = warp / WG, wg = warp % WG;
  const size_t wrow = size_t(I) / 2, srow = size_t(I) / 32, slotb = 16 * (wrow + srow);
  uint4* xs;
  float *ef, *red;
  int xstride;
  const uint4* xq = expert_smem<NS>(smem, wg, WG, g, q, ef, red, xs, xstride);
  uint8_t* ring = smem + (expert_smem_bytes<NS>(WG, 2 * G * NE) + 127) / 128 * 128;
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + nbuf * slotb);
  uint64_t* empty = full + nbuf;
  if (threadIdx.x == 0) {
    for (int i = 0; i < nbuf; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], WG);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();   // the mbarriers, and expert_smem's zero operand
  const int tiles = D / 16;
  const int t0 = int(long(blockIdx.x) * tiles / gridDim.x);
  const int ntile = int(long(blockIdx.x + 1) * tiles / gridDim.x) - t0;
  if (warp == NC) {   // the producer
    if (lane == 0) {
      if (!early) pdl_wait();
      for (int b = 0, p = 0; b < rows; ++b) {
        int64_t e[NE];
#pragma unroll
        for (int j = 0; j < NE; ++j) e[j] = idx[size_t(b) * NE + j];
        for (int r = 0; r * G < ntile; ++r) {
          const int nr = min(G, ntile - r * G);
          for (int u = 0; u < NE * nr; ++u, ++p) {
            const int slot = p % nbuf;
            const size_t row0 = size_t(e[u / nr]) * D + size_t(t0 + r * G + u % nr) * 16;
            mbar_wait(&empty[slot], ((p / nbuf) & 1) ^ 1);
            mbar_expect(&full[slot], unsigned(slotb));
            bulk_g2s(ring + slot * slotb, w2 + row0 * wrow, unsigned(16 * wrow), &full[slot]);
            bulk_g2s(ring + slot * slotb + 16 * wrow, s2 + row0 * srow, unsigned(16 * srow),
                     &full[slot]);
          }
        }
      }
      if (early) pdl_wait();
    }
    return;
  }
  pdl_wait();   // the activation comes from up
  const int k0 = wg * 128 * SPW;
  for (int b = 0, n = 0; b < rows; ++b) {   // n: the group's tiles so far (red's parity)
    if (b > 0) asm volatile("bar.sync 1, %0;\n" ::"r"(NC * 32) : "memory");   // row b - 1's xs read
    if (grp == 0)
#pragma unroll
      for (int j = 0; j < NE; ++j)
        quant_slice<SPW, 0>(act + (size_t(b) * NE + j) * I + k0,
                            reinterpret_cast<uint16_t*>(xs + j * SPW * 16), ef + j * SPW, lane);
    asm volatile("bar.sync 1, %0;\n" ::"r"(NC * 32) : "memory");   // xs: the consumers
    const __nv_bfloat16 *addb = add, *resb = res;   // row b's operands, and its first unit
    void* yb = y;
    const float *postb = post, *combb = comb;
    down_row<POST>(b, D, y_f32, addb, yb, resb, postb, combb);
    const int pb = b * NE * ntile;
    for (int tl = grp; tl < ntile; tl += G, ++n) {
      const int r = tl / G, nr = min(G, ntile - r * G);
      float tot[NE][1][2];
#pragma unroll
      for (int j = 0; j < NE; ++j) {
        tot[j][0][0] = tot[j][0][1] = 0.0f;
        const int p = pb + r * G * NE + j * nr + grp, slot = p % nbuf;
        mbar_wait(&empty[slot], ((p / nbuf) & 1) ^ 1);
        mbar_wait(&full[slot], (p / nbuf) & 1);
        const uint8_t* sw = ring + slot * slotb + g * wrow + (k0 >> 5) * 16 + q * 16;
        const uint8_t* ss = ring + slot * slotb + 16 * wrow + g * srow + (k0 >> 5);
#pragma unroll
        for (int t = 0; t < SPW; ++t) {
          ExpertStep<1> st;
          st.wa[0] = *reinterpret_cast<const uint4*>(sw + t * 64);
          st.wb[0] = *reinterpret_cast<const uint4*>(sw + 8 * wrow + t * 64);
          st.sa[0] = *reinterpret_cast<const uint32_t*>(ss + 4 * t);
          st.sb[0] = *reinterpret_cast<const uint32_t*>(ss + 8 * srow + 4 * t);
          fp4_step<1, 0>(st, xq + (j * SPW + t) * xstride, ef[j * SPW + t], q, tot[j]);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);   // this warp is done with the slot
      }
      float* rp = red + (grp * 2 + (n & 1)) * WG * NE * 16;   // the group's buffer of this parity
      down_all_partial<NE>(tot, rp, wg, g, q);
      asm volatile("bar.sync %0, %1;\n" ::"r"(2 + grp), "r"(WG * 32) : "memory");
      if (wg == 0 && lane < 16)   // fp4_down_all_kernel's epilogue, the tile's rows
        down_all_finish<NE, POST>(rp, WG, lane, (t0 + tl) * 16, addb, yb, D, y_f32, resb, postb,
                                  combb);
    }
  }
#endif
}

template <int SPW, int NE, int G, bool POST>
cudaError_t down_ring_launch(const __nv_bfloat16* ap, const int64_t* ip, const uint8_t* wp,
                             const uint8_t* sp, const __nv_bfloat16* dp, void* y, int D, int I,
                             int y_f32, int early, const __nv_bfloat16* rp, const float* post,
                             const float* comb, int nbuf, int rows, int ctas, cudaStream_t st,
                             int pdl) {
  const int wg = I / (128 * SPW);
  int dev = 0, major = 0;   // bulk copies and mbarriers: sm_90 on (the kernel is empty below)
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      major < 9) {
    (void)cudaGetLastError();
    return cudaErrorNotSupported;
  }
  const size_t smem = down_ring_smem<SPW, NE, G>(wg, I, nbuf);
  const auto fn = fp4_down_ring_kernel<SPW, NE, G, POST>;
  const cudaError_t err = smem_opt_in(reinterpret_cast<const void*>(fn), smem);
  if (err != cudaSuccess) return err;
  return launch(fn, dim3(ctas), dim3(32 * (wg * G + 1)), smem, st, pdl, ap, ip, wp, sp, dp, y, D,
                I, y_f32, early, rp, post, comb, nbuf, rows);
}

}  // namespace

extern "C" {

// y [D] (float32 or bf16) from a [k, I] bf16; ws [k, D] float32 and cnt [D / 16] int32 (zeros,
// left zero) are the caller's workspace; add [D] bf16 or null. Grid (D / 16, k). all_experts:
// fp4_down_all_kernel instead (grid D / 16, no workspace; k 6 (Flash, Pro), dec 0, the (spw, depth)
// instantiated below). rows > 1 (all_experts only): rows activation rows, a [rows * k, I], idx
// [rows * k], add / y [rows, D]. ctas > 0 (all_experts, k 6, spw 2, dec 0; sm_90):
// fp4_down_ring_kernel on ctas CTAs (<= D / 16, one an SM) with depth (>= 2) ring slots, the
// rows in turn.
int dsv4_fp4_down(const void* act, const void* idx, const void* w2, const void* s2, const void* add,
                  void* y, void* ws, void* cnt, int D, int I, int k, int y_f32, int spw, int dec,
                  int depth, int all_experts, int rows, const void* res, const float* post,
                  const float* comb, int ctas, void* stream, int pdl) {
  const int warps = I / (128 * spw);
  if (warps < 1 || warps > 16 || D % 16 || I % (128 * spw) || k < 1 || rows < 1 ||
      (rows > 1 && !all_experts) ||
      (post != nullptr && (y_f32 || res == nullptr || comb == nullptr)))
    return -1;
  const auto* rp = static_cast<const __nv_bfloat16*>(res);
  const dim3 grid(D / 16, k), block(32 * warps);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const auto* ap = static_cast<const __nv_bfloat16*>(act);
  const auto* ip = static_cast<const int64_t*>(idx);
  const auto* wp = static_cast<const uint8_t*>(w2);
  const auto* sp = static_cast<const uint8_t*>(s2);
  const auto* dp = static_cast<const __nv_bfloat16*>(add);
  auto* wsp = static_cast<float*>(ws);
  auto* cp = static_cast<int*>(cnt);
  const int early = pdl == 2;
#define DSV4_DOWN_P(S, DC, R, P) \
  launch(fp4_down_kernel<S, DC, R, P>, grid, block, expert_smem_bytes<S>(warps, 1), st, pdl, ap, \
         ip, wp, sp, dp, y, wsp, cp, D, I, k, y_f32, early, rp, post, comb)
#define DSV4_DOWN(S, DC, R) \
  (post != nullptr ? DSV4_DOWN_P(S, DC, R, true) : DSV4_DOWN_P(S, DC, R, false))
#define DSV4_DOWN_ALL_P(S, E, R, P) \
  launch(fp4_down_all_kernel<S, E, 0, R, P>, dim3(D / 16, rows), block, \
         expert_smem_bytes<S * E>(warps, E), st, pdl, ap, ip, wp, sp, dp, y, D, I, y_f32, early, \
         rp, post, comb)
#define DSV4_DOWN_ALL(S, E, R) \
  (post != nullptr ? DSV4_DOWN_ALL_P(S, E, R, true) : DSV4_DOWN_ALL_P(S, E, R, false))
  if (ctas > 0) {   // the ring kernel: ctas CTAs, depth slots
    const int wg = warps, g2 = wg * 2 + 1 <= 25;
    if (!all_experts || dec != 0 || k != 6 || spw != 2 || depth < 2 || ctas > D / 16)
      return -1;
#define DSV4_DOWN_RING(G, P)                                                                     \
  down_ring_launch<2, 6, G, P>(ap, ip, wp, sp, dp, y, D, I, y_f32, early, rp, post, comb, depth, \
                               rows, ctas, st, pdl)
    (void)wg;
    if (g2) return post != nullptr ? DSV4_DOWN_RING(2, true) : DSV4_DOWN_RING(2, false);
    return post != nullptr ? DSV4_DOWN_RING(1, true) : DSV4_DOWN_RING(1, false);
#undef DSV4_DOWN_RING
  }
  if (all_experts) {
    if (dec != 0) return -1;
    switch ((k * 10 + spw) * 100 + (depth > 0 ? depth : spw)) {
      case 6202: return DSV4_DOWN_ALL(2, 6, 2);
      case 6204: return DSV4_DOWN_ALL(2, 6, 4);
      case 6206: return DSV4_DOWN_ALL(2, 6, 6);
      case 6404: return DSV4_DOWN_ALL(4, 6, 4);
      default: return -1;
    }
  }
  switch (expert_variant(spw, dec, depth)) {
    case expert_variant(1, 0, 1): return DSV4_DOWN(1, 0, 1);
    case expert_variant(2, 0, 2): return DSV4_DOWN(2, 0, 2);
    case expert_variant(2, 0, 1): return DSV4_DOWN(2, 0, 1);
    case expert_variant(4, 0, 4): return DSV4_DOWN(4, 0, 4);
    case expert_variant(4, 0, 2): return DSV4_DOWN(4, 0, 2);
    case expert_variant(2, 1, 2): return DSV4_DOWN(2, 1, 2);
    default: return -1;
  }
#undef DSV4_DOWN
#undef DSV4_DOWN_P
#undef DSV4_DOWN_ALL
#undef DSV4_DOWN_ALL_P
}

}  // extern "C"
