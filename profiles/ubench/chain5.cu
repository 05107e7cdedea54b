// Microbenchmark (not part of the library): chain4's FP8 chain with tensor-core consumers. chain4's
// consumers (a warp a row, e4m3 pairs to f16x2 on CUDA cores, x read from shared memory as float)
// ran at 40-42% of the read, persistent or not, so its ring stayed full and a latency-bound step
// between two stages was not hidden (BENCHMARKS.md, the twenty-second session). Here a warp takes
// a unit of 16 rows x 1,024 K through mma.sync m16n8k16 (e4m3 -> f16 in registers, x as f16, f32
// accumulation; the 8 columns of B all x, column 0 kept), from a tile-packed copy of the weights
// (a load-time layout: each unit's 16 KB contiguous, so one bulk copy fills a ring slot and a
// warp's 16-byte reads of it are conflict-free). The questions: do these consumers outrun the
// memory (mode 3: the ring's units consumed again and again, no producer); one stage of all rows
// against the read; what a dependency costs then; and whether the producer's streaming (a ring of
// up to 192 KB an SM, 25 MB over 132 SMs, more than a 16.8 MB stage) hides a latency-bound step
// between two stages, where a graph of PDL launches pays it. Against a graph of PDL launches of
// the same unit GEMV reading global memory, the partial sums checked bit for bit against it, and
// stage 0 against a float64 host reference. Then (`chain5 RINGS... -- PF...`) the producer also
// asks for units PF uses ahead of the one it copies into L2 (one bulk prefetch a unit): a CTA's
// share of a 16.8 MB stage is 8 units and its ring holds 8-12, so without it the rest of the next
// stage is read from memory only after the consumers free their slots, behind the dependency; with
// it that rest comes from L2. `chain5 RINGS -- PF... -- PACE...`: the producer's copies at least
// PACE ns apart (no catching up after a wait), alone and with each PF: does a stream that keeps a
// whole stage of requests in flight queue the grid barrier and x's reload behind them? After each
// chained run, the timeline of one more (TL_*: a CTA's clock64 at each phase of a stage) says
// where a dependent stage's time goes. And each chained run again with no grid barrier (MODE 7):
// the partials as 64-bit words tagged with their stage (value and tag in one store, as NCCL's LL
// protocol), the next stage's x read from them once tagged: one loaded L2 round trip a dependency
// in place of the barrier's arrival, its poll and x's reload. Build and run:
// profiles/ubench/run.sh chain5
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <string>
#include <algorithm>
#include <climits>
#include <vector>

#include "fp8chain.cuh"

constexpr int STHREADS = 256;   // the PDL stage kernel's block (168 registers: one an SM)
constexpr int CONS = 8;         // the persistent kernel's consumer warps (+ one producer warp)
constexpr int KC = 1024;        // a unit's K: 16 rows x KC e4m3 = 16 KB
constexpr int UNITB = 16 * KC;
constexpr int CHUNKS = KD / KC; // units a 16-row tile

// packed layout of a unit (tile T, chunk c): [b: KC / 64][r: 16][j: 64] = W[16T + r][c KC + 64b + j]

__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t v16) {
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(static_cast<unsigned short>(v16)));
  return r;
}

// one 64-K block b of a unit into c: lane (g = lane / 4, t = lane % 4) holds bytes 16t..16t+15 of
// rows g and g + 8 (wa, wb); mma step s takes their s-th word: its bytes are K = 16t + 4s + 0..3,
// which the step reads as the MMA's k = 2t, 2t+1 (the word's low half) and 2t+8, 2t+9 (its high
// half), for A (the rows) and B (x at the same K, in every column) alike
__device__ __forceinline__ void block_mma(float* c, uint4 wa, uint4 wb, const __half* xb) {
  const int t = threadIdx.x & 3;
  const uint4 x0 = *reinterpret_cast<const uint4*>(xb + 16 * t);
  const uint4 x1 = *reinterpret_cast<const uint4*>(xb + 16 * t + 8);
  const uint32_t A[4] = {wa.x, wa.y, wa.z, wa.w}, B[4] = {wb.x, wb.y, wb.z, wb.w};
  const uint32_t X[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
  for (int s = 0; s < 4; ++s)
    mma16816(c, e4m3x2_f16x2(A[s] & 0xFFFFu), e4m3x2_f16x2(B[s] & 0xFFFFu), e4m3x2_f16x2(A[s] >> 16),
             e4m3x2_f16x2(B[s] >> 16), X[2 * s], X[2 * s + 1]);
}

// a unit's partial sums of rows g and g + 8 (x: the chunk's KC halves; sc: the chunk's KC / 128
// block scales of the tile's rows); load(b, r) -> the lane's 16 bytes of row r in block b. Two
// accumulators (even and odd blocks) for two MMA chains in flight; the same order in every kernel
template <typename Load>
__device__ __forceinline__ float2 unit_dot(Load load, const __half* x, const float* sc) {
  const int g = (threadIdx.x & 31) >> 2;
  float p0 = 0.f, p1 = 0.f;
#pragma unroll
  for (int grp = 0; grp < KC / 128; ++grp) {
    float ca[4] = {0.f, 0.f, 0.f, 0.f}, cb[4] = {0.f, 0.f, 0.f, 0.f};
    block_mma(ca, load(2 * grp, g), load(2 * grp, g + 8), x + 128 * grp);
    block_mma(cb, load(2 * grp + 1, g), load(2 * grp + 1, g + 8), x + 128 * grp + 64);
    const float s = __ldg(sc + grp);
    p0 = fmaf(ca[0] + cb[0], s, p0);
    p1 = fmaf(ca[2] + cb[2], s, p1);
  }
  return make_float2(p0, p1);
}

// x of a stage into shared memory as f16: x0 (float [K]), or y of the stage before (partials
// [K][CHUNKS], summed in chunk order)
__device__ __forceinline__ void load_xh(const float* x, bool partials, __half* xh, int K, int nthreads) {
  for (int i = threadIdx.x; i < K; i += nthreads) xh[i] = __float2half_rn(y_at(x, partials ? CHUNKS : 1, i));
}

// a unit's partials into part [N][CHUNKS] (the lanes with t == 0 hold rows g and g + 8)
__device__ __forceinline__ void store_unit(float* part, int u, float2 p) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tile = u / CHUNKS, c = u % CHUNKS;
  if ((lane & 3) == 0) {
    part[size_t(tile * 16 + g) * CHUNKS + c] = p.x;
    part[size_t(tile * 16 + g + 8) * CHUNKS + c] = p.y;
  }
}

// MODE 7's partials: part's values as 64-bit words, the float's bits low and the stage's tag
// high, each written by one store (so a reader that sees the tag sees the value), and x read from
// them once every word of a value carries the tag: no grid barrier
__device__ __forceinline__ void store_unit_ll(unsigned long long* ll, int u, float2 p, unsigned tag) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tile = u / CHUNKS, c = u % CHUNKS;
  if ((lane & 3) == 0) {
    const unsigned long long hi = static_cast<unsigned long long>(tag) << 32;
    __stcg(ll + size_t(tile * 16 + g) * CHUNKS + c, hi | __float_as_uint(p.x));
    __stcg(ll + size_t(tile * 16 + g + 8) * CHUNKS + c, hi | __float_as_uint(p.y));
  }
}
__device__ __forceinline__ bool tagged(ulonglong2 w, unsigned tag) {
  return unsigned(w.x >> 32) == tag && unsigned(w.y >> 32) == tag;
}
__device__ __forceinline__ float lo_f(unsigned long long w) { return __uint_as_float(unsigned(w)); }
// x of a stage as f16 from MODE 7's words: a thread's values B at a time, their words requested
// together, then each re-read (volatile) until it carries the tag; summed in load_xh's order
__device__ __forceinline__ void load_xh_ll(const unsigned long long* ll, unsigned tag, __half* xh, int K, int nthreads) {
  constexpr int B = 8;
  for (int i0 = threadIdx.x; i0 < K; i0 += B * nthreads) {
    ulonglong2 w[B][2];
#pragma unroll
    for (int e = 0; e < B; ++e) {
      const int i = i0 + e * nthreads;
      if (i < K) {
        const ulonglong2* q = reinterpret_cast<const ulonglong2*>(ll + size_t(i) * CHUNKS);
        w[e][0] = __ldcv(q);
        w[e][1] = __ldcv(q + 1);
      }
    }
#pragma unroll
    for (int e = 0; e < B; ++e) {
      const int i = i0 + e * nthreads;
      if (i >= K) continue;
      const ulonglong2* q = reinterpret_cast<const ulonglong2*>(ll + size_t(i) * CHUNKS);
      while (!tagged(w[e][0], tag)) w[e][0] = __ldcv(q);
      while (!tagged(w[e][1], tag)) w[e][1] = __ldcv(q + 1);
      xh[i] = __float2half_rn(((lo_f(w[e][0].x) + lo_f(w[e][0].y)) + lo_f(w[e][1].x)) + lo_f(w[e][1].y));
    }
  }
}

// one stage as its own launch (PDL): a warp a unit, units strided over the grid's warps; the
// warp's first unit's first two blocks requested before griddepcontrol.wait
__global__ void __launch_bounds__(STHREADS, 1) stage_fp8(const uint8_t* W, const float* S, const float* x,
                                                      bool partials, float* part, int N, int K) {
  __shared__ __align__(16) __half xh[KD];
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
  const int lane = threadIdx.x & 31, t = lane & 3, units = N / 16 * CHUNKS;
  auto at = [&](int u, int b, int r) { return W + size_t(u) * UNITB + b * 1024 + r * 64 + 16 * t; };
  uint4 first[4];
  if (gw < units) {
    first[0] = ldg_na(at(gw, 0, lane >> 2)); first[1] = ldg_na(at(gw, 0, (lane >> 2) + 8));
    first[2] = ldg_na(at(gw, 1, lane >> 2)); first[3] = ldg_na(at(gw, 1, (lane >> 2) + 8));
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  load_xh(x, partials, xh, K, blockDim.x);
  __syncthreads();
  for (int u = gw; u < units; u += nw) {
    const int tile = u / CHUNKS, c = u % CHUNKS;
    const float* sc = S + size_t(tile * 16 / 128) * (K / 128) + c * (KC / 128);
    const float2 p = unit_dot([&](int b, int r) {
      if (u == gw && b < 2) return first[2 * b + (r >= 8)];
      return ldg_na(at(u, b, r));
    }, xh + c * KC, sc);
    store_unit(part, u, p);
  }
}

// the persistent kernel's timeline (chain5 ... with a run of MODE 1 given tl): a CTA's clock64 at
// each stage's start (after the barrier before it), x loaded, each consumer warp's unit ready (its
// ring wait passed) and done (released), the consumers' sync before the barrier, the barrier
// passed; the producer's acquire of the stage's first and last slot (before its copy)
enum { TL_START, TL_X, TL_READY, TL_DONE = TL_READY + CONS, TL_SYNC = TL_DONE + CONS, TL_BAR, TL_P0, TL_P1, TLW };

// all stages in one kernel: tiles split evenly over the CTAs, the producer warp (warp CONS)
// streams this CTA's units of every stage through a ring of nbuf 16 KB slots (one bulk copy a
// unit); the consumers take units j = warp, warp + CONS, ... (nbuf >= CONS, any: Ring::wait_after)
// MODE 1: stage s > 0 reads y of stage s - 1 after a grid barrier (N == K, else x0, as the graph's
// stages do; the barrier still orders the stages); 2: as 1 through the latency-bound step (CTA 0 runs
// gap_norm into xn and raises `flag`); 3: no producer after the ring's first fill: the consumers
// take the ring's units again and again (M stages' worth), no barrier, x0 throughout: the
// consumers' own speed; 4: no weights (no units), the M stages' grid barriers and x's reload from
// the partials of the stage before (L2); 5: as 4 without the reload (x0 once); 6: as 1 with x
// handed over: the last unit of a row tile to finish (a ticket a tile) sums the tile's partials
// and writes its 16 values of x as f16 (xg), so after the barrier each CTA loads K halves (8 KB)
// instead of reducing K x 4 partials (64 KB); 7: as 1 with no grid barrier: the partials also as
// tagged 64-bit words (ll: store_unit_ll, the tag epoch * M + s + 1), x of the next stage read
// from them once tagged (load_xh_ll). M = 1: one stage, the floor of this kernel.
// pf > 0 (modes 1, 2 and 6): before copying use u, the producer asks for use u + pf (and every use
// up to it not yet asked for) to be brought into L2.
template <int MODE>
__global__ void __launch_bounds__((CONS + 1) * 32, 1) chain_fp8(const uint8_t* const* Ws, const float* const* Ss,
                                                                const float* x0, float* parts, int M, int N, int K,
                                                                int nbuf, unsigned* bar, unsigned epoch,
                                                                float* xn, unsigned* flag, __half* xg,
                                                                unsigned* tick, int pf, long long* tl, int pace,
                                                                unsigned long long* ll) {
  constexpr bool GAP = MODE == 2, SOLO = MODE == 3, EMPTY = MODE == 4 || MODE == 5, RELOAD = MODE != 5, LL = MODE == 7;
  const bool handoff = MODE == 6 && N == K;
  extern __shared__ __align__(128) unsigned char sm[];
  Ring g = ring_init(sm, K, size_t(UNITB), nbuf);      // xs: K floats of room, used as K halves
  __half* xh = reinterpret_cast<__half*>(g.xs);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  int t0, t1;
  even_rows(N / 16, t0, t1);
  const int units = EMPTY ? 0 : (t1 - t0) * CHUNKS, u0 = t0 * CHUNKS;
  // the timeline (tl, MODE 1): clock64 stamps [CTA][stage][TLW] (see TL_*)
  auto stamp = [&](int s, int k) { return (size_t(blockIdx.x) * M + s) * TLW + k; };
  if (warp == CONS) {
    if (lane == 0) {
      const int total = (SOLO ? 1 : M) * units;
      auto src = [&](int use) { return Ws[use / max(units, 1)] + size_t(u0 + use % max(units, 1)) * UNITB; };
      int asked = 1;             // uses up to here asked for (use 0 is copied at once)
      long long issued = 0;      // the clock of the last copy (pacing)
      int use = 0;
      for (int s = 0; s < (SOLO ? 1 : M); ++s)
        for (int j = 0; j < (SOLO ? min(units, nbuf) : units); ++j, ++use) {
          if (!SOLO && !EMPTY && pf > 0)
            for (; asked < total && asked <= use + pf; ++asked) l2_bulk_prefetch(src(asked), UNITB);
          const int slot = g.acquire(use);
          if (pace > 0) {         // at least pace cycles after the copy before
            long long now;
            while ((now = clock64()) < issued + pace) {}
            issued = now;
          }
          if (tl && (j == 0 || j == units - 1)) tl[stamp(s, j == 0 ? TL_P0 : TL_P1)] = clock64();
          g.fill(slot, src(use));
        }
    }
    return;
  }
  if (SOLO)                       // every warp reads every filled slot: wait for them all
    for (int j = 0; j < min(units, nbuf); ++j) g.wait(j);
  for (int s = 0; s < M; ++s) {
    if (tl && threadIdx.x == 0) tl[stamp(s, TL_START)] = clock64();
    if (s == 0 || (!SOLO && RELOAD)) {
      const bool first = s == 0 || SOLO || N != K;   // x0 (unchained: every stage, as the graph)
      const float* x = first ? x0 : GAP ? xn + size_t(s - 1) * K : parts + size_t(s - 1) * N * CHUNKS;
      if (LL && !first) {
        load_xh_ll(ll + size_t(s - 1) * N * CHUNKS, epoch * M + s, xh, K, CONS * 32);
      } else if (handoff && !first) {
        const __half* src = xg + size_t(s - 1) * K;
        for (int i = 8 * threadIdx.x; i < K; i += 8 * CONS * 32)
          *reinterpret_cast<uint4*>(xh + i) = __ldcg(reinterpret_cast<const uint4*>(src + i));
      } else {
        load_xh(x, !first && !GAP, xh, K, CONS * 32);
      }
      cons_sync<CONS>();
    }
    if (tl && threadIdx.x == 0) tl[stamp(s, TL_X)] = clock64();
    float* part = parts + size_t(SOLO ? 0 : s) * N * CHUNKS;
    for (int j = warp; j < units; j += CONS) {
      const int u = u0 + j, tile = u / CHUNKS, c = u % CHUNKS;
      const int slot = SOLO ? j % min(units, nbuf) : g.wait_after(s * units + j);
      if (tl && lane == 0 && j < CONS) tl[stamp(s, TL_READY + warp)] = clock64();
      const unsigned char* row = static_cast<const unsigned char*>(g.row(slot));
      const float* sc = Ss[SOLO ? 0 : s] + size_t(tile * 16 / 128) * (K / 128) + c * (KC / 128);
      const float2 p = unit_dot([&](int b, int r) {
        return *reinterpret_cast<const uint4*>(row + b * 1024 + r * 64 + 16 * t);
      }, xh + c * KC, sc);
      __syncwarp();
      if (!SOLO && lane == 0) g.release(slot);
      if (tl && lane == 0 && j < CONS) tl[stamp(s, TL_DONE + warp)] = clock64();
      store_unit(part, u, p);
      if (LL && s + 1 < M) store_unit_ll(ll + size_t(s) * N * CHUNKS, u, p, epoch * M + s + 1);
      if (handoff && s + 1 < M) {   // the tile's last unit: its 16 values of x for the next stage
        __threadfence();
        __syncwarp();
        unsigned last = 0;
        if (lane == 0) last = atomicAdd(tick + size_t(s) * (N / 16) + tile, 1u) % CHUNKS == CHUNKS - 1;
        if (__shfl_sync(0xffffffffu, last, 0)) {
          __threadfence();
          if (lane < 16) xg[size_t(s) * K + tile * 16 + lane] = __float2half_rn(y_at(part, CHUNKS, tile * 16 + lane));
        }
      }
    }
    if (SOLO || s + 1 == M) continue;
    cons_sync<CONS>();
    if (tl && threadIdx.x == 0) tl[stamp(s, TL_SYNC)] = clock64();
    if (LL) {                       // no barrier: x's words say when they are there
      if (tl && threadIdx.x == 0) tl[stamp(s, TL_BAR)] = clock64();
      continue;
    }
    if (threadIdx.x == 0) grid_wait(bar, (epoch * (M - 1) + s + 1) * gridDim.x);
    cons_sync<CONS>();
    if (tl && threadIdx.x == 0) tl[stamp(s, TL_BAR)] = clock64();
    if (GAP) gap_in_grid<CONS>(parts + size_t(s) * N * CHUNKS, CHUNKS, xn + size_t(s) * K, K, flag,
                                epoch * (M - 1) + s + 1);
  }
}

int main(int argc, char** argv) {   // argv: the ring sizes in units (default 8 12), then -- and the
  std::vector<int> nbufs, pfs, paces; // producer's L2 prefetch distances in units (default none), then
  int group = 0;                      // -- and its pacing: the least ns between two of its copies
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") { ++group; continue; }
    (group == 0 ? nbufs : group == 1 ? pfs : paces).push_back(atoi(argv[i]));
  }
  if (nbufs.empty()) nbufs = {8, 12};
  const int sms = chain_start("chain5: FP8 units on mma.sync, persistent producer + ring against PDL launches");
  Timer T;
  const cudaStream_t st = T.st;
  constexpr int COPIES = Fp8Case::COPIES;
  for (const ChainCfg& c : FP8_CHAINS) {
    if (c.K != KD || c.N % 128) { printf("K = %d, N = %d: the kernels take K = %d, N a multiple of 128\n", c.K, c.N, KD); return 1; }
    Fp8Case C(c.M, c.N, c.K, true);        // x as the kernels hold it: f16
    std::vector<uint8_t> hp(C.bytes);      // the tile-packed copy of each matrix
    for (int m = 0; m < c.M; ++m)
      for (int r = 0; r < c.N; ++r)
        for (int k = 0; k < c.K; ++k) {
          const int tile = r / 16, ch = k / KC, b = (k % KC) / 64, j = k % 64;
          hp[m * C.per + size_t(tile * CHUNKS + ch) * UNITB + b * 1024 + (r % 16) * 64 + j] = C.hw[m * C.per + size_t(r) * c.K + k];
        }
    C.upload(hp);
    const size_t np = size_t(c.N) * CHUNKS;   // a stage's partials
    float *ps, *ps2;
    CK(cudaMalloc(&ps, c.M * np * 4)); CK(cudaMalloc(&ps2, c.M * np * 4));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, stage_fp8, STHREADS, 0));
    const int grid0 = sms * std::max(occ, 1);
    const bool chained = c.N == c.K;
    // stage i reads x0, y of stage i - 1 (its partials), or (gap) the step's xn of it
    auto capture = [&](int k, bool gap, bool gaps_only) {
      return capture_chain(st, c.M, gap, gaps_only, [&](int i, bool gp) {
        const bool first = i == 0 || !chained;
        const float* x = first ? C.x0 : gp ? C.xn + size_t(i - 1) * c.K : ps + size_t(i - 1) * np;
        Launch L(dim3(grid0), dim3(STHREADS), 0, st);
        L(stage_fp8, C.W(k, i), C.S(k, i), x, !first && !gp, ps + size_t(i) * np, c.N, c.K);
      }, [&](int i) {
        Launch L(dim3(1), dim3(CONS * 32), 0, st);
        L(gap_kernel<CONS>, ps + size_t(i - 1) * np, CHUNKS, C.xn + size_t(i - 1) * c.K, c.K);
      });
    };
    // one launch of all M * N rows (the floor of this GEMV, no dependency); its partials fill ps
    const float t_one_g = T.time([&](int i) {
      Launch L(dim3(grid0), dim3(STHREADS), 0, st, false);
      L(stage_fp8, C.W(i % COPIES, 0), C.S(i % COPIES, 0), static_cast<const float*>(C.x0), false, ps, c.N * c.M, c.K);
    });
    const ChainGraphs G = time_graphs(T, c.M, chained, capture, ps, c.M * np);
    const std::vector<float>& ref = G.ref;
    const float t_graph = G.graph;
    const double err = C.err([&](int r) {   // stage 0 (its partials summed) against float64
      const float* p = &ref[size_t(r) * CHUNKS];
      return double(((p[0] + p[1]) + p[2]) + p[3]);
    });
    const float t_read = T.read(C.w, C.bytes, COPIES, C.bytes, sms);
    printf("%d stages of %d x %d FP8 (%.1f MB each, %.1f MB): read alone %.1f us (%.2f TB/s); stage 0 against "
           "float64: max err / max |y| %.1e\n", c.M, c.N, c.K, C.per / 1e6, C.bytes / 1e6, t_read, C.bytes / t_read / 1e6, err);
    printf("  PDL launches (%d CTAs of %d): one of all rows %.1f us (%.0f%% of the read) | a graph of %d %.1f us (%.2f us a dependency)\n",
           grid0, STHREADS, t_one_g, 100.0 * t_read / t_one_g, c.M, t_graph, (t_graph - t_one_g) / (c.M - 1));
    if (chained) print_graph_step(G, c.M);
    for (int nbuf : nbufs) {
      if (nbuf < CONS) { printf("  ring %d: the kernel takes at least %d units (its consumer warps)\n", nbuf, CONS); continue; }
      const size_t smem = size_t(c.K) * 4 + size_t(nbuf) * UNITB + size_t(nbuf) * 16;
      CK(cudaFuncSetAttribute(chain_fp8<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<5>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<7>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      const int threads = (CONS + 1) * 32;
      unsigned epoch = 0;
      CK(cudaMemset(C.bar, 0, 4)); CK(cudaMemset(C.flag, 0, 4));
      __half* xg;
      unsigned* tick;            // a ticket a row tile and stage, never reset (CHUNKS arrivals a run)
      CK(cudaMalloc(&xg, size_t(c.M) * c.K * 2));
      CK(cudaMalloc(&tick, size_t(c.M) * (c.N / 16) * 4));
      CK(cudaMemset(tick, 0, size_t(c.M) * (c.N / 16) * 4));
      int pf = 0;                // the producer's L2 prefetch distance of the runs below
      long long* tlp = nullptr;  // the timeline of one run (timeline() below)
      unsigned long long* llw;   // MODE 7's tagged partials (tags never repeat: the epoch grows)
      CK(cudaMalloc(&llw, size_t(c.M) * c.N * CHUNKS * 8));
      CK(cudaMemset(llw, 0, size_t(c.M) * c.N * CHUNKS * 8));
      int pace = 0;              // the producer's pacing of the runs below (cycles)
      auto run = [&](auto kern, int k, int M, int N, unsigned* b, unsigned ep) {
        kern<<<sms, threads, smem, st>>>(C.Ws(k), C.Ss(k), C.x0, ps2, M, N, c.K, nbuf, b, ep, C.xn2, C.flag, xg, tick, pf,
                                         tlp, pace, llw);
      };
      // the consumers alone: M stages' worth of units from the ring's one fill
      const float t_solo = T.time([&](int i) { run(chain_fp8<3>, i % COPIES, c.M, c.N, C.bar, 0); });
      // the floor: one stage of all M * N rows
      const float t_one = T.time([&](int i) { run(chain_fp8<1>, i % COPIES, 1, c.N * c.M, C.bar, 0); });
      const float t_dep = T.time([&](int i) { run(chain_fp8<1>, i % COPIES, c.M, c.N, C.bar, epoch++); });
      auto check = [&](const std::vector<float>& want) {
        CK(cudaStreamSynchronize(st));
        return fetch(ps2, want.size()) == want ? "yes" : "NO";
      };
      CK(cudaMemset(ps2, 0xFF, ref.size() * 4));
      run(chain_fp8<1>, 0, c.M, c.N, C.bar, epoch++);
      const char* same = check(ref);
      // where a dependent stage's time goes: one run with the timeline, the phases of stages 1 ..
      // M - 1 of every CTA holding CONS units (the median over them; the worst CTA's median)
      unsigned llep = 0;         // MODE 7's epochs: its own (it never arrives at the barrier, whose target the epoch sets)
      auto timeline = [&](auto kern, unsigned& ep, const char* what) {
        if (!chained || c.M < 3) return;
        const size_t n = size_t(sms) * c.M * TLW;
        long long* d;
        CK(cudaMalloc(&d, n * 8));
        CK(cudaMemset(d, 0, n * 8));
        tlp = d;
        run(kern, 0, c.M, c.N, C.bar, ep++);
        tlp = nullptr;
        CK(cudaStreamSynchronize(st));
        std::vector<long long> h(n);
        CK(cudaMemcpy(h.data(), d, n * 8, cudaMemcpyDeviceToHost));
        CK(cudaFree(d));
        int khz = 0;
        CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
        const double us = 1e3 / khz;    // a cycle in us (the clock's rated rate)
        enum { RELOAD, LATE, UNIT, SPAN, TAIL, BAR, PERIOD, READ, NPH };
        const char* names[NPH] = {"x's reload", "data late after x", "a warp's unit", "x to the last unit done",
                                  "store + sync", "grid barrier", "stage period", "producer: stage's first copy to x"};
        std::vector<double> all[NPH], worst[NPH];
        auto med = [](std::vector<double> v) { if (v.empty()) return 0.0; std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
        for (int b = 0; b < sms; ++b) {
          std::vector<double> mine[NPH];
          for (int s = 1; s + 1 < c.M; ++s) {
            const long long* T = &h[(size_t(b) * c.M + s) * TLW];
            bool full = true;
            for (int w = 0; w < CONS; ++w) full = full && T[TL_READY + w] && T[TL_DONE + w];
            if (!full) continue;       // a CTA with fewer units than warps
            long long late = LLONG_MIN, last = 0;
            for (int w = 0; w < CONS; ++w) {
              late = std::max(late, T[TL_READY + w] - T[TL_X]);
              last = std::max(last, T[TL_DONE + w]);
              mine[UNIT].push_back((T[TL_DONE + w] - std::max(T[TL_READY + w], T[TL_X])) * us);
            }
            mine[RELOAD].push_back((T[TL_X] - T[TL_START]) * us);
            mine[LATE].push_back(std::max(0LL, late) * us);
            mine[SPAN].push_back((last - T[TL_X]) * us);
            mine[TAIL].push_back((T[TL_SYNC] - last) * us);
            mine[BAR].push_back((T[TL_BAR] - T[TL_SYNC]) * us);
            mine[PERIOD].push_back((T[TLW + TL_START] - T[TL_START]) * us);
            mine[READ].push_back((T[TL_X] - T[TL_P0]) * us);
          }
          for (int k = 0; k < NPH; ++k) {
            all[k].insert(all[k].end(), mine[k].begin(), mine[k].end());
            if (!mine[k].empty()) worst[k].push_back(med(mine[k]));
          }
        }
        printf("    timeline (%s; stages 1-%d, us: median | the worst CTA's median):", what, c.M - 2);
        for (int k = 0; k < NPH; ++k)
          printf("%s %s %.2f | %.2f", k ? ";" : "", names[k], med(all[k]),
                 worst[k].empty() ? 0.0 : *std::max_element(worst[k].begin(), worst[k].end()));
        printf("\n");
      };
      printf("  persistent, ring %2d units (%3zu KB): the consumers alone %.1f us (%.2f TB/s of units) | one stage of all "
             "rows %.1f us (%.0f%% of the read) | %d stages with the dependency %.1f us (%.2f us a dependency) | same bits %s\n",
             nbuf, smem / 1024, t_solo, C.bytes / t_solo / 1e6, t_one, 100.0 * t_read / t_one, c.M, t_dep,
             (t_dep - t_one) / (c.M - 1), same);
      timeline(chain_fp8<1>, epoch, "no prefetch");
      // the same chain with x's words tagged in place of the grid barrier
      auto ll_chain = [&](const char* what, float t_floor) {
        if (!chained) return;
        const float t_ll = T.time([&](int i) { run(chain_fp8<7>, i % COPIES, c.M, c.N, C.bar, llep++); });
        CK(cudaMemset(ps2, 0xFF, ref.size() * 4));
        run(chain_fp8<7>, 0, c.M, c.N, C.bar, llep++);
        const char* same_ll = check(ref);
        printf("    tagged partials, no grid barrier (%s): %d stages %.1f us (%.2f us a dependency) | same bits %s\n", what,
               c.M, t_ll, (t_ll - t_floor) / (c.M - 1), same_ll);
        timeline(chain_fp8<7>, llep, (std::string("tagged, ") + what).c_str());
      };
      ll_chain("no prefetch", t_one);
      if (chained) {   // x handed over by each row tile's last unit
        const float t_hand = T.time([&](int i) { run(chain_fp8<6>, i % COPIES, c.M, c.N, C.bar, epoch++); });
        CK(cudaMemset(ps2, 0xFF, ref.size() * 4));
        run(chain_fp8<6>, 0, c.M, c.N, C.bar, epoch++);
        const char* same6 = check(ref);
        printf("    x handed over (a row tile's last unit writes its x as f16; 8 KB a CTA after the barrier): %d stages "
               "%.1f us (%.2f us a dependency) | same bits %s\n", c.M, t_hand, (t_hand - t_one) / (c.M - 1), same6);
      }
      CK(cudaFree(xg)); CK(cudaFree(tick));
      // what a dependency is made of: the grid barriers alone (M stages, no weights) against one
      // stage's launch, then with x's reload from the partials of the stage before
      const float b1 = T.time([&](int i) { run(chain_fp8<5>, 0, 1, c.N, C.bar, 0); });
      const float bM = T.time([&](int i) { run(chain_fp8<5>, 0, c.M, c.N, C.bar, epoch++); });
      const float rM = chained ? T.time([&](int i) { run(chain_fp8<4>, 0, c.M, c.N, C.bar, epoch++); }) : 0.f;
      printf("    no weights: one stage %.1f us | a grid barrier %.2f us", b1, (bM - b1) / (c.M - 1));
      if (chained) printf(" | with x's reload from the partials %.2f us", (rM - b1) / (c.M - 1));
      printf("\n");
      if (chained)
        time_gap_chain(T, c.M, [&](int k, unsigned* b, unsigned ep) { run(chain_fp8<2>, k, c.M, c.N, b, ep); }, ps2, G,
                       C.flag, t_dep);
      // the producer asking for the units pf ahead into L2, or pacing its copies: the chain, then
      // through the step
      std::vector<std::pair<int, int>> variants;     // (pf, pace): each given, and every pair
      for (int p : pfs) variants.push_back({p, 0});
      for (int q : paces) variants.push_back({0, q});
      for (int p : pfs)
        for (int q : paces) variants.push_back({p, q});
      int khz = 0;
      CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
      for (auto [p, q] : variants) {
        pf = p;
        pace = int(double(q) * khz / 1e6);
        const std::string what = (p ? "L2 prefetch " + std::to_string(p) : std::string()) + (p && q ? ", " : "") +
                                 (q ? "copies paced " + std::to_string(q) + " ns" : std::string());
        const float t_one_pf = T.time([&](int i) { run(chain_fp8<1>, i % COPIES, 1, c.N * c.M, C.bar, 0); });
        const float t_pf = T.time([&](int i) { run(chain_fp8<1>, i % COPIES, c.M, c.N, C.bar, epoch++); });
        CK(cudaMemset(ps2, 0xFF, ref.size() * 4));
        run(chain_fp8<1>, 0, c.M, c.N, C.bar, epoch++);
        const char* same_pf = check(ref);
        printf("   ");
        if (p) printf(" L2 prefetch %2d units ahead (%.1f MB over the grid)", p, double(p) * UNITB * sms / 1e6);
        if (q) printf(" copies paced >= %d ns apart (%.2f TB/s over the grid at most)", q, double(UNITB) * sms / q / 1e3);
        printf(": one stage of all rows %.1f us (%.0f%% of the read) | %d stages %.1f us (%.0f%% of the read; %.2f us a "
               "dependency) | same bits %s\n", t_one_pf, 100.0 * t_read / t_one_pf, c.M, t_pf, 100.0 * t_read / t_pf,
               (t_pf - t_one_pf) / (c.M - 1), same_pf);
        timeline(chain_fp8<1>, epoch, what.c_str());
        ll_chain(what.c_str(), t_one_pf);
        if (chained)
          time_gap_chain(T, c.M, [&](int k, unsigned* b, unsigned ep) { run(chain_fp8<2>, k, c.M, c.N, b, ep); }, ps2,
                         G, C.flag, t_pf);
        pf = pace = 0;
      }
      CK(cudaFree(llw));
    }
    CK(cudaFree(ps)); CK(cudaFree(ps2));
  }
  return 0;
}
