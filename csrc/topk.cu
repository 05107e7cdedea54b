// The lightning indexer's top-k of decode rows (dsv4_topk_bf16): one CTA per row of bf16 scores,
// a radix select over the scores' order-preserving keys.
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

// out[0..k) = the indices of the k largest of n bf16 scores (1 <= k <= n): those above the
// threshold key in index order, then ties at it in index order. One CTA per row of scores (CTA r:
// sc + r * n -> out + r * k): two 8-bit radix passes find the threshold, one pass compacts.
// Deterministic.
__global__ void __launch_bounds__(1024) topk_bf16_kernel(const uint16_t* sc, int n, int k, int64_t* out) {
  __shared__ int hist[256];
  __shared__ int wsum[32];
  __shared__ int bin, above;
  const int tid = threadIdx.x, nt = blockDim.x;
  sc += size_t(blockIdx.x) * n;
  out += size_t(blockIdx.x) * k;
  pdl_wait();
  for (int i = tid; i < 256; i += nt) hist[i] = 0;
  __syncthreads();
  for (int i = tid; i < n; i += nt) atomicAdd(hist + (bf16_key(sc[i]) >> 8), 1);
  __syncthreads();
  if (tid < 32) find_bin(hist, k, &bin, &above);
  __syncthreads();
  const uint32_t hi = uint32_t(bin);
  const int above1 = above;
  for (int i = tid; i < 256; i += nt) hist[i] = 0;
  __syncthreads();
  for (int i = tid; i < n; i += nt) {
    const uint32_t u = bf16_key(sc[i]);
    if ((u >> 8) == hi) atomicAdd(hist + (u & 0xFFu), 1);
  }
  __syncthreads();
  if (tid < 32) find_bin(hist, k - above1, &bin, &above);
  __syncthreads();
  const uint32_t thr = (hi << 8) | uint32_t(bin);
  const int n_gt = above1 + above;        // keys above the threshold (< k)
  const int per = (n + nt - 1) / nt, i0 = min(n, tid * per), i1 = min(n, i0 + per);
  int gt = 0, eq = 0;
  for (int i = i0; i < i1; ++i) {
    const uint32_t u = bf16_key(sc[i]);
    gt += u > thr;
    eq += u == thr;
  }
  int tot;
  int og = block_scan(gt, wsum, &tot);
  int oe = block_scan(eq, wsum, &tot);
  for (int i = i0; i < i1; ++i) {
    const uint32_t u = bf16_key(sc[i]);
    if (u > thr)
      out[og++] = i;
    else if (u == thr && n_gt + oe < k)
      out[n_gt + oe++] = i;
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
