// The lightning indexer's top-k of decode rows (dsv4_topk_bf16): a radix select over the scores'
// order-preserving keys (a 12-bit then a 4-bit digit, 16-byte loads, a compaction in index order):
// one CTA per row of bf16 scores (its keys in registers up to 8,192 scores); on sm_90 from 16,384
// scores a cluster of CTAs per row, its keys
// held in registers up to 262,144 scores (a 1M-token context's ratio-4 index), read again each
// pass beyond.
#include "dsv4_api.h"
#include "dsv4_common.cuh"

#include <cooperative_groups.h>

namespace cg = cooperative_groups;

// A stage mark of topk_bf16_regs_kernel: nothing in the library; profiles/ubench/topk_stages.cu
// defines it to record each stage's clock.
#ifndef TOPK_MARK
#define TOPK_MARK(i)
#endif

namespace {

// Exclusive prefix sum over the CTA (any blockDim multiple of 32); *total = the sum.
DEV int block_scan(int v, int* wsum, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int inc = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int t = __shfl_up_sync(FULL, inc, off);
    if (lane >= off) inc += t;
  }
  if (lane == 31) wsum[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nwarps ? wsum[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int t = __shfl_up_sync(FULL, w, off);
      if (lane >= off) w += t;
    }
    if (lane < nwarps) wsum[lane] = w;
  }
  __syncthreads();
  const int base = warp > 0 ? wsum[warp - 1] : 0;
  *total = wsum[nwarps - 1];
  __syncthreads();
  return base + inc - v;
}

// bf16 bits -> a key whose unsigned order is the float order.
DEV uint32_t bf16_key(uint16_t b) { return (b & 0x8000u) ? (~uint32_t(b) & 0xFFFFu) : (b | 0x8000u); }

// The 16-bit key in two digits: the high 12 bits (sign, exponent, 3 mantissa bits: a row's scores
// spread over many of its 4,096 bins, so few atomics collide), then the low 4.
constexpr int LO_BITS = 4, NHI = 1 << (16 - LO_BITS), NLO = 1 << LO_BITS;

// The bin (counting from the top) holding the k-th largest key of hist[0..nbins), and how many
// keys lie in higher bins, into *bin / *above. Every thread of the CTA calls it; thread t sums c
// consecutive bins from the top.
DEV void find_bin(const int* hist, int nbins, int k, int* wsum, int* bin, int* above) {
  const int nt = blockDim.x, c = (nbins + nt - 1) / nt;
  const int top = nbins - 1 - int(threadIdx.x) * c;          // this thread's highest bin
  int s = 0;
  for (int j = 0; j < c && top - j >= 0; ++j) s += hist[top - j];
  int tot;
  int acc = block_scan(s, wsum, &tot);                        // keys in the bins above
  if (acc < k && acc + s >= k)
    for (int j = 0; j < c && top - j >= 0; ++j) {
      if (acc + hist[top - j] >= k) {
        *bin = top - j;
        *above = acc;
        break;
      }
      acc += hist[top - j];
    }
  __syncthreads();
}

// After the high digits' histogram hist[0..NHI): the high digit of the k-th largest key (the
// threshold's), the keys in higher bins into *above1, and hist[0..NLO) cleared for the low digit's.
// Every thread of the CTA calls it.
DEV uint32_t high_digit(int* hist, int k, int* wsum, int* bin, int* above, int* above1) {
  find_bin(hist, NHI, k, wsum, bin, above);
  const uint32_t hi = uint32_t(*bin);
  *above1 = *above;
  __syncthreads();                        // everyone has read bin / above and is past hist
  for (int i = threadIdx.x; i < NLO; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  return hi;
}

// The eight keys of eight bf16 scores (one 16-byte load).
DEV void keys8(const uint16_t* p, uint32_t* u) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u[2 * j] = bf16_key(uint16_t(w[j] & 0xFFFFu));
    u[2 * j + 1] = bf16_key(uint16_t(w[j] >> 16));
  }
}

// Count each bin b >= 0 of the warp's lanes: one atomic for the warp where all 32 lanes hold the
// same bin (a masked tail of -inf, a row of equal scores), else one per lane.
DEV void count(int* hist, int b) {
  const int b0 = __shfl_sync(FULL, b, 0);
  if (__all_sync(FULL, b == b0)) {
    if ((threadIdx.x & 31) == 0 && b0 >= 0) atomicAdd(hist + b0, 32);
  } else if (b >= 0) {
    atomicAdd(hist + b, 1);
  }
}

// FIRST: hist[key >> LO_BITS] += 1 for every key of the row; else hist[key & (NLO - 1)] += 1 for
// the keys whose high digit is `hi`. PER = 8: 16-byte loads (the row 16-byte aligned, n % 8 == 0),
// else one score a load; coalesced. Every lane runs every iteration (count's warp votes).
template <bool FIRST, int PER>
DEV void histogram(const uint16_t* sc, int n, uint32_t hi, int* hist) {
  for (int t0 = 0; t0 < n; t0 += PER * blockDim.x) {
    const int i = t0 + PER * threadIdx.x;
    uint32_t u[PER];
    if (i < n) {
      if (PER == 8)
        keys8(sc + i, u);
      else
        u[0] = bf16_key(sc[i]);
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      int b = -1;
      if (i < n) {
        if (FIRST)
          b = int(u[j] >> LO_BITS);
        else if ((u[j] >> LO_BITS) == hi)
          b = int(u[j] & (NLO - 1));
      }
      count(hist, b);
    }
  }
}

// out[0..k) = the indices of the k largest of n bf16 scores (1 <= k <= n): those above the
// threshold key in index order, then ties at it in index order. One CTA per row of scores (CTA r:
// sc + r * n -> out + r * k): two radix passes (12 + 4 bits) find the threshold, one pass over
// tiles of the row (8 scores a thread) compacts, stopping once all k are out. Deterministic. The
// GPUs without thread-block clusters (sm_89) run this one.
__global__ void __launch_bounds__(1024) topk_bf16_kernel(const uint16_t* sc, int n, int k, int64_t* out) {
  __shared__ int hist[NHI];
  __shared__ int wsum[32];
  __shared__ int bin, above;
  const int tid = threadIdx.x, nt = blockDim.x;
  sc += size_t(blockIdx.x) * n;
  out += size_t(blockIdx.x) * k;
  const bool vec = n % 8 == 0 && (reinterpret_cast<uintptr_t>(sc) & 15) == 0;
  pdl_wait();
  for (int i = tid; i < NHI; i += nt) hist[i] = 0;
  __syncthreads();
  if (vec)
    histogram<true, 8>(sc, n, 0, hist);
  else
    histogram<true, 1>(sc, n, 0, hist);
  __syncthreads();
  int above1;
  const uint32_t hi = high_digit(hist, k, wsum, &bin, &above, &above1);
  if (vec)
    histogram<false, 8>(sc, n, hi, hist);
  else
    histogram<false, 1>(sc, n, hi, hist);
  __syncthreads();
  find_bin(hist, NLO, k - above1, wsum, &bin, &above);
  const uint32_t thr = (hi << LO_BITS) | uint32_t(bin);
  const int n_gt = above1 + above;        // keys above the threshold (< k)
  const int per = vec ? 8 : 1;
  int gbase = 0, ebase = 0;               // keys above / at the threshold in earlier tiles
  for (int t0 = 0; t0 < n && (gbase < n_gt || n_gt + ebase < k); t0 += per * nt) {
    const int i0 = t0 + per * tid;
    uint32_t u[8];
    int gt = 0, eq = 0;
    if (i0 < n) {
      if (vec)
        keys8(sc + i0, u);
      else
        u[0] = bf16_key(sc[i0]);
      for (int j = 0; j < per; ++j) {
        gt += u[j] > thr;
        eq += u[j] == thr;
      }
    }
    int tot;                              // gt in the low 16 bits, eq in the high (<= 8192 each)
    const int off = block_scan(gt | (eq << 16), wsum, &tot);
    int og = gbase + (off & 0xFFFF), oe = ebase + (off >> 16);
    if (i0 < n)
      for (int j = 0; j < per; ++j) {
        if (u[j] > thr)
          out[og++] = i0 + j;
        else if (u[j] == thr && n_gt + oe < k)
          out[n_gt + oe++] = i0 + j;
      }
    gbase += tot & 0xFFFF;
    ebase += tot >> 16;
  }
}


// As topk_bf16_kernel (the same output, index for index) for a row of at most PER * blockDim.x
// scores (PER = 8: 16-byte loads, the row 16-byte aligned, n % 8 == 0; else 1): a thread's PER
// keys are read once into registers for both histograms and the compaction, and the CTA has only
// as many threads as hold keys (128 for a 4K context's 1,024 scores, not 1,024 threads reading
// the row three times). Its shared histogram is cleared before the PDL wait.
template <int PER>
__global__ void __launch_bounds__(1024) topk_bf16_reg_kernel(const uint16_t* sc, int n, int k, int64_t* out) {
  __shared__ int hist[NHI];
  __shared__ int wsum[32];
  __shared__ int bin, above;
  const int tid = threadIdx.x, nt = blockDim.x, i0 = PER * tid;
  sc += size_t(blockIdx.x) * n;
  out += size_t(blockIdx.x) * k;
  for (int i = tid; i < NHI; i += nt) hist[i] = 0;
  pdl_wait();
  const bool mine = i0 < n;
  uint32_t u[PER];
  if (mine) {
    if (PER == 8)
      keys8(sc + i0, u);
    else
      u[0] = bf16_key(sc[i0]);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < PER; ++j) count(hist, mine ? int(u[j] >> LO_BITS) : -1);   // every lane
  __syncthreads();
  int above1;
  const uint32_t hi = high_digit(hist, k, wsum, &bin, &above, &above1);
#pragma unroll
  for (int j = 0; j < PER; ++j)
    count(hist, mine && (u[j] >> LO_BITS) == hi ? int(u[j] & (NLO - 1)) : -1);
  __syncthreads();
  find_bin(hist, NLO, k - above1, wsum, &bin, &above);
  const uint32_t thr = (hi << LO_BITS) | uint32_t(bin);
  const int n_gt = above1 + above;        // keys above the threshold (< k)
  int gt = 0, eq = 0;
  if (mine)
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      gt += u[j] > thr;
      eq += u[j] == thr;
    }
  int tot;                                // gt in the low 16 bits, eq in the high (<= 8192 each)
  const int off = block_scan(gt | (eq << 16), wsum, &tot);
  int og = off & 0xFFFF, oe = off >> 16;
  if (mine)
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      if (u[j] > thr)
        out[og++] = i0 + j;
      else if (u[j] == thr && n_gt + oe < k)
        out[n_gt + oe++] = i0 + j;
    }
}

// ---- sm_90: a cluster of CTAs per row ------------------------------------------------------------
// One CTA streams a long row at a fraction of the GPU's bandwidth (a 262,144-score row of a
// 1M-token context took ~140 us); a cluster of CLUSTER CTAs splits the row into consecutive
// segments and shares the histograms and counts through distributed shared memory.

constexpr int CLUSTER = 8;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Sum of the cluster's copies of hist[0..nbins) into tot (every CTA gets the whole histogram).
DEV void cluster_sum(cg::cluster_group& cl, int* hist, int nbins, int* tot) {
  for (int b = threadIdx.x; b < nbins; b += blockDim.x) {
    int v[CLUSTER];
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) v[r] = cl.map_shared_rank(hist, r)[b];
    int s = 0;
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) s += v[r];
    tot[b] = s;
  }
  __syncthreads();
}

// The keys above / at the threshold in the cluster's lower ranks: the sums of cnt[0] / cnt[1]
// (each CTA's counts, published before a cluster sync) over ranks 0 .. rank - 1.
DEV void cluster_prefix(cg::cluster_group& cl, int* cnt, int rank, int* gbase, int* ebase) {
  int g = 0, e = 0;
  for (int r = 0; r < rank; ++r) {
    const int* c = cl.map_shared_rank(cnt, r);
    g += c[0];
    e += c[1];
  }
  *gbase = g;
  *ebase = e;
}
#endif

// gt / eq of the CTA's segment sc[0..n) against the threshold key, summed over the CTA (every
// thread gets both).
template <int PER>
DEV void count_segment(const uint16_t* sc, int n, uint32_t thr, int* wsum, int* gt, int* eq) {
  int g = 0, e = 0;
  for (int i = PER * threadIdx.x; i < n; i += PER * blockDim.x) {
    uint32_t u[PER];
    if (PER == 8)
      keys8(sc + i, u);
    else
      u[0] = bf16_key(sc[i]);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      g += u[j] > thr;
      e += u[j] == thr;
    }
  }
  int tot;                                  // (a segment may hold 65,536 or more: no packing)
  block_scan(g, wsum, &tot);
  *gt = tot;
  block_scan(e, wsum, &tot);
  *eq = tot;
}

// As topk_bf16_kernel, with the row split over the CTAs of a cluster (blockIdx.x = the rank, the
// row's segment [rank * seg, (rank + 1) * seg), seg a multiple of 8): each CTA histograms its
// segment, every CTA sums the cluster's histograms and finds the same threshold, counts its
// segment's keys above / at it, and writes them after those of the lower ranks. The same output,
// bit for bit. Deterministic.
__global__ void __launch_bounds__(1024) topk_bf16_cluster_kernel(const uint16_t* sc, int n, int seg, int k,
                                                                int64_t* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ int hist[NHI], tot[NHI];
  __shared__ int hist2[NLO];
  __shared__ int wsum[32];
  __shared__ int cnt[2];
  __shared__ int bin, above;
  cg::cluster_group cl = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x, rank = int(cl.block_rank());
  sc += size_t(blockIdx.y) * n;
  out += size_t(blockIdx.y) * k;
  const int s0 = min(n, rank * seg), len = min(n, s0 + seg) - s0;
  const bool vec = n % 8 == 0 && (reinterpret_cast<uintptr_t>(sc) & 15) == 0;
  const uint16_t* mine = sc + s0;
  pdl_wait();
  for (int i = tid; i < NHI; i += nt) hist[i] = 0;
  for (int i = tid; i < NLO; i += nt) hist2[i] = 0;
  __syncthreads();
  if (vec)
    histogram<true, 8>(mine, len, 0, hist);
  else
    histogram<true, 1>(mine, len, 0, hist);
  cl.sync();                                // every CTA's hist complete
  cluster_sum(cl, hist, NHI, tot);
  find_bin(tot, NHI, k, wsum, &bin, &above);
  const uint32_t hi = uint32_t(bin);
  const int above1 = above;
  if (vec)
    histogram<false, 8>(mine, len, hi, hist2);
  else
    histogram<false, 1>(mine, len, hi, hist2);
  cl.sync();                                // every CTA's hist2 complete
  cluster_sum(cl, hist2, NLO, tot);         // (tot: this CTA's own, read by nobody else)
  __syncthreads();
  find_bin(tot, NLO, k - above1, wsum, &bin, &above);
  const uint32_t thr = (hi << LO_BITS) | uint32_t(bin);
  const int n_gt = above1 + above;          // keys above the threshold in the row (< k)
  int my_gt, my_eq;
  if (vec)
    count_segment<8>(mine, len, thr, wsum, &my_gt, &my_eq);
  else
    count_segment<1>(mine, len, thr, wsum, &my_gt, &my_eq);
  if (tid == 0) {
    cnt[0] = my_gt;
    cnt[1] = my_eq;
  }
  cl.sync();                                // every CTA's counts published
  int gbase, ebase;                         // keys above / at the threshold in lower ranks
  cluster_prefix(cl, cnt, rank, &gbase, &ebase);
  cl.sync();                                // no CTA reads another's shared memory after this
  const int gend = gbase + my_gt, eend = ebase + my_eq;
  const int per = vec ? 8 : 1;
  for (int t0 = 0; t0 < len && (gbase < gend || (ebase < eend && n_gt + ebase < k)); t0 += per * nt) {
    const int i0 = t0 + per * tid;
    uint32_t u[8];
    int gt = 0, eq = 0;
    if (i0 < len) {
      if (vec)
        keys8(mine + i0, u);
      else
        u[0] = bf16_key(mine[i0]);
      for (int j = 0; j < per; ++j) {
        gt += u[j] > thr;
        eq += u[j] == thr;
      }
    }
    int tt;
    const int off = block_scan(gt | (eq << 16), wsum, &tt);
    int og = gbase + (off & 0xFFFF), oe = ebase + (off >> 16);
    if (i0 < len)
      for (int j = 0; j < per; ++j) {
        if (u[j] > thr)
          out[og++] = s0 + i0 + j;
        else if (u[j] == thr && n_gt + oe < k)
          out[n_gt + oe++] = s0 + i0 + j;
      }
    gbase += tt & 0xFFFF;
    ebase += tt >> 16;
  }
#endif
}


// ---- sm_90: a cluster of CTAs per row, its keys held in registers -------------------------------
// topk_bf16_cluster_kernel reads its segment from L2 four times over (two histograms, the counts,
// the compaction), each pass a chain of dependent 16-byte loads, and sums all 4,096 bins of every
// CTA's histogram in every CTA: ~32 us for a 1M-token context's 260,000 scores on an H200,
// against ~0.1 us of bytes. This one loads its segment once (up to REG_GROUPS 16-byte groups of 8
// consecutive scores a thread, all requested at once, turned into keys in place) and runs every
// pass on the registers; each CTA sums only the 4,096 / CLUSTER bins it owns over the cluster,
// and the CTAs find the threshold's bin through the owners' totals. The -inf scores (the entries
// not yet visible: most of a long cache early on) are counted in registers, not by atomics that
// would all hit one bin. (profiles/ubench/topk_stages.cu times its stages.)

constexpr int REG_THREADS = 1024, REG_GROUPS = 4;
constexpr int REG_SEG = REG_GROUPS * 8 * REG_THREADS;   // the longest segment it takes (32,768)
constexpr int OWN = NHI / CLUSTER;                        // bins a CTA owns
constexpr uint32_t NEG_INF_KEY = 0x007Fu;                 // bf16_key of -inf (0xFF80)

// bf16_key of the two bf16 halves of w, in place.
DEV uint32_t bf16_key2(uint32_t w) {
  const uint32_t neg = (w >> 15) & 0x00010001u;           // 1 in each half whose sign is set
  return w ^ ((neg * 0xFFFFu) | 0x80008000u);
}

// Inclusive prefix sum over the warp's lanes.
DEV int warp_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int t = __shfl_up_sync(FULL, v, off);
    if (lane >= off) v += t;
  }
  return v;
}

DEV int warp_sum(int v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
  return v;
}

// As topk_bf16_cluster_kernel (the same output, bit for bit) for segments of at most REG_SEG
// scores: thread t holds the per = 8 * groups consecutive scores from per * t of its CTA's segment
// (the order the compaction writes them in).
__global__ void __launch_bounds__(REG_THREADS) topk_bf16_regs_kernel(const uint16_t* sc, int n, int seg, int k,
                                                                    int64_t* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ int hist[NHI];
  __shared__ __align__(16) int own[OWN];
  __shared__ int hist2[NLO];
  __shared__ int wsum[32];
  __shared__ int owned, cnt[2];
  __shared__ int bin, above, sl;
  cg::cluster_group cl = cg::this_cluster();
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, rank = int(cl.block_rank());
  sc += size_t(blockIdx.y) * n;
  out += size_t(blockIdx.y) * k;
  const int s0 = min(n, rank * seg), len = min(n, s0 + seg) - s0;
  const bool vec = n % 8 == 0 && (reinterpret_cast<uintptr_t>(sc) & 15) == 0;
  const int ng = (len + 8 * nt - 1) / (8 * nt);           // groups a thread (<= REG_GROUPS)
  const int per = 8 * ng, first = per * tid;              // this thread's scores: [first, first + nv)
  const int nv = max(0, min(per, len - first));
  const uint16_t* mine = sc + s0 + first;
  pdl_wait();
  TOPK_MARK(0);
  uint32_t kw[REG_GROUPS][4];                             // keys 2i, 2i + 1 of group s in kw[s][i]
#pragma unroll
  for (int s = 0; s < REG_GROUPS; ++s) {
    kw[s][0] = kw[s][1] = kw[s][2] = kw[s][3] = 0;
    if (8 * s < nv) {
      if (vec) {
        const uint4 v = *reinterpret_cast<const uint4*>(mine + 8 * s);
        kw[s][0] = v.x; kw[s][1] = v.y; kw[s][2] = v.z; kw[s][3] = v.w;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (8 * s + j < nv) kw[s][j >> 1] |= uint32_t(mine[8 * s + j]) << (16 * (j & 1));
      }
    }
  }
#pragma unroll
  for (int s = 0; s < REG_GROUPS; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) kw[s][i] = bf16_key2(kw[s][i]);
  auto key = [&](int s, int j) { return (kw[s][j >> 1] >> (16 * (j & 1))) & 0xFFFFu; };
  // f(key, its index in the segment) for each of this thread's keys, in index order
  auto each_key = [&](auto f) {
#pragma unroll
    for (int s = 0; s < REG_GROUPS; ++s)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (8 * s + j < nv) f(key(s, j), first + 8 * s + j);
  };
  for (int i = tid; i < NHI; i += nt) hist[i] = 0;
  if (tid < NLO) hist2[tid] = 0;
  if (tid == 0) owned = 0;
  __syncthreads();
  int ninf = 0;
  each_key([&](uint32_t u, int) {
    if (u == NEG_INF_KEY)
      ++ninf;
    else
      atomicAdd(hist + (u >> LO_BITS), 1);
  });
  ninf = warp_sum(ninf);
  if (lane == 0 && ninf) atomicAdd(hist + (NEG_INF_KEY >> LO_BITS), ninf);
  TOPK_MARK(1);
  cl.sync();                                  // every CTA's hist complete
  TOPK_MARK(2);
  // the cluster's sums of the bins this CTA owns, [rank * OWN, (rank + 1) * OWN), and their total
  int mysum = 0;
  for (int b = tid; b < OWN; b += nt) {
    int v[CLUSTER];
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) v[r] = cl.map_shared_rank(hist, r)[rank * OWN + b];
    int sum = 0;
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) sum += v[r];
    own[b] = sum;
    mysum += sum;
  }
  mysum = warp_sum(mysum);
  if (lane == 0 && mysum) atomicAdd(&owned, mysum);
  TOPK_MARK(3);
  cl.sync();                                  // every CTA's own[] and owned published
  // one warp finds the threshold's 12-bit bin: the owner whose bins hold the k-th largest key
  // (lane i: owner C - 1 - i, from the top), then the bin among its OWN (lane l: 16 bins from the
  // top, read as four 16-byte pieces of its shared memory)
  static_assert(OWN == 32 * 16, "a lane takes 16 of an owner's bins");
  if (tid < 32) {
    const int t = tid < CLUSTER ? *cl.map_shared_rank(&owned, CLUSTER - 1 - tid) : 0;
    const int incl = warp_scan(t);
    const int win = __ffs(__ballot_sync(FULL, tid < CLUSTER && incl >= k)) - 1;
    const int owner = CLUSTER - 1 - win, kk = k - __shfl_sync(FULL, incl - t, win);
    const int lo = OWN - 16 * (tid + 1);                  // this lane's lowest bin
    const int4* p = reinterpret_cast<const int4*>(cl.map_shared_rank(own, owner) + lo);
    int sum = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int4 v = p[q];
      sum += v.x + v.y + v.z + v.w;
    }
    const int incl2 = warp_scan(sum);
    int acc = incl2 - sum;                                // keys in the owner's higher bins
    if (acc < kk && incl2 >= kk) {                        // (one lane) its bins again, top down
      const int* b = cl.map_shared_rank(own, owner) + lo;
      for (int j = 15; j >= 0; --j) {
        const int c = b[j];
        if (acc + c >= kk) {
          bin = lo + j;
          above = acc + (k - kk);
          sl = owner;
          break;
        }
        acc += c;
      }
    }
  }
  __syncthreads();
  const uint32_t hi = uint32_t(sl * OWN + bin);
  const int above1 = above;                   // keys above the bin in the row
  TOPK_MARK(4);
  ninf = 0;
  int gt_hi = 0, inb = 0;                     // this thread's keys above the bin / in it
  each_key([&](uint32_t u, int) {
    const uint32_t d = u >> LO_BITS;
    gt_hi += d > hi;
    inb += d == hi;
    if (u == NEG_INF_KEY)
      ++ninf;
    else if (d == hi)
      atomicAdd(hist2 + (u & (NLO - 1)), 1);
  });
  if (hi == (NEG_INF_KEY >> LO_BITS)) {       // (uniform)
    ninf = warp_sum(ninf);
    if (lane == 0 && ninf) atomicAdd(hist2 + (NEG_INF_KEY & (NLO - 1)), ninf);
  }
  TOPK_MARK(5);
  cl.sync();                                  // every CTA's hist2 complete
  if (tid < 32) {                             // lane l < NLO: low digit NLO - 1 - l, from the top
    int sum = 0;
    if (tid < NLO) {
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) sum += cl.map_shared_rank(hist2, r)[NLO - 1 - tid];
    }
    const int incl = warp_scan(sum);
    const int win = __ffs(__ballot_sync(FULL, tid < NLO && incl >= k - above1)) - 1;
    if (tid == win) {
      bin = NLO - 1 - tid;
      above = above1 + incl - sum;
    }
  }
  __syncthreads();
  const uint32_t thr = (hi << LO_BITS) | uint32_t(bin);
  const int n_gt = above;                     // keys above the threshold in the row (< k)
  TOPK_MARK(6);
  int gt = gt_hi, eq = 0;                     // this thread's keys above / at the threshold
  if (inb)                                    // its keys in the threshold's bin, again
    each_key([&](uint32_t u, int) {
      if ((u >> LO_BITS) == hi) {
        gt += u > thr;
        eq += u == thr;
      }
    });
  int tt;                                     // gt in the low 16 bits, eq in the high (<= 32,768)
  const int off = block_scan(gt | (eq << 16), wsum, &tt);
  if (tid == 0) {
    cnt[0] = tt & 0xFFFF;
    cnt[1] = tt >> 16;
  }
  TOPK_MARK(7);
  cl.sync();                                  // every CTA's counts published
  int gbase, ebase;                           // keys above / at the threshold in lower ranks
  cluster_prefix(cl, cnt, rank, &gbase, &ebase);
  cl.barrier_arrive();                        // done with the others' shared memory
  int og = gbase + (off & 0xFFFF), oe = ebase + (off >> 16);
  if (gt | eq)
    each_key([&](uint32_t u, int i) {
      if (u > thr)
        out[og++] = s0 + i;
      else if (u == thr && n_gt + oe < k)
        out[n_gt + oe++] = s0 + i;
    });
  TOPK_MARK(8);
  cl.barrier_wait();                          // no CTA exits while another reads its shared memory
  TOPK_MARK(9);
#endif
}

}  // namespace

extern "C" {


// out [rows, k] int64 = per row, the indices of the k largest of scores [rows, n] bf16
// (1 <= k <= n), see topk_bf16_kernel. One CTA per row (topk_bf16_reg_kernel where the row fits
// its threads' registers: up to 8,192 scores); from CLUSTER_MIN_N scores on a GPU with
// thread-block clusters (sm_90), a cluster of CLUSTER CTAs per row: topk_bf16_regs_kernel where a
// CTA's segment fits its registers (n <= CLUSTER * REG_SEG), else topk_bf16_cluster_kernel. The
// same output from all four.
int dsv4_topk_bf16(const void* scores, int n, int k, void* out, int rows, void* stream, int pdl) {
  constexpr int CLUSTER_MIN_N = 16384;
  if (k < 1 || k > n || rows < 1) return -1;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const uint16_t* sc = static_cast<const uint16_t*>(scores);
  int64_t* o = static_cast<int64_t*>(out);
  int dev = 0, major = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return err;
  }
  if (major < 9 || n < CLUSTER_MIN_N) {
    const bool vec = n % 8 == 0 && (reinterpret_cast<uintptr_t>(sc) & 15) == 0;
    const int per = vec ? 8 : 1;          // a row of at most per * 1,024 scores: in registers
    if (n <= per * 1024) {
      const int threads = ((n + per - 1) / per + 31) / 32 * 32;
      return vec ? launch(topk_bf16_reg_kernel<8>, dim3(rows), dim3(threads), 0, st, pdl, sc, n, k, o)
                 : launch(topk_bf16_reg_kernel<1>, dim3(rows), dim3(threads), 0, st, pdl, sc, n, k, o);
    }
    return launch(topk_bf16_kernel, dim3(rows), dim3(1024), 0, st, pdl, sc, n, k, o);
  }
  const int seg = ((n + CLUSTER - 1) / CLUSTER + 7) / 8 * 8;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(CLUSTER, rows);
  cfg.blockDim = dim3(seg <= REG_SEG ? REG_THREADS : 1024);
  cfg.stream = st;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CLUSTER;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  err = seg <= REG_SEG ? cudaLaunchKernelEx(&cfg, topk_bf16_regs_kernel, sc, n, seg, k, o)
                       : cudaLaunchKernelEx(&cfg, topk_bf16_cluster_kernel, sc, n, seg, k, o);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

}  // extern "C"
