// Microbenchmark (not part of the library): the persistent road with the weight stream decoupled
// from the dependency. One CTA an SM: a producer warp streams every stage's rows (cp.async.bulk
// into a ring of row slots, mbarrier full / empty) while consumer warps compute a row a slot; a
// grid barrier between stages that only the consumers wait at, so the producer keeps requesting
// through it (as far as the ring reaches). Modes (see chain_dec): the barrier's kind, with or
// without the data dependency, rows split evenly or taken dynamically; timed against the same
// kernel on one stage of all rows and against a graph of PDL launches (chain.cuh), y checked bit
// for bit against the graph's. Also: a grid barrier alone. Results: BENCHMARKS.md (issue 45,
// twenty-first session). Build and run: profiles/ubench/run.sh chain3
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>

#include "chain.cuh"
#include "ring.cuh"

// ---- the decoupled persistent chain ----

// smem: the ring of K-element bf16 rows (ring.cuh: xs | rows | full | empty), then slot_row
// [nbuf]. CONS consumer warps, nbuf a multiple of CONS (Ring; a stage's end is a consumer barrier).
// MODE 0: atomicAdd barrier, stage s reads y_(s-1); 1: red.release barrier, same; 2: red.release
// barrier, no dependency (x0 every stage, loaded once); 3: no barrier, no dependency. Rows split
// evenly over the CTAs. MODE 7: as 1 with a consumer that reads one 16-byte piece of each row
// instead of its dot product (is the consumers' rate what the ring waits on?). MODE 4, 5, 6: as
// 1, 2, 3 with rows taken dynamically (G rows a grab from a
// stage's counter, the next grab requested before the current rows are issued); the producer ends
// its share of a stage with CONS marker slots carrying the count, one for each consumer warp.
constexpr int G = 2;
template <int CONS, int MODE>
__global__ void __launch_bounds__((CONS + 1) * 32, 1) chain_dec(const __nv_bfloat16* const* Ws, const float* x0, float* ys,
                                                         int M, int N, int K, int nbuf, unsigned* bar, unsigned* cnt, unsigned epoch) {
  constexpr bool DYN = MODE >= 4 && MODE <= 6, LIGHT = MODE == 7;
  constexpr int BMODE = DYN ? MODE - 3 : LIGHT ? 1 : MODE;   // the barrier / dependency mode
  extern __shared__ __align__(128) unsigned char sm[];
  Ring g = ring_init(sm, K, size_t(K) * 2, nbuf);
  volatile int* slot_row = reinterpret_cast<volatile int*>(g.empty + nbuf);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int r0, r1;
  even_rows(N, r0, r1);
  const int rows = r1 - r0;
  if (warp == CONS) {   // the producer: every stage's rows of this CTA, in order, as the ring frees
    if (lane == 0) {
      int t = 0;
      auto issue = [&](int s, int r) {
        const int slot = g.acquire(t++);
        slot_row[slot] = r;
        g.fill(slot, Ws[s] + size_t(r) * K);
      };
      for (int s = 0; s < M; ++s) {
        if (!DYN) {
          for (int r = r0; r < r1; ++r) issue(s, r);
          continue;
        }
        const unsigned base = epoch * unsigned(((N + G - 1) / G + gridDim.x) * G);
        unsigned nxt = atomicAdd(&cnt[s], unsigned(G)) - base;
        int n = 0;
        while (nxt < unsigned(N)) {
          const int rg = int(nxt);
          nxt = atomicAdd(&cnt[s], unsigned(G)) - base;
          for (int r = rg; r < min(rg + G, N); ++r, ++n) issue(s, r);
        }
        for (int m = 0; m < CONS; ++m) {   // the stage's end, one marker a consumer warp
          const int slot = g.acquire(t++);
          slot_row[slot] = -1 - n;
          mbar_arrive(&g.full[slot]);
        }
      }
    }
    return;
  }
  const int chunks = K / 256;
  int T = 0;   // the stage's first slot use in this CTA's sequence
  for (int s = 0; s < M; ++s) {
    if (s == 0 || BMODE < 2) {
      load_xs(s == 0 || N != K ? x0 : ys + size_t(s - 1) * N, g.xs, K, CONS * 32);
      cons_sync<CONS>();
    }
    int n_s = rows;
    for (int j = warp; DYN || j < rows; j += CONS) {
      const int slot = g.wait(T + j);
      const int r = DYN ? slot_row[slot] : r0 + j;
      if (r < 0) {
        n_s = -1 - r;
        __syncwarp();
        if (lane == 0) g.release(slot);
        break;
      }
      const uint4* row = static_cast<const uint4*>(g.row(slot));
      float acc = 0.f;
      if (LIGHT) acc = dot8(row[lane], g.xs + lane * 8);
      else
        for (int c = 0; c < chunks; ++c) acc += dot8(row[c * 32 + lane], g.xs + (c * 32 + lane) * 8);
      __syncwarp();
      if (lane == 0) g.release(slot);
#pragma unroll
      for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) ys[size_t(s) * N + r] = acc * (1.0f / 64.0f);
    }
    T += DYN ? n_s + CONS : rows;
    if (s + 1 == M || BMODE == 3) continue;
    cons_sync<CONS>();
    if (threadIdx.x == 0) {   // the grid barrier (consumers only)
      const unsigned target = (epoch * (M - 1) + s + 1) * gridDim.x;
      if (BMODE == 0) grid_wait_atomic(bar, target);
      else grid_wait(bar, target);
    }
    cons_sync<CONS>();
  }
}

__global__ void barrier_loop(unsigned* bar, int iters, unsigned epoch, int mode) {
  for (int i = 0; i < iters; ++i) {
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned target = (epoch * iters + i + 1) * gridDim.x;
      if (mode == 0) grid_wait_atomic(bar, target);
      else grid_wait(bar, target);
    }
    __syncthreads();
  }
}

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);   // a line at a time, also through a pipe
  cudaDeviceProp prop;
  const int sms = sm_count(prop);
  printf("%s, %d SMs (chain3: persistent, producer warp + ring, consumers at the grid barrier)\n", prop.name, sms);
  struct Cfg { int M, N, K; };
  const Cfg cfgs[] = {{4, 4096, 4096}, {8, 1024, 4096}, {9, 2048, 4096}};
  Timer T;
  const cudaStream_t st = T.st;
  const int COPIES = 3;
  {
    unsigned* bar; CK(cudaMalloc(&bar, 4));
    for (int mode = 0; mode < 2; ++mode)
      for (int threads : {32, 512}) {
        CK(cudaMemset(bar, 0, 4));
        barrier_loop<<<sms, threads, 0, st>>>(bar, 10, 0, mode);
        CK(cudaStreamSynchronize(st));
        CK(cudaMemset(bar, 0, 4));
        CK(cudaEventRecord(T.e0, st));
        barrier_loop<<<sms, threads, 0, st>>>(bar, 2000, 0, mode);
        CK(cudaEventRecord(T.e1, st)); CK(cudaEventSynchronize(T.e1));
        float ms; CK(cudaEventElapsedTime(&ms, T.e0, T.e1));
        printf("grid barrier alone (%d CTAs of %d, %s): %.2f us a barrier\n", sms, threads,
               mode ? "red.release" : "fence + atomicAdd", ms * 1000 / 2000);
      }
    CK(cudaFree(bar));
  }
  for (const Cfg& c : cfgs) {
    const ChainData d(c.M, c.N, c.K, COPIES);
    unsigned *cnt, *cnt1; CK(cudaMalloc(&cnt, 64 * 4)); CK(cudaMalloc(&cnt1, 64 * 4));
    // reference and baseline: graph of M PDL launches of the plain GEMV
    const size_t smem0 = size_t(c.K) * 4;
    CK(cudaFuncSetAttribute(stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem0)));
    std::vector<cudaGraphExec_t> ex(COPIES);
    for (int k = 0; k < COPIES; ++k) ex[k] = d.capture(st, stage_kernel, sms * 2, smem0, true, k);
    const float t_graph = T.time([&](int i) { CK(cudaGraphLaunch(ex[i % COPIES], st)); });
    CK(cudaGraphLaunch(ex[0], st)); CK(cudaStreamSynchronize(st));
    const std::vector<float> ref = fetch(d.ys, size_t(c.M) * c.N);
    const float t_read = T.read(d.w, d.bytes, COPIES, d.bytes, sms);
    printf("%d stages of %d x %d bf16 (%.1f MB each, %.1f MB): read alone %.1f us; graph of PDL launches %.1f us\n",
           c.M, c.N, c.K, d.per * 2 / 1e6, d.bytes / 1e6, t_read, t_graph);
    auto run_dec = [&](auto kern, int mode, int cons, int nbuf) {
      const int PTHREADS = (cons + 1) * 32;
      const size_t smem = size_t(c.K) * 4 + size_t(nbuf) * c.K * 2 + size_t(nbuf) * 20;
      CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      unsigned epoch = 0, epoch1 = 0;
      CK(cudaMemset(d.bar, 0, 4)); CK(cudaMemset(cnt, 0, 64 * 4)); CK(cudaMemset(cnt1, 0, 64 * 4));
      const int grid = sms;
      // the floor: the same kernel, one stage of all M * N rows
      const float t_one = T.time([&](int i) { kern<<<grid, PTHREADS, smem, st>>>(d.dp + (i % COPIES) * c.M, d.x0, d.ys2, 1, c.N * c.M, c.K, nbuf, d.bar, cnt1, epoch1++); });
      const float t_ch = T.time([&](int i) { kern<<<grid, PTHREADS, smem, st>>>(d.dp + (i % COPIES) * c.M, d.x0, d.ys2, c.M, c.N, c.K, nbuf, d.bar, cnt, epoch++); });
      CK(cudaMemset(d.ys2, 0xFF, ref.size() * 4));   // NaN: a row no CTA wrote shows
      kern<<<grid, PTHREADS, smem, st>>>(d.dp, d.x0, d.ys2, c.M, c.N, c.K, nbuf, d.bar, cnt, epoch++);
      CK(cudaStreamSynchronize(st));
      const bool same = fetch(d.ys2, ref.size()) == ref;
      printf("  mode %d, %2d consumer warps, ring %2d rows (%3zu KB): one stage of all rows %.1f us | chain %.1f us (%.2f us a boundary over it; %.2f under the graph's) | same bits %s\n",
             mode, cons, nbuf, smem / 1024, t_one, t_ch, (t_ch - t_one) / (c.M - 1), (t_graph - t_ch) / (c.M - 1), (mode == 2 || mode == 3 || mode >= 5) ? "n/a" : same ? "yes" : "NO");
    };
    run_dec(chain_dec<8, 0>, 0, 8, 24);
    run_dec(chain_dec<8, 1>, 1, 8, 24);
    run_dec(chain_dec<8, 2>, 2, 8, 24);
    run_dec(chain_dec<8, 3>, 3, 8, 24);
    run_dec(chain_dec<8, 1>, 1, 8, 8);
    run_dec(chain_dec<8, 4>, 4, 8, 24);
    run_dec(chain_dec<8, 5>, 5, 8, 24);
    run_dec(chain_dec<8, 6>, 6, 8, 24);
    run_dec(chain_dec<8, 4>, 4, 8, 8);
    run_dec(chain_dec<8, 4>, 4, 8, 16);
    run_dec(chain_dec<8, 7>, 7, 8, 24);
    run_dec(chain_dec<8, 7>, 7, 8, 8);
    for (auto& gx : ex) CK(cudaGraphExecDestroy(gx));
    CK(cudaFree(cnt)); CK(cudaFree(cnt1));
  }
  return 0;
}
