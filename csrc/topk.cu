// The lightning indexer's top-k of decode rows (dsv4_topk_bf16): one CTA per row of bf16 scores,
// a radix select over the scores' order-preserving keys (warp-aggregated histograms, 16-byte
// loads, a tiled compaction that stops once the k are out).
#include "dsv4_api.h"
#include "dsv4_common.cuh"

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

// The bin (from the top) holding the k-th largest key of a 256-bin histogram, and how many keys lie
// in higher bins. Warp 0; lane l sums bins 255 - 8l .. 248 - 8l.
DEV void find_bin(const int* hist, int k, int* bin, int* above) {
  const int lane = threadIdx.x & 31;
  int c[8], s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    c[j] = hist[255 - 8 * lane - j];
    s += c[j];
  }
  int inc = s;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int t = __shfl_up_sync(FULL, inc, off);
    if (lane >= off) inc += t;
  }
  const int pre = inc - s;
  if (pre < k && inc >= k) {
    int acc = pre;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (acc + c[j] >= k) {
        *bin = 255 - 8 * lane - j;
        *above = acc;
        break;
      }
      acc += c[j];
    }
  }
}

// Add 1 to hist[b] for each calling lane: one shared atomic per distinct bin of the warp (the
// scores of a row crowd into a few bins; 32 lanes on one address would serialize).
DEV void hist_add(int* hist, uint32_t b) {
  const unsigned peers = __match_any_sync(__activemask(), b);
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + b, __popc(peers));
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

// hist[key >> SHIFT] += 1 for every key of the row whose key >> 8 is `hi` (SHIFT 0) or for every
// key (SHIFT 8). VEC: 16-byte loads (the row 16-byte aligned, n % 8 == 0), coalesced.
template <int SHIFT>
DEV void histogram(const uint16_t* sc, int n, bool vec, uint32_t hi, int* hist) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if (vec) {
    for (int i = 8 * tid; i < n; i += 8 * nt) {
      uint32_t u[8];
      keys8(sc + i, u);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (SHIFT == 8 || (u[j] >> 8) == hi) hist_add(hist, (u[j] >> SHIFT) & 0xFFu);
    }
  } else {
    for (int i = tid; i < n; i += nt) {
      const uint32_t u = bf16_key(sc[i]);
      if (SHIFT == 8 || (u >> 8) == hi) hist_add(hist, (u >> SHIFT) & 0xFFu);
    }
  }
}

// out[0..k) = the indices of the k largest of n bf16 scores (1 <= k <= n): those above the
// threshold key in index order, then ties at it in index order. One CTA per row of scores (CTA r:
// sc + r * n -> out + r * k): two 8-bit radix passes find the threshold, one pass over tiles of
// the row (8 scores a thread) compacts, stopping once all k are out. Deterministic.
__global__ void __launch_bounds__(1024) topk_bf16_kernel(const uint16_t* sc, int n, int k, int64_t* out) {
  __shared__ int hist[256];
  __shared__ int wsum[32];
  __shared__ int bin, above;
  const int tid = threadIdx.x, nt = blockDim.x;
  sc += size_t(blockIdx.x) * n;
  out += size_t(blockIdx.x) * k;
  const bool vec = n % 8 == 0 && (reinterpret_cast<uintptr_t>(sc) & 15) == 0;
  pdl_wait();
  for (int i = tid; i < 256; i += nt) hist[i] = 0;
  __syncthreads();
  histogram<8>(sc, n, vec, 0, hist);
  __syncthreads();
  if (tid < 32) find_bin(hist, k, &bin, &above);
  __syncthreads();
  const uint32_t hi = uint32_t(bin);
  const int above1 = above;
  for (int i = tid; i < 256; i += nt) hist[i] = 0;
  __syncthreads();
  histogram<0>(sc, n, vec, hi, hist);
  __syncthreads();
  if (tid < 32) find_bin(hist, k - above1, &bin, &above);
  __syncthreads();
  const uint32_t thr = (hi << 8) | uint32_t(bin);
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

}  // namespace

extern "C" {


// out [rows, k] int64 = per row, the indices of the k largest of scores [rows, n] bf16
// (1 <= k <= n), see topk_bf16_kernel. One CTA per row.
int dsv4_topk_bf16(const void* scores, int n, int k, void* out, int rows, void* stream, int pdl) {
  if (k < 1 || k > n || rows < 1) return -1;
  const int threads = n >= 1024 ? 1024 : ((n + 31) / 32) * 32;
  return launch(topk_bf16_kernel, dim3(rows), dim3(threads), 0, static_cast<cudaStream_t>(stream), pdl,
                static_cast<const uint16_t*>(scores), n, k, static_cast<int64_t*>(out));
}

}  // extern "C"
