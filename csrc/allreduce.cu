// The one-shot all-reduce of a small message (a few KB: one token's hidden state) across the GPUs
// of one host, over peer memory (dsv4.parallel.oneshot; the C interface in dsv4_api.h).
//
// Each rank owns one buffer (cudaMalloc, shared with the other ranks through CUDA IPC handles):
//
//   [epochs: one uint32 per CTA, this rank's own]  [flags: CTA x source rank, uint32]
//   [data: 2 parities x AR_MAX_RANKS sources x cap bytes]
//
// One launch, ceil(nbytes / chunk) CTAs; CTA b owns bytes [b * chunk, (b + 1) * chunk) of every
// message and of every slot, whatever the message size, so CTAs never share a region. CTA b:
//   1. reads its epoch e = epochs[b] + 1 (device memory: a replayed CUDA graph stays in step);
//   2. pushes its chunk of this rank's input into data[e & 1][rank] of every rank (own included);
//   3. writes e into flags[b][rank] of every rank (release, system scope, after a CTA barrier);
//   4. waits until flags[b][r] >= e in its own buffer for every rank r (acquire), with a timeout;
//   5. sums data[e & 1][0..n-1] in rank order in float32 and writes the output (in place allowed);
//   6. stores epochs[b] = e.
// Two parities suffice: a rank pushes epoch e + 2 into a slot only after every rank's flag of
// e + 1, which each writes after it finished reading the slot of epoch e. The sum runs in the same
// order on every rank from the same bytes: every rank gets the same bits, on every run.
//
// A rank that does not arrive within timeout_ns: the waiting CTA records (1, that rank, e, b) in
// the host-mapped status words, writes NaN (0xFF bytes) over its output chunk and returns; the
// host reads the status without a sync (dsv4.parallel.oneshot.OneShotAllReduce.check).
//
// Build: dsv4/kernels/cuda/lib.py (one library with every csrc/ family). Tests:
// tests/dsv4/parallel/test_allreduce_gpu.py (two or more GPUs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dsv4_api.h"
#include "dsv4_common.cuh"

namespace {

constexpr int AR_MAX_RANKS = 8;
constexpr int AR_THREADS = 512;
constexpr int AR_MIN_CHUNK = 512;      // 32 threads of one 16-byte vector: >= AR_MAX_RANKS flags
constexpr int AR_ALIGN = 128;

struct ArPeers {
  char* base[AR_MAX_RANKS];            // rank r's buffer as this process maps it (own: its own)
};

struct ArCall {                  // one launch: the message, the buffers' sizes, the timeout
  const uint4* x;
  uint4* out;
  int n16, rank, cap, chunk;     // 16-byte vectors of the message; this rank; buffer sizes
  uint64_t timeout_ns;
  int* status;                   // host-mapped status words (device address)
};

struct ArLayout {
  size_t flags, data, total;           // byte offsets of the flags and the data; buffer bytes
};

__host__ __device__ inline size_t ar_round(size_t n) {
  return (n + AR_ALIGN - 1) / AR_ALIGN * AR_ALIGN;
}

__host__ __device__ inline ArLayout ar_layout(int cap, int chunk) {
  const size_t blocks = size_t(cap) / size_t(chunk);
  ArLayout l;
  l.flags = ar_round(blocks * sizeof(uint32_t));
  l.data = l.flags + ar_round(blocks * AR_MAX_RANKS * sizeof(uint32_t));
  l.total = l.data + 2 * size_t(AR_MAX_RANKS) * size_t(cap);
  return l;
}

bool ar_sizes_ok(int cap, int chunk) {
  return chunk >= AR_MIN_CHUNK && chunk % AR_MIN_CHUNK == 0 && cap >= chunk && cap % chunk == 0;
}

DEV uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

DEV void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

DEV uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// Data written by peers over NVLink lands in this GPU's L2: read it there (.cg), never from an L1
// line left by the same slot's previous epoch.
DEV uint4 ld_l2(const uint4* p) { return __ldcg(p); }

// One 16-byte vector <-> float32 lanes, per element type (E lanes).
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static constexpr int E = 4;
  static DEV void load(uint4 v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  static DEV void add(uint4 v, float* f) {
    f[0] += __uint_as_float(v.x); f[1] += __uint_as_float(v.y);
    f[2] += __uint_as_float(v.z); f[3] += __uint_as_float(v.w);
  }
  static DEV uint4 store(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

template <>
struct Lanes<__nv_bfloat16> {
  static constexpr int E = 8;
  static DEV void load(uint4 v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {        // bf16 -> f32 is exact: the bits move up 16 places
      f[2 * j] = __uint_as_float(w[j] << 16);
      f[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
  }
  static DEV void add(uint4 v, float* f) {
    float g[8];
    load(v, g);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] += g[j];
  }
  static DEV uint4 store(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);   // nearest even
      w[j] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct Lanes<__half> {
  static constexpr int E = 8;
  static DEV void load(uint4 v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
      f[2 * j] = p.x;
      f[2 * j + 1] = p.y;
    }
  }
  static DEV void add(uint4 v, float* f) {
    float g[8];
    load(v, g);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] += g[j];
  }
  static DEV uint4 store(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __half2 h = __floats2half2_rn(f[2 * j], f[2 * j + 1]);
      w[j] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// status[0] = 1 (timed out), [1] = the rank that did not arrive, [2] = the epoch, [3] = the CTA.
// Plain volatile stores: host-mapped memory need not support atomics; any one report will do.
DEV void report_timeout(volatile int* status, int missing, uint32_t e, int b) {
  if (status == nullptr) return;
  status[1] = missing;
  status[2] = int(e);
  status[3] = b;
  __threadfence_system();
  status[0] = 1;
}

// The steps in the file's header; grid ceil(nbytes / chunk), block min(AR_THREADS, chunk / 16).
template <typename T, int NR>
__global__ void __launch_bounds__(AR_THREADS)
    allreduce_oneshot_kernel(ArPeers peers, char* own, ArCall c) {
  pdl_wait();                    // the input (and the previous launch's buffer reads) complete
  using L = Lanes<T>;
  const uint4* x = c.x;
  uint4* out = c.out;
  const int n16 = c.n16, rank = c.rank, cap = c.cap, chunk = c.chunk;
  const ArLayout lay = ar_layout(cap, chunk);
  const int b = blockIdx.x;
  uint32_t* epoch_p = reinterpret_cast<uint32_t*>(own) + b;
  __shared__ uint32_t s_epoch;
  __shared__ int s_failed;
  if (threadIdx.x == 0) {
    s_epoch = *epoch_p + 1;      // only CTA b of this rank touches epochs[b]
    s_failed = 0;
  }
  __syncthreads();
  const uint32_t e = s_epoch;
  const size_t par = e & 1u;
  const int cv = chunk / 16;                        // 16-byte vectors per CTA
  const int v0 = b * cv;
  const int nv = min(cv, n16 - v0);
  const size_t slot_of_rank = lay.data + size_t(b) * size_t(chunk);

  // 1-2. this rank's chunk into slot [par][rank] of every rank
  const size_t push = slot_of_rank + (par * AR_MAX_RANKS + size_t(rank)) * size_t(cap);
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    const uint4 val = x[v0 + v];
#pragma unroll
    for (int r = 0; r < NR; ++r) reinterpret_cast<uint4*>(peers.base[r] + push)[v] = val;
  }
  __syncthreads();               // every thread's pushes before the flags that announce them

  // 3-4. thread r < NR: flag rank r, then wait for rank r's flag here
  if (threadIdx.x < NR) {
    const int r = threadIdx.x;
    char* peer = nullptr;        // peers.base[r] through static indices: the parameters stay in
#pragma unroll                   // the constant bank (a dynamic index would copy them to the stack)
    for (int q = 0; q < NR; ++q)
      if (q == r) peer = peers.base[q];
    st_release_sys(reinterpret_cast<uint32_t*>(peer + lay.flags) + b * AR_MAX_RANKS + rank, e);
    const uint32_t* f = reinterpret_cast<const uint32_t*>(own + lay.flags) + b * AR_MAX_RANKS + r;
    const uint64_t t0 = global_ns();
    // (int)(flag - e) >= 0: rank r may already be one epoch ahead (it needs our flag of e + 1 to
    // go further); the difference keeps the test right across the 2^32 wrap
    for (uint32_t spins = 1; int(ld_acquire_sys(f) - e) < 0; ++spins) {
      if ((spins & 255u) == 0 && global_ns() - t0 > c.timeout_ns) {
        report_timeout(c.status, r, e, b);
        s_failed = 1;
        break;
      }
    }
  }
  __syncthreads();
  if (s_failed) {                // NaN out: nothing downstream may read a partial sum as data
    for (int v = threadIdx.x; v < nv; v += blockDim.x)
      out[v0 + v] = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu);
    return;
  }

  // 5. the sum in rank order 0..NR-1, float32, rounded once
  const uint4* slots =
      reinterpret_cast<const uint4*>(own + slot_of_rank + par * AR_MAX_RANKS * size_t(cap));
  const size_t stride = size_t(cap) / 16;           // vectors between two sources' slots
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float acc[L::E];
    L::load(ld_l2(slots + v), acc);
#pragma unroll
    for (int r = 1; r < NR; ++r) L::add(ld_l2(slots + size_t(r) * stride + v), acc);
    out[v0 + v] = L::store(acc);
  }
  if (threadIdx.x == 0) *epoch_p = e;   // 6.
}

template <typename T>
cudaError_t launch_ar(int world, cudaStream_t st, int pdl, const ArPeers& peers, const ArCall& c) {
  const dim3 grid(unsigned((c.n16 * 16 + c.chunk - 1) / c.chunk));
  const dim3 block(unsigned(std::min(AR_THREADS, c.chunk / 16)));
  char* own = peers.base[c.rank];
  switch (world) {
#define AR_CASE(N) \
  case N:          \
    return launch(allreduce_oneshot_kernel<T, N>, grid, block, 0, st, pdl, peers, own, c);
    AR_CASE(2) AR_CASE(3) AR_CASE(4) AR_CASE(5) AR_CASE(6) AR_CASE(7) AR_CASE(8)
#undef AR_CASE
    default:
      return cudaErrorInvalidValue;
  }
}

struct DeviceScope {             // the calls below on `device`, the caller's current device after
  int prev = -1;
  cudaError_t err = cudaSuccess;
  explicit DeviceScope(int device) {
    err = cudaGetDevice(&prev);
    if (err == cudaSuccess) err = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (prev >= 0) (void)cudaSetDevice(prev);
  }
};

}  // namespace

extern "C" {

int dsv4_ar_ipc_handle_bytes() { return int(sizeof(cudaIpcMemHandle_t)); }

size_t dsv4_ar_buffer_bytes(int cap, int chunk) {
  return ar_sizes_ok(cap, chunk) ? ar_layout(cap, chunk).total : 0;
}

int dsv4_ar_alloc(int device, size_t bytes, void** ptr, void* ipc_handle) {
  DeviceScope scope(device);
  if (scope.err != cudaSuccess) return scope.err;
  cudaError_t err = cudaMalloc(ptr, bytes);
  if (err != cudaSuccess) return err;
  // zero epochs and flags (data slots are always written before they are read); synchronous, so
  // the peers never see the buffer before it is zero
  err = cudaMemset(*ptr, 0, bytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess)
    err = cudaIpcGetMemHandle(static_cast<cudaIpcMemHandle_t*>(ipc_handle), *ptr);
  if (err != cudaSuccess) {
    (void)cudaFree(*ptr);
    *ptr = nullptr;
  }
  return err;
}

int dsv4_ar_open(int device, const void* ipc_handle, void** ptr) {
  DeviceScope scope(device);
  if (scope.err != cudaSuccess) return scope.err;
  cudaIpcMemHandle_t h;
  memcpy(&h, ipc_handle, sizeof(h));
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}

int dsv4_ar_close(int device, void* ptr) {
  DeviceScope scope(device);
  if (scope.err != cudaSuccess) return scope.err;
  return cudaIpcCloseMemHandle(ptr);
}

int dsv4_ar_free(int device, void* ptr) {
  DeviceScope scope(device);
  if (scope.err != cudaSuccess) return scope.err;
  return cudaFree(ptr);
}

int dsv4_ar_status_alloc(void** host, void** dev) {
  const unsigned flags = cudaHostAllocMapped | cudaHostAllocPortable;
  cudaError_t err = cudaHostAlloc(host, 4 * sizeof(int), flags);
  if (err != cudaSuccess) return err;
  memset(*host, 0, 4 * sizeof(int));
  err = cudaHostGetDevicePointer(dev, *host, 0);
  if (err != cudaSuccess) {
    (void)cudaFreeHost(*host);
    *host = nullptr;
  }
  return err;
}

int dsv4_ar_status_free(void* host) { return cudaFreeHost(host); }

int dsv4_allreduce(void* const* peers, int world, int rank, const void* x, void* out,
                   long long nbytes, int dtype, int cap, int chunk, unsigned long long timeout_ns,
                   void* status, void* stream, int pdl) {
  if (world < 2 || world > AR_MAX_RANKS || rank < 0 || rank >= world || !ar_sizes_ok(cap, chunk) ||
      nbytes <= 0 || nbytes > cap || nbytes % 16 != 0 || dtype < 0 || dtype > 2 ||
      reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0)
    return -1;
  ArPeers p = {};
  for (int r = 0; r < world; ++r) p.base[r] = static_cast<char*>(peers[r]);
  ArCall c;
  c.x = static_cast<const uint4*>(x);
  c.out = static_cast<uint4*>(out);
  c.n16 = int(nbytes / 16);
  c.rank = rank;
  c.cap = cap;
  c.chunk = chunk;
  c.timeout_ns = timeout_ns;
  c.status = static_cast<int*>(status);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_ar<float>(world, st, pdl, p, c);
    case 1: return launch_ar<__nv_bfloat16>(world, st, pdl, p, c);
    default: return launch_ar<__half>(world, st, pdl, p, c);
  }
}

}  // extern "C"
