// The FP8 chains' shared pieces (chain4.cu, chain5.cu): the latency-bound step between two stages
// (one CTA normalizing y, as the layer's small kernels run between its weight streams), and the
// host side of a configuration: e4m3 weights with a float scale per 128 x 128 block, x, three
// copies of them on the device (no replay finds the next one's bytes in L2), the tables of the
// stages' pointers, the buffers of the steps and barriers, and stage 0 against float64.
#pragma once
#include <cuda_fp16.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include "ring.cuh"

constexpr int KD = 4096;        // every matrix's K (a constant: a lane's pieces stay in registers)
constexpr int GAPI = 8;         // normalizations of y in the latency-bound step

// y's i-th value from a stage's output: plain (parts 1) or partial sums [N][4] added in order
__device__ __forceinline__ float y_at(const float* y, int parts, int i) {
  if (parts == 1) return __ldcg(y + i);
  const float4 p = __ldcg(reinterpret_cast<const float4*>(y) + i);
  return ((p.x + p.y) + p.z) + p.w;
}

// the latency-bound step: one CTA of NW warps normalizes y (K values) GAPI times over (x <- x /
// rms(x)) into out; `sync` is the CTA's barrier (__syncthreads alone, the consumers' named one
// in a persistent kernel). The same arithmetic in every kernel.
template <int NW, typename Sync>
__device__ void gap_norm(const float* y, int parts, float* out, int K, Sync sync) {
  __shared__ float red[NW];
  constexpr int PER = KD / (NW * 32);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float v[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) v[i] = y_at(y, parts, i * NW * 32 + tid);
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
    for (int w = 0; w < NW; ++w) tot += red[w];
    sync();
    const float sc = rsqrtf(tot / K + 1e-6f);
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] *= sc;
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) out[i * NW * 32 + tid] = v[i];
}

// the step as its own launch (a graph's node between two stages, PDL)
template <int NW>
__global__ void __launch_bounds__(NW * 32) gap_kernel(const float* y, int parts, float* out, int K) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  gap_norm<NW>(y, parts, out, K, [] { __syncthreads(); });
}

// in a persistent kernel, after the grid barrier of stage s: CTA 0's consumers (NW warps) run
// the step on y into xn and raise `flag`; every CTA waits for it (flag counts from epoch 0)
template <int NW>
__device__ __forceinline__ void gap_in_grid(const float* y, int parts, float* xn, int K, unsigned* flag,
                                            unsigned target) {
  if (blockIdx.x == 0) {
    gap_norm<NW>(y, parts, xn, K, [] { cons_sync<NW>(); });
    cons_sync<NW>();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(flag) : "memory");
  }
  if (threadIdx.x == 0) spin_until(flag, target);
  cons_sync<NW>();
}

inline double e4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
  return b & 0x80 ? -v : v;
}

// one configuration: M stages of W [N, K] e4m3 (|w| < 2) with block scales 2^-6 or 2^-7, x =
// sin(0.1 i) (rounded to f16 where the kernels hold it so); `upload` puts COPIES copies of the
// weights as the kernels read them (their layout: `dev`, per stage N * K bytes) and of the scales
// on the device, with the tables of pointers: per copy M weight pointers, then M scale pointers
struct Fp8Case {
  static constexpr int COPIES = 3;
  int M, N, K;
  size_t per, bytes, nsc;
  std::vector<uint8_t> hw;
  std::vector<float> hs, hx;
  std::vector<const void*> ptr;
  uint8_t* w = nullptr;
  float *sc = nullptr, *x0 = nullptr, *xn = nullptr, *xn2 = nullptr;
  unsigned *bar = nullptr, *flag = nullptr;
  const void** dp = nullptr;

  Fp8Case(int M_, int N_, int K_, bool half_x) : M(M_), N(N_), K(K_), per(size_t(N_) * K_), bytes(per * M_),
                                                 nsc(size_t(N_ / 128) * (K_ / 128)), hw(bytes), hs(nsc * M_), hx(K_) {
    uint32_t rs = 7;
    for (auto& b : hw) { rs = rs * 1664525u + 1013904223u; b = uint8_t((rs >> 13) & 0xBF); }
    for (auto& v : hs) { rs = rs * 1664525u + 1013904223u; v = std::ldexp(1.0f, -6 - int((rs >> 20) & 1)); }
    for (int i = 0; i < K; ++i) hx[i] = half_x ? __half2float(__float2half_rn(std::sin(0.1f * i))) : std::sin(0.1f * i);
  }
  void upload(const std::vector<uint8_t>& dev) {
    CK(cudaMalloc(&w, bytes * COPIES)); CK(cudaMalloc(&sc, hs.size() * 4 * COPIES));
    for (int k = 0; k < COPIES; ++k) {
      CK(cudaMemcpy(w + k * bytes, dev.data(), bytes, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sc + k * hs.size(), hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    }
    CK(cudaMalloc(&x0, K * 4)); CK(cudaMalloc(&xn, size_t(M) * K * 4)); CK(cudaMalloc(&xn2, size_t(M) * K * 4));
    CK(cudaMalloc(&bar, 4)); CK(cudaMalloc(&flag, 4));
    CK(cudaMemcpy(x0, hx.data(), K * 4, cudaMemcpyHostToDevice));
    ptr.resize(size_t(2) * M * COPIES);
    for (int k = 0; k < COPIES; ++k)
      for (int i = 0; i < M; ++i) {
        ptr[(2 * k) * M + i] = w + k * bytes + i * per;
        ptr[(2 * k + 1) * M + i] = sc + k * hs.size() + i * nsc;
      }
    CK(cudaMalloc(&dp, ptr.size() * sizeof(void*)));
    CK(cudaMemcpy(dp, ptr.data(), ptr.size() * sizeof(void*), cudaMemcpyHostToDevice));
  }
  // copy k's stage i (a copy's matrices, and their scales, lie back to back: W(k, 0) with N * M
  // rows is all of them)
  const uint8_t* W(int k, int i) const { return static_cast<const uint8_t*>(ptr[(2 * k) * M + i]); }
  const float* S(int k, int i) const { return static_cast<const float*>(ptr[(2 * k + 1) * M + i]); }
  // copy k's tables (device) of the M stages' weights and scales
  const uint8_t* const* Ws(int k) const { return reinterpret_cast<const uint8_t* const*>(dp + 2 * k * M); }
  const float* const* Ss(int k) const { return reinterpret_cast<const float* const*>(dp + (2 * k + 1) * M); }
  // stage 0's y (y0(r), N rows) against float64: max err / max |y|
  template <typename Y>
  double err(Y y0) const {
    double e = 0, big = 0;
    for (int r = 0; r < N; ++r) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += e4m3(hw[size_t(r) * K + k]) * hs[size_t(r / 128) * (K / 128) + k / 128] * hx[k];
      e = std::max(e, std::fabs(s - y0(r))); big = std::max(big, std::fabs(s));
    }
    return e / big;
  }
  ~Fp8Case() {
    cudaFree(w); cudaFree(sc); cudaFree(x0); cudaFree(xn); cudaFree(xn2); cudaFree(bar); cudaFree(flag); cudaFree(dp);
  }
};

// a graph of the M stages: stage(i, gap) launches stage i (reading x0, y of stage i - 1, or with
// gap the step's xn of it); with gap or gaps_only the step step(i) between stages i - 1 and i;
// gaps_only: the M - 1 steps alone
template <typename Stage, typename Step>
cudaGraphExec_t capture_chain(cudaStream_t st, int M, bool gap, bool gaps_only, Stage stage, Step step) {
  cudaGraph_t g;
  cudaGraphExec_t gx;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < M; ++i) {
    if (i > 0 && (gap || gaps_only)) step(i);
    if (!gaps_only) stage(i, gap);
  }
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&gx, g, 0));
  CK(cudaGraphDestroy(g));
  return gx;
}

// the chain's graphs, timed: capture(k, gap, gaps_only) -> a graph of copy k (capture_chain);
// `graph` the plain chain's time, with `chained` (N == K) also `gap_graph` (the step between
// every two stages) and `gaps` (the M - 1 steps alone, a graph); `ref` / `refg` the n outputs at
// `out` after each (the reference bits of the persistent chains)
struct ChainGraphs {
  float graph = 0, gap_graph = 0, gaps = 0;
  std::vector<float> ref, refg;
  // the cost of one step inside the graph, over the graph without it
  float step(int M) const { return (gap_graph - graph) / (M - 1); }
};
template <typename Capture>
ChainGraphs time_graphs(Timer& T, int M, bool chained, Capture capture, const float* out, size_t n) {
  const int copies = Fp8Case::COPIES;
  ChainGraphs r;
  std::vector<cudaGraphExec_t> ex(copies), exg;
  for (int k = 0; k < copies; ++k) ex[k] = capture(k, false, false);
  r.graph = T.time([&](int i) { CK(cudaGraphLaunch(ex[i % copies], T.st)); });
  if (chained) {   // the gap graph's outputs, then the steps alone on them (their input in place)
    for (int k = 0; k < copies; ++k) exg.push_back(capture(k, true, false));
    r.gap_graph = T.time([&](int i) { CK(cudaGraphLaunch(exg[i % copies], T.st)); });
    CK(cudaGraphLaunch(exg[0], T.st)); CK(cudaStreamSynchronize(T.st));
    r.refg = fetch(out, n);
    cudaGraphExec_t gaps = capture(0, false, true);
    r.gaps = T.time([&](int) { CK(cudaGraphLaunch(gaps, T.st)); });
    CK(cudaGraphExecDestroy(gaps));
  }
  CK(cudaGraphLaunch(ex[0], T.st)); CK(cudaStreamSynchronize(T.st));
  r.ref = fetch(out, n);
  for (auto& gx : ex) CK(cudaGraphExecDestroy(gx));
  for (auto& gx : exg) CK(cudaGraphExecDestroy(gx));
  return r;
}

// the line of the step in the graph
inline void print_graph_step(const ChainGraphs& g, int M) {
  printf("  the latency-bound step (one CTA, %d normalizations of y): %.2f us alone (a graph of %d); the graph "
         "with one between stages %.1f us: %.2f us a step over the graph without\n", GAPI, g.gaps / (M - 1), M - 1,
         g.gap_graph, g.step(M));
}

// the persistent chain through the step: run(k, bar, epoch) launches it on copy k with the
// barrier count bar; timed, then once more and its n outputs at `out` against the gap graph's
// bits; the line beside the chain without the step (t_dep)
template <typename Run>
void time_gap_chain(Timer& T, int M, Run run, float* out, const ChainGraphs& g, unsigned* flag, float t_dep) {
  unsigned* b2;   // its own barrier count (and `flag`), from zero
  unsigned epoch = 0;
  CK(cudaMalloc(&b2, 4)); CK(cudaMemset(b2, 0, 4)); CK(cudaMemset(flag, 0, 4));
  const float t_gap = T.time([&](int i) { run(i % Fp8Case::COPIES, b2, epoch++); });
  CK(cudaMemset(out, 0xFF, g.refg.size() * 4));
  run(0, b2, epoch++);
  CK(cudaStreamSynchronize(T.st));
  const char* same = fetch(out, g.refg.size()) == g.refg ? "yes" : "NO";
  printf("    with the latency-bound step between stages %.1f us: %.2f us a step over the persistent chain "
         "without (the graph's: %.2f) | same bits %s\n", t_gap, (t_gap - t_dep) / (M - 1), g.step(M), same);
  CK(cudaFree(b2));
}

// a program's start: stdout a line at a time (also through a pipe), the GPU's line -> its SMs
inline int chain_start(const char* what) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  cudaDeviceProp prop;
  const int sms = sm_count(prop);
  printf("%s, %d SMs (%s)\n", prop.name, sms, what);
  return sms;
}
// the FP8 chains' configurations: M stages of N x K (16.8, 33.6, 8.4 MB a stage)
struct ChainCfg { int M, N, K; };
constexpr ChainCfg FP8_CHAINS[] = {{8, 4096, 4096}, {4, 8192, 4096}, {8, 2048, 4096}};
