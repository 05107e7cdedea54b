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

// smem: xs [K floats] | ring [nbuf][K bf16] | full [nbuf] | empty [nbuf] | slot_row [nbuf]. CONS
// consumer warps, nbuf a multiple of CONS: the use before a slot's k-th was the same warp's (an
// mbarrier's parity wait cannot tell its phase k from k - 2; a stage's end is a consumer barrier).
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
  float* xs = reinterpret_cast<float*>(sm);
  unsigned char* ring = sm + size_t(K) * 4;
  const size_t rowb = size_t(K) * 2;
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + rowb * nbuf);
  uint64_t* empty = full + nbuf;
  volatile int* slot_row = reinterpret_cast<volatile int*>(empty + nbuf);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int j = 0; j < nbuf; ++j) { mbar_init(&full[j], 1); mbar_init(&empty[j], 1); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int r0 = int((long long)blockIdx.x * N / gridDim.x), r1 = int((long long)(blockIdx.x + 1) * N / gridDim.x);
  const int rows = r1 - r0;
  if (warp == CONS) {   // the producer: every stage's rows of this CTA, in order, as the ring frees
    if (lane == 0) {
      int t = 0;
      auto issue = [&](int s, int r) {
        const int slot = t % nbuf, k = t / nbuf;
        mbar_wait(&empty[slot], (k & 1) ^ 1);
        slot_row[slot] = r;
        mbar_expect(&full[slot], unsigned(rowb));
        bulk_g2s(ring + slot * rowb, Ws[s] + size_t(r) * K, unsigned(rowb), &full[slot]);
        ++t;
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
          const int slot = t % nbuf, k = t / nbuf;
          mbar_wait(&empty[slot], (k & 1) ^ 1);
          slot_row[slot] = -1 - n;
          mbar_arrive(&full[slot]);
          ++t;
        }
      }
    }
    return;
  }
  const int chunks = K / 256;
  int T = 0;   // the stage's first slot use in this CTA's sequence
  for (int s = 0; s < M; ++s) {
    const float* x = s == 0 || N != K ? x0 : ys + size_t(s - 1) * N;
    if (s == 0 || BMODE < 2) {
      for (int i = threadIdx.x; i < K; i += CONS * 32) xs[i] = __ldcg(x + i);
      cons_sync<CONS>();
    }
    int n_s = rows;
    for (int j = warp; DYN || j < rows; j += CONS) {
      const int t = T + j, slot = t % nbuf, k = t / nbuf;
      mbar_wait(&full[slot], k & 1);
      const int r = DYN ? slot_row[slot] : r0 + j;
      if (r < 0) {
        n_s = -1 - r;
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
        break;
      }
      const uint4* row = reinterpret_cast<const uint4*>(ring + slot * rowb);
      float acc = 0.f;
      if (LIGHT) acc = dot8(row[lane], xs + lane * 8);
      else
        for (int c = 0; c < chunks; ++c) acc += dot8(row[c * 32 + lane], xs + (c * 32 + lane) * 8);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
#pragma unroll
      for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) ys[size_t(s) * N + r] = acc * (1.0f / 64.0f);
    }
    T += DYN ? n_s + CONS : rows;
    if (s + 1 == M || BMODE == 3) continue;
    cons_sync<CONS>();
    if (threadIdx.x == 0) {   // the grid barrier (consumers only)
      const unsigned target = (epoch * (M - 1) + s + 1) * gridDim.x;
      if (BMODE == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
      } else {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(bar) : "memory");
      }
      unsigned v;
      do { asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(bar)); } while (v < target);
    }
    cons_sync<CONS>();
  }
}

__global__ void barrier_loop(unsigned* bar, int iters, unsigned epoch, int mode) {
  for (int i = 0; i < iters; ++i) {
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned target = (epoch * iters + i + 1) * gridDim.x;
      if (mode == 0) { __threadfence(); atomicAdd(bar, 1u); }
      else asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(bar) : "memory");
      unsigned v;
      do { asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(bar)); } while (v < target);
    }
    __syncthreads();
  }
}

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);   // a line at a time, also through a pipe
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, dev));
  printf("%s, %d SMs (chain3: persistent, producer warp + ring, consumers at the grid barrier)\n", prop.name, sms);
  struct Cfg { int M, N, K; };
  const Cfg cfgs[] = {{4, 4096, 4096}, {8, 1024, 4096}, {9, 2048, 4096}};
  uint32_t* dummy; CK(cudaMalloc(&dummy, 4));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  const int REPS = 50, COPIES = 3;
  {
    unsigned* bar; CK(cudaMalloc(&bar, 4));
    for (int mode = 0; mode < 2; ++mode)
      for (int threads : {32, 512}) {
        CK(cudaMemset(bar, 0, 4));
        barrier_loop<<<sms, threads, 0, st>>>(bar, 10, 0, mode);
        CK(cudaStreamSynchronize(st));
        CK(cudaMemset(bar, 0, 4));
        CK(cudaEventRecord(e0, st));
        barrier_loop<<<sms, threads, 0, st>>>(bar, 2000, 0, mode);
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
        printf("grid barrier alone (%d CTAs of %d, %s): %.2f us a barrier\n", sms, threads,
               mode ? "red.release" : "fence + atomicAdd", ms * 1000 / 2000);
      }
    CK(cudaFree(bar));
  }
  for (const Cfg& c : cfgs) {
    const size_t per = size_t(c.N) * c.K, bytes = per * 2 * c.M;
    __nv_bfloat16* w; CK(cudaMalloc(&w, bytes * COPIES));
    {
      std::vector<__nv_bfloat16> h(per * c.M);
      uint32_t s = 99;
      for (auto& v : h) { s = s * 1664525u + 1013904223u; v = __float2bfloat16(((s >> 8) & 0xFFFF) / 32768.0f - 1.0f); }
      for (int k = 0; k < COPIES; ++k) CK(cudaMemcpy(w + k * per * c.M, h.data(), bytes, cudaMemcpyHostToDevice));
    }
    float *x0, *ys, *ys2; unsigned* bar;
    CK(cudaMalloc(&x0, c.K * 4)); CK(cudaMalloc(&ys, size_t(c.M) * c.N * 4)); CK(cudaMalloc(&ys2, size_t(c.M) * c.N * 4));
    CK(cudaMalloc(&bar, 4)); CK(cudaMemset(bar, 0, 4));
    unsigned *cnt, *cnt1; CK(cudaMalloc(&cnt, 64 * 4)); CK(cudaMalloc(&cnt1, 64 * 4));
    {
      std::vector<float> hx(c.K);
      for (int i = 0; i < c.K; ++i) hx[i] = std::sin(0.1f * i);
      CK(cudaMemcpy(x0, hx.data(), c.K * 4, cudaMemcpyHostToDevice));
    }
    std::vector<const __nv_bfloat16*> hp(size_t(c.M) * COPIES);
    for (int k = 0; k < COPIES; ++k) for (int i = 0; i < c.M; ++i) hp[k * c.M + i] = w + (size_t(k) * c.M + i) * per;
    const __nv_bfloat16** dp; CK(cudaMalloc(&dp, hp.size() * sizeof(void*)));
    CK(cudaMemcpy(dp, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
    auto time = [&](auto&& fn) {
      for (int i = 0; i < 5; ++i) fn(i);
      CK(cudaStreamSynchronize(st));
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < REPS; ++i) fn(i);
      CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); return ms * 1000 / REPS;
    };
    // reference and baseline: graph of M PDL launches of the plain GEMV
    const size_t smem0 = size_t(c.K) * 4;
    CK(cudaFuncSetAttribute(stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem0)));
    const int grid0 = sms * 2;
    auto xin = [&](float* yb, int i) -> const float* { return i == 0 || c.N != c.K ? x0 : yb + size_t(i - 1) * c.N; };
    std::vector<cudaGraphExec_t> ex(COPIES);
    for (int k = 0; k < COPIES; ++k) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < c.M; ++i) {
        cudaLaunchConfig_t lc = {};
        lc.gridDim = dim3(grid0); lc.blockDim = dim3(THREADS); lc.dynamicSmemBytes = smem0; lc.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        lc.attrs = at; lc.numAttrs = 1;
        CK(cudaLaunchKernelEx(&lc, stage_kernel, hp[k * c.M + i], xin(ys, i), ys + size_t(i) * c.N, c.N, c.K));
      }
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ex[k], g, 0));
    }
    const float t_graph = time([&](int i) { CK(cudaGraphLaunch(ex[i % COPIES], st)); });
    CK(cudaGraphLaunch(ex[0], st)); CK(cudaStreamSynchronize(st));
    std::vector<float> ref(size_t(c.M) * c.N);
    CK(cudaMemcpy(ref.data(), ys, ref.size() * 4, cudaMemcpyDeviceToHost));
    float t_read = 1e9;
    for (int b : {sms * 2, sms * 4, sms * 8})
      t_read = std::min(t_read, time([&](int i) {
        read_all<<<b, 512, 0, st>>>(reinterpret_cast<const uint4*>(w + (i % COPIES) * per * c.M), bytes / 16, dummy);
      }));
    printf("%d stages of %d x %d bf16 (%.1f MB each, %.1f MB): read alone %.1f us; graph of PDL launches %.1f us\n",
           c.M, c.N, c.K, per * 2 / 1e6, bytes / 1e6, t_read, t_graph);
    auto run_dec = [&](auto kern, int mode, int cons, int nbuf) {
      const int PTHREADS = (cons + 1) * 32;
      const size_t smem = size_t(c.K) * 4 + size_t(nbuf) * c.K * 2 + size_t(nbuf) * 20;
      CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      unsigned epoch = 0, epoch1 = 0;
      CK(cudaMemset(bar, 0, 4)); CK(cudaMemset(cnt, 0, 64 * 4)); CK(cudaMemset(cnt1, 0, 64 * 4));
      const int grid = sms;
      // the floor: the same kernel, one stage of all M * N rows
      const float t_one = time([&](int i) { kern<<<grid, PTHREADS, smem, st>>>(dp + (i % COPIES) * c.M, x0, ys2, 1, c.N * c.M, c.K, nbuf, bar, cnt1, epoch1++); });
      const float t_ch = time([&](int i) { kern<<<grid, PTHREADS, smem, st>>>(dp + (i % COPIES) * c.M, x0, ys2, c.M, c.N, c.K, nbuf, bar, cnt, epoch++); });
      CK(cudaMemset(ys2, 0xFF, ref.size() * 4));   // NaN: a row no CTA wrote shows
      kern<<<grid, PTHREADS, smem, st>>>(dp, x0, ys2, c.M, c.N, c.K, nbuf, bar, cnt, epoch++);
      CK(cudaStreamSynchronize(st));
      std::vector<float> b(ref.size());
      CK(cudaMemcpy(b.data(), ys2, b.size() * 4, cudaMemcpyDeviceToHost));
      printf("  mode %d, %2d consumer warps, ring %2d rows (%3zu KB): one stage of all rows %.1f us | chain %.1f us (%.2f us a boundary over it; %.2f under the graph's) | same bits %s\n",
             mode, cons, nbuf, smem / 1024, t_one, t_ch, (t_ch - t_one) / (c.M - 1), (t_graph - t_ch) / (c.M - 1), (mode == 2 || mode == 3 || mode >= 5) ? "n/a" : b == ref ? "yes" : "NO");
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
    CK(cudaFree(w)); CK(cudaFree(x0)); CK(cudaFree(ys)); CK(cudaFree(ys2)); CK(cudaFree(bar)); CK(cudaFree(dp)); CK(cudaFree(cnt)); CK(cudaFree(cnt1));
  }
  return 0;
}
