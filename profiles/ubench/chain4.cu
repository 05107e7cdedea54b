// Microbenchmark (not part of the library): chain3's persistent chain (a producer warp streaming
// rows through a shared-memory ring, consumers waiting at a grid barrier) on FP8 rows, the
// library's weight format: e4m3 W [N, K] with a float scale per 128 x 128 block, x float. The
// consumers turn e4m3 pairs into f16x2 (cvt.rn.f16x2.e4m3x2) and accumulate in float. chain3
// found a dependency costs ~2.7 us with consumers that only keep up with the memory and ~1.5 us
// with consumers that outrun it; the question here: does an FP8 consumer reading shared memory
// outrun the memory (one stage of all rows at the read's speed), and what does a dependency cost
// then? And the persistent road's promise: with a latency-bound step between two stages (one
// CTA normalizing y, as the layer's small kernels run between its weight streams), does the
// producer's streaming through the step hide it, where a graph of PDL launches pays it? Against
// a graph of PDL launches of the same GEMV reading global memory (the library's way), y checked
// bit for bit against it (with and without the steps), and stage 0 against a float64 host
// reference (the e4m3 decode). Build and run: profiles/ubench/run.sh chain4
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>

#include "ring.cuh"

constexpr int STHREADS = 256;   // the PDL stage kernel's block (2 an SM)
constexpr int CONS = 8;         // the persistent kernel's consumer warps (+ one producer warp)
constexpr int KD = 4096;        // every matrix's K (a constant: a lane's pieces stay in registers)

// 16 e4m3 weights (one 16-byte piece) against x[0..15]; the same sums in the same order in both
// kernels
__device__ __forceinline__ float dot16(uint4 w, const float* x) {
  const uint32_t v[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(lo) : "h"(static_cast<unsigned short>(v[i] & 0xFFFFu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(hi) : "h"(static_cast<unsigned short>(v[i] >> 16)));
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    s = fmaf(a.x, x[4 * i], s);
    s = fmaf(a.y, x[4 * i + 1], s);
    s = fmaf(b.x, x[4 * i + 2], s);
    s = fmaf(b.y, x[4 * i + 3], s);
  }
  return s;
}

// one row: a warp, lane l takes pieces l, l + 32, ... (piece c: elements 16c..16c+15, scale
// block c / 8); `piece(i, c)` gives the 16 bytes of the lane's i-th piece, c
template <typename Piece>
__device__ __forceinline__ float row_dot(Piece piece, const float* xs, const float* srow) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < KD / 16 / 32; ++i) {
    const int c = i * 32 + lane;
    acc = fmaf(dot16(piece(i, c), xs + 16 * c), __ldg(srow + c / 8), acc);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

// the latency-bound step between two stages (mode 2): one CTA of CONS * 32 threads normalizes
// y (K values) GAPI times over (x <- x / rms(x)), as the layer's small kernels do between its
// weight streams; `sync` is the CTA's barrier (__syncthreads alone, the consumers' named one in
// the persistent kernel). The same arithmetic in both kernels.
constexpr int GAPI = 8;
template <typename Sync>
__device__ void gap_norm(const float* y, float* out, int K, Sync sync) {
  __shared__ float red[CONS];
  constexpr int PER = KD / (CONS * 32);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float v[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) v[i] = __ldcg(y + i * CONS * 32 + tid);
  for (int it = 0; it < GAPI; ++it) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) ss = fmaf(v[i], v[i], ss);
#pragma unroll
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) red[warp] = ss;
    sync();
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < CONS; ++w) tot += red[w];
    sync();
    const float sc = rsqrtf(tot / K + 1e-6f);
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] *= sc;
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) out[i * CONS * 32 + tid] = v[i];
}

__global__ void __launch_bounds__(CONS * 32) gap_kernel(const float* y, float* out, int K) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  gap_norm(y, out, K, [] { __syncthreads(); });
}

// one stage as its own launch (PDL): a warp a row, rows strided over the grid's warps, each
// lane's pieces of its first row requested before griddepcontrol.wait
__global__ void __launch_bounds__(STHREADS, 2) stage_fp8(const uint8_t* W, const float* S, const float* x, float* y,
                                                      int N, int K) {
  extern __shared__ float xs[];
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
  const int lane = threadIdx.x & 31;
  uint4 first[KD / 16 / 32];               // a lane's pieces of its first row
  if (gw < N)
#pragma unroll
    for (int i = 0; i < KD / 16 / 32; ++i) first[i] = ldg_na(W + size_t(gw) * K + (i * 32 + lane) * 16);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  load_xs(x, xs, K, blockDim.x);
  __syncthreads();
  if (gw < N) {
    const float v = row_dot([&](int i, int) { return first[i]; }, xs, S + size_t(gw / 128) * (K / 128));
    if (lane == 0) y[gw] = v;
  }
  for (int r = gw + nw; r < N; r += nw) {
    const uint8_t* row = W + size_t(r) * K;
    const float v = row_dot([&](int, int c) { return ldg_na(row + size_t(c) * 16); }, xs,
                            S + size_t(r / 128) * (K / 128));
    if (lane == 0) y[r] = v;
  }
}

// all stages in one kernel: rows split evenly over the CTAs, the producer warp (warp CONS)
// streams this CTA's rows of every stage through a ring of nbuf row slots; the consumers wait at
// a grid barrier between stages. MODE 0: no barrier, x0 throughout; 1: stage s > 0 reads y of
// stage s - 1 when N == K (else x0); 2: as 1 through the latency-bound step: after the barrier
// CTA 0 runs gap_norm of y into xn and raises `flag`, every CTA waits for it and reads xn
// (N == K). smem: the ring of K-byte rows (ring.cuh)
template <int MODE>
__global__ void __launch_bounds__((CONS + 1) * 32, 1) chain_fp8(const uint8_t* const* Ws, const float* const* Ss,
                                                                const float* x0, float* ys, int M, int N, int K,
                                                                int nbuf, unsigned* bar, unsigned epoch,
                                                                float* xn, unsigned* flag) {
  constexpr bool DEP = MODE >= 1, GAP = MODE == 2;
  extern __shared__ __align__(128) unsigned char sm[];
  Ring g = ring_init(sm, K, size_t(K), nbuf);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int r0, r1;
  even_rows(N, r0, r1);
  const int rows = r1 - r0;
  if (warp == CONS) {
    if (lane == 0) {
      int t = 0;
      for (int s = 0; s < M; ++s)
        for (int r = r0; r < r1; ++r) g.fill(g.acquire(t++), Ws[s] + size_t(r) * K);
    }
    return;
  }
  for (int s = 0; s < M; ++s) {
    if (s == 0 || DEP) {
      const float* x = !DEP || s == 0 || N != K ? x0 : GAP ? xn + size_t(s - 1) * K : ys + size_t(s - 1) * N;
      load_xs(x, g.xs, K, CONS * 32);
      cons_sync<CONS>();
    }
    for (int j = warp; j < rows; j += CONS) {
      const int slot = g.wait(s * rows + j), r = r0 + j;
      const uint4* row = static_cast<const uint4*>(g.row(slot));
      const float v = row_dot([&](int, int c) { return row[c]; }, g.xs, Ss[s] + size_t(r / 128) * (K / 128));
      __syncwarp();
      if (lane == 0) {
        g.release(slot);
        ys[size_t(s) * N + r] = v;
      }
    }
    if (!DEP || s + 1 == M) continue;
    cons_sync<CONS>();
    if (threadIdx.x == 0) grid_wait(bar, (epoch * (M - 1) + s + 1) * gridDim.x);
    cons_sync<CONS>();
    if (GAP) {
      const unsigned target = epoch * (M - 1) + s + 1;
      if (blockIdx.x == 0) {
        gap_norm(ys + size_t(s) * N, xn + size_t(s) * K, K, [] { cons_sync<CONS>(); });
        cons_sync<CONS>();
        if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(flag) : "memory");
      }
      if (threadIdx.x == 0) spin_until(flag, target);
      cons_sync<CONS>();
    }
  }
}

static double e4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
  return b & 0x80 ? -v : v;
}

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);   // a line at a time, also through a pipe
  cudaDeviceProp prop;
  const int sms = sm_count(prop);
  printf("%s, %d SMs (chain4: FP8 rows, persistent producer + ring against PDL launches)\n", prop.name, sms);
  struct Cfg { int M, N, K; };
  const Cfg cfgs[] = {{8, 4096, 4096}, {4, 8192, 4096}, {8, 2048, 4096}};   // 16.8, 33.6, 8.4 MB a stage
  Timer T;
  const cudaStream_t st = T.st;
  const int COPIES = 3;
  for (const Cfg& c : cfgs) {
    if (c.K != KD) { printf("K = %d: the kernels are built for K = %d\n", c.K, KD); return 1; }
    const size_t per = size_t(c.N) * c.K, bytes = per * c.M, nsc = size_t(c.N / 128) * (c.K / 128);
    std::vector<uint8_t> hw(per * c.M);
    std::vector<float> hs(nsc * c.M);
    uint32_t rs = 7;
    for (auto& b : hw) { rs = rs * 1664525u + 1013904223u; b = uint8_t((rs >> 13) & 0xBF); }   // |w| < 2
    for (auto& v : hs) { rs = rs * 1664525u + 1013904223u; v = std::ldexp(1.0f, -6 - int((rs >> 20) & 1)); }
    uint8_t* w; float* sc;
    CK(cudaMalloc(&w, bytes * COPIES)); CK(cudaMalloc(&sc, hs.size() * 4 * COPIES));
    for (int k = 0; k < COPIES; ++k) {
      CK(cudaMemcpy(w + k * bytes, hw.data(), bytes, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sc + k * hs.size(), hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<float> hx(c.K);
    for (int i = 0; i < c.K; ++i) hx[i] = std::sin(0.1f * i);
    float *x0, *ys, *ys2, *xn, *xn2; unsigned *bar, *flag;
    CK(cudaMalloc(&x0, c.K * 4)); CK(cudaMalloc(&ys, size_t(c.M) * c.N * 4)); CK(cudaMalloc(&ys2, size_t(c.M) * c.N * 4));
    CK(cudaMalloc(&xn, size_t(c.M) * c.K * 4)); CK(cudaMalloc(&xn2, size_t(c.M) * c.K * 4));
    CK(cudaMalloc(&bar, 4)); CK(cudaMalloc(&flag, 4));
    CK(cudaMemcpy(x0, hx.data(), c.K * 4, cudaMemcpyHostToDevice));
    std::vector<const void*> hp(size_t(2) * c.M * COPIES);   // per copy: M weight pointers, then M scale pointers
    for (int k = 0; k < COPIES; ++k)
      for (int i = 0; i < c.M; ++i) {
        hp[(2 * k) * c.M + i] = w + k * bytes + i * per;
        hp[(2 * k + 1) * c.M + i] = sc + k * hs.size() + i * nsc;
      }
    const void** dp; CK(cudaMalloc(&dp, hp.size() * sizeof(void*)));
    CK(cudaMemcpy(dp, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
    auto wp = [&](int k) { return reinterpret_cast<const uint8_t* const*>(dp + 2 * k * c.M); };
    auto sp = [&](int k) { return reinterpret_cast<const float* const*>(dp + (2 * k + 1) * c.M); };
    // the graph of PDL launches (the reference bits)
    const size_t smem0 = size_t(c.K) * 4;
    const int grid0 = sms * 2;
    CK(cudaFuncSetAttribute(stage_fp8, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem0)));
    const bool chained = c.N == c.K;
    // a graph of the M stages (gap: the latency-bound step between two, stage i then reading
    // xn of stage i - 1; gaps_only: the M - 1 steps alone)
    auto capture = [&](int k, bool gap, bool gaps_only) {
      cudaGraph_t g;
      cudaGraphExec_t gx;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < c.M; ++i) {
        if (i > 0 && (gap || gaps_only)) {
          Launch L(dim3(1), dim3(CONS * 32), 0, st);
          L(gap_kernel, ys + size_t(i - 1) * c.N, xn + size_t(i - 1) * c.K, c.K);
        }
        if (gaps_only) continue;
        const float* x = i == 0 || !chained ? x0 : gap ? xn + size_t(i - 1) * c.K : ys + size_t(i - 1) * c.N;
        Launch L(dim3(grid0), dim3(STHREADS), smem0, st);
        L(stage_fp8, hp[(2 * k) * c.M + i], hp[(2 * k + 1) * c.M + i], x, ys + size_t(i) * c.N, c.N, c.K);
      }
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&gx, g, 0));
      return gx;
    };
    std::vector<cudaGraphExec_t> ex(COPIES), exg(COPIES);
    for (int k = 0; k < COPIES; ++k) {
      ex[k] = capture(k, false, false);
      if (chained) exg[k] = capture(k, true, false);
    }
    const float t_graph = T.time([&](int i) { CK(cudaGraphLaunch(ex[i % COPIES], st)); });
    // one launch of all M * N rows (a copy's matrices and their scales lie back to back: the
    // floor of this GEMV, no dependency)
    const float t_one_g = T.time([&](int i) {
      Launch L(dim3(grid0), dim3(STHREADS), smem0, st, false);
      L(stage_fp8, hp[(2 * (i % COPIES)) * c.M], hp[(2 * (i % COPIES) + 1) * c.M], x0, ys2, c.N * c.M, c.K);
    });
    std::vector<float> refg;
    float t_gaps = 0, t_graph_gap = 0;
    if (chained) {   // the gap graph's y, then the steps alone on it (their input in place)
      t_graph_gap = T.time([&](int i) { CK(cudaGraphLaunch(exg[i % COPIES], st)); });
      CK(cudaGraphLaunch(exg[0], st)); CK(cudaStreamSynchronize(st));
      refg = fetch(ys, size_t(c.M) * c.N);
      cudaGraphExec_t gaps = capture(0, false, true);
      t_gaps = T.time([&](int) { CK(cudaGraphLaunch(gaps, st)); });
      CK(cudaGraphExecDestroy(gaps));
    }
    CK(cudaGraphLaunch(ex[0], st)); CK(cudaStreamSynchronize(st));
    const std::vector<float> ref = fetch(ys, size_t(c.M) * c.N);
    double err = 0, big = 0;   // stage 0 against float64
    for (int r = 0; r < c.N; ++r) {
      double s = 0;
      for (int k = 0; k < c.K; ++k) s += e4m3(hw[size_t(r) * c.K + k]) * hs[size_t(r / 128) * (c.K / 128) + k / 128] * hx[k];
      err = std::max(err, std::fabs(s - ref[r])); big = std::max(big, std::fabs(s));
    }
    const float t_read = T.read(w, bytes, COPIES, bytes, sms);
    printf("%d stages of %d x %d FP8 (%.1f MB each, %.1f MB): read alone %.1f us (%.2f TB/s); stage 0 against "
           "float64: max err / max |y| %.1e\n", c.M, c.N, c.K, per / 1e6, bytes / 1e6, t_read, bytes / t_read / 1e6, err / big);
    printf("  PDL launches: one of all rows %.1f us (%.0f%% of the read) | a graph of %d %.1f us (%.2f us a dependency)\n",
           t_one_g, 100.0 * t_read / t_one_g, c.M, t_graph, (t_graph - t_one_g) / (c.M - 1));
    if (chained)
      printf("  the latency-bound step (one CTA, %d normalizations of y): %.2f us alone (a graph of %d); the graph "
             "with one between stages %.1f us: %.2f us a step over the graph without\n", GAPI, t_gaps / (c.M - 1),
             c.M - 1, t_graph_gap, (t_graph_gap - t_graph) / (c.M - 1));
    for (int nbuf : {16, 48}) {
      const size_t smem = size_t(c.K) * 4 + size_t(nbuf) * c.K + size_t(nbuf) * 16;
      CK(cudaFuncSetAttribute(chain_fp8<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      const int threads = (CONS + 1) * 32;
      unsigned epoch = 0, epoch2 = 0;
      CK(cudaMemset(bar, 0, 4)); CK(cudaMemset(flag, 0, 4));
      auto run = [&](auto kern, int k, int M, int N, unsigned* b, unsigned ep) {
        kern<<<sms, threads, smem, st>>>(wp(k), sp(k), x0, ys2, M, N, c.K, nbuf, b, ep, xn2, flag);
      };
      // the floor: one stage of all M * N rows
      const float t_one = T.time([&](int i) { run(chain_fp8<0>, i % COPIES, 1, c.N * c.M, bar, 0); });
      const float t_nb = T.time([&](int i) { run(chain_fp8<0>, i % COPIES, c.M, c.N, bar, 0); });
      const float t_dep = T.time([&](int i) { run(chain_fp8<1>, i % COPIES, c.M, c.N, bar, epoch++); });
      auto check = [&](const std::vector<float>& want) {
        CK(cudaStreamSynchronize(st));
        return fetch(ys2, want.size()) == want ? "yes" : "NO";
      };
      CK(cudaMemset(ys2, 0xFF, ref.size() * 4));
      run(chain_fp8<1>, 0, c.M, c.N, bar, epoch++);
      const char* same = check(ref);
      printf("  persistent, ring %2d rows (%3zu KB): one stage of all rows %.1f us (%.0f%% of the read) | %d stages, no "
             "barrier %.1f us | with the dependency %.1f us (%.2f us a dependency) | same bits %s\n",
             nbuf, smem / 1024, t_one, 100.0 * t_read / t_one, c.M, t_nb, t_dep, (t_dep - t_one) / (c.M - 1), same);
      if (chained) {
        unsigned* b2;   // mode 2's own barrier count (and `flag`), from zero
        CK(cudaMalloc(&b2, 4)); CK(cudaMemset(b2, 0, 4));
        const float t_gap = T.time([&](int i) { run(chain_fp8<2>, i % COPIES, c.M, c.N, b2, epoch2++); });
        CK(cudaMemset(ys2, 0xFF, ref.size() * 4));
        run(chain_fp8<2>, 0, c.M, c.N, b2, epoch2++);
        const char* same_g = check(refg);
        printf("    with the latency-bound step between stages %.1f us: %.2f us a step over the persistent chain "
               "without (the graph's: %.2f) | same bits %s\n", t_gap, (t_gap - t_dep) / (c.M - 1),
               (t_graph_gap - t_graph) / (c.M - 1), same_g);
        CK(cudaFree(b2));
      }
    }
    for (auto& gx : ex) CK(cudaGraphExecDestroy(gx));
    if (chained) for (auto& gx : exg) CK(cudaGraphExecDestroy(gx));
    CK(cudaFree(w)); CK(cudaFree(sc)); CK(cudaFree(x0)); CK(cudaFree(ys)); CK(cudaFree(ys2)); CK(cudaFree(xn));
    CK(cudaFree(xn2)); CK(cudaFree(bar)); CK(cudaFree(flag)); CK(cudaFree(dp));
  }
  return 0;
}
