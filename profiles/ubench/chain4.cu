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
#include <cstdio>
#include <cstdint>

#include "fp8chain.cuh"

constexpr int STHREADS = 256;   // the PDL stage kernel's block (2 an SM)
constexpr int CONS = 8;         // the persistent kernel's consumer warps (+ one producer warp)

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
    if (GAP) gap_in_grid<CONS>(ys + size_t(s) * N, 1, xn + size_t(s) * K, K, flag, epoch * (M - 1) + s + 1);
  }
}

int main() {
  const int sms = chain_start("chain4: FP8 rows, persistent producer + ring against PDL launches");
  Timer T;
  const cudaStream_t st = T.st;
  constexpr int COPIES = Fp8Case::COPIES;
  for (const ChainCfg& c : FP8_CHAINS) {
    if (c.K != KD) { printf("K = %d: the kernels are built for K = %d\n", c.K, KD); return 1; }
    Fp8Case C(c.M, c.N, c.K, false);
    C.upload(C.hw);                        // the kernels read the rows as they are
    float *ys, *ys2;
    CK(cudaMalloc(&ys, size_t(c.M) * c.N * 4)); CK(cudaMalloc(&ys2, size_t(c.M) * c.N * 4));
    // the graph of PDL launches (the reference bits)
    const size_t smem0 = size_t(c.K) * 4;
    const int grid0 = sms * 2;
    CK(cudaFuncSetAttribute(stage_fp8, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem0)));
    const bool chained = c.N == c.K;
    // stage i reads x0, y of stage i - 1, or (gap) the step's xn of it
    auto capture = [&](int k, bool gap, bool gaps_only) {
      return capture_chain(st, c.M, gap, gaps_only, [&](int i, bool gp) {
        const float* x = i == 0 || !chained ? C.x0 : gp ? C.xn + size_t(i - 1) * c.K : ys + size_t(i - 1) * c.N;
        Launch L(dim3(grid0), dim3(STHREADS), smem0, st);
        L(stage_fp8, C.W(k, i), C.S(k, i), x, ys + size_t(i) * c.N, c.N, c.K);
      }, [&](int i) {
        Launch L(dim3(1), dim3(CONS * 32), 0, st);
        L(gap_kernel<CONS>, ys + size_t(i - 1) * c.N, 1, C.xn + size_t(i - 1) * c.K, c.K);
      });
    };
    // one launch of all M * N rows (the floor of this GEMV, no dependency)
    const float t_one_g = T.time([&](int i) {
      Launch L(dim3(grid0), dim3(STHREADS), smem0, st, false);
      L(stage_fp8, C.W(i % COPIES, 0), C.S(i % COPIES, 0), C.x0, ys2, c.N * c.M, c.K);
    });
    const ChainGraphs G = time_graphs(T, c.M, chained, capture, ys, size_t(c.M) * c.N);
    const std::vector<float>& ref = G.ref;
    const float t_graph = G.graph;
    const double err = C.err([&](int r) { return double(ref[r]); });   // stage 0 against float64
    const float t_read = T.read(C.w, C.bytes, COPIES, C.bytes, sms);
    printf("%d stages of %d x %d FP8 (%.1f MB each, %.1f MB): read alone %.1f us (%.2f TB/s); stage 0 against "
           "float64: max err / max |y| %.1e\n", c.M, c.N, c.K, C.per / 1e6, C.bytes / 1e6, t_read, C.bytes / t_read / 1e6, err);
    printf("  PDL launches: one of all rows %.1f us (%.0f%% of the read) | a graph of %d %.1f us (%.2f us a dependency)\n",
           t_one_g, 100.0 * t_read / t_one_g, c.M, t_graph, (t_graph - t_one_g) / (c.M - 1));
    if (chained) print_graph_step(G, c.M);
    for (int nbuf : {16, 48}) {
      const size_t smem = size_t(c.K) * 4 + size_t(nbuf) * c.K + size_t(nbuf) * 16;
      CK(cudaFuncSetAttribute(chain_fp8<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaFuncSetAttribute(chain_fp8<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      const int threads = (CONS + 1) * 32;
      unsigned epoch = 0;
      CK(cudaMemset(C.bar, 0, 4)); CK(cudaMemset(C.flag, 0, 4));
      auto run = [&](auto kern, int k, int M, int N, unsigned* b, unsigned ep) {
        kern<<<sms, threads, smem, st>>>(C.Ws(k), C.Ss(k), C.x0, ys2, M, N, c.K, nbuf, b, ep, C.xn2, C.flag);
      };
      // the floor: one stage of all M * N rows
      const float t_one = T.time([&](int i) { run(chain_fp8<0>, i % COPIES, 1, c.N * c.M, C.bar, 0); });
      const float t_nb = T.time([&](int i) { run(chain_fp8<0>, i % COPIES, c.M, c.N, C.bar, 0); });
      const float t_dep = T.time([&](int i) { run(chain_fp8<1>, i % COPIES, c.M, c.N, C.bar, epoch++); });
      auto check = [&](const std::vector<float>& want) {
        CK(cudaStreamSynchronize(st));
        return fetch(ys2, want.size()) == want ? "yes" : "NO";
      };
      CK(cudaMemset(ys2, 0xFF, ref.size() * 4));
      run(chain_fp8<1>, 0, c.M, c.N, C.bar, epoch++);
      const char* same = check(ref);
      printf("  persistent, ring %2d rows (%3zu KB): one stage of all rows %.1f us (%.0f%% of the read) | %d stages, no "
             "barrier %.1f us | with the dependency %.1f us (%.2f us a dependency) | same bits %s\n",
             nbuf, smem / 1024, t_one, 100.0 * t_read / t_one, c.M, t_nb, t_dep, (t_dep - t_one) / (c.M - 1), same);
      if (chained)
        time_gap_chain(T, c.M, [&](int k, unsigned* b, unsigned ep) { run(chain_fp8<2>, k, c.M, c.N, b, ep); }, ys2, G,
                       C.flag, t_dep);
    }
    CK(cudaFree(ys)); CK(cudaFree(ys2));
  }
  return 0;
}
