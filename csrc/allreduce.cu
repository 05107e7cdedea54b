// The all-reduce across the GPUs of one host over peer memory (the C interface in dsv4_api.h): the
// one-shot of a small message (a few KB: one token's hidden state; dsv4.parallel.oneshot) and the
// two-shot of a large one (a prefill chunk's [rows, 4096] partials, up to tens of MB;
// dsv4.parallel.twoshot). Both sum every element in float32 from the exact values in rank order
// 0..N-1 and round once to the dtype: the same bits on every rank, and from both kernels.
//
// ---- the one-shot ----
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
// With the mHC post (dsv4_allreduce_post; HC = 4 streams): step 5 goes on from the sum, rounded to
// the dtype as above (the bits the plain call writes), to the block's hc_post of those rows
// (dsv4.numerics.mhc.hc_post): for every row t and stream j, out[t, j] = dtype(post[t, j] * x[t] +
// sum_i comb[t, i, j] * res[t, i]) in float32, i in order 0..3, the element's own values only
// (out may not overlap res). The message x is [rows, D], res and out [rows, HC, D], post
// [rows, HC] and comb [rows, HC, HC] float32; the summed x itself is not written. One launch
// where the layer had two (the all-reduce, then hc_post after it); what the sum reads and the
// flags are the plain call's, so both calls share a buffer and its epochs.
//
// ---- the two-shot ----
//
// A message of n bytes is cut into chunks of `chunk` bytes (the last one shorter); chunk k is owned
// by rank o = k % N, which sums it for everyone. The one-shot sends N - 1 copies of the whole
// message from each rank; this sends 2 (N - 1) / N of it (its part of each chunk others own, once;
// the sums of its own chunks, N - 1 times), the same bytes as a ring, in one launch. Each rank's
// buffer:
//
//   [epochs: one uint32 per CTA]  [flag1: chunk x source rank, uint32]  [flag2: chunk, uint32]
//   [recv: the chunks this rank owns, one slot per other rank]
//   [res: the sums of the chunks other ranks own]
//
// Slots hold `chunk` bytes; chunk k from rank a lands at rank b (a != b) in slot
// (k / N) * (N - 1) + (a - (a > b)): recv and res each ceil(K / N) * (N - 1) slots for a capacity
// of K chunks, about (N - 1) / N of cap apiece. A fixed grid of G CTAs (the same on every rank and
// call, whatever the message size) loops over the chunks k = b, b + G, ...; CTA b of rank r:
//   0. reads its epoch e = epochs[b] + 1 (advanced by every call, with or without chunks);
//   A. for each chunk it does not own: pushes its part of x into recv slot (k, r) of the owner and
//      writes e into the owner's flag1[k][r] (release, system scope, after a CTA barrier);
//   B. for each chunk it owns: waits until flag1[k][a] >= e for every other rank a (acquire), sums
//      x (its own part: never copied) and the recv slots in rank order in float32, rounds once,
//      writes the sum into `out` and into res slot (k, r) of every other rank, then writes e into
//      their flag2[k] (release, after a barrier);
//   C. for each chunk it does not own: waits until flag2[k] >= e here, copies res into `out`;
//   D. stores epochs[b] = e.
// No wait comes before the pushes that other waits need (A waits for nothing, B for A, C for B), so
// the CTAs b of the ranks always progress; CTAs of different indices never wait for each other.
// G should fit on the GPU at once (128 CTAs: 2 an SM, <= 64 registers a thread, on 64 SMs); where
// other work leaves less room, the CTAs the ranks run first are the same ones (the lowest indices).
//
// No second parity of the slots is needed. Rank a writes its recv slot (k, a) at the owner in call
// e' only after its own kernel of the last call e that reached chunk k finished (stream order;
// with PDL the kernel's first act is the wait), and that kernel waited for flag2[k] of e, which
// the owner wrote after reading the slot. The owner writes its sum into res slot (k, o) of rank r
// in call e' only after flag1[k][r] of e', which rank r writes after its kernel of call e (which
// read that slot) finished. A chunk that a call does not reach keeps its flags; the next call
// that reaches it waits for a larger epoch. Epochs are per CTA and chunk k always belongs to CTA
// k % G (the grid never changes), so a chunk's flags only grow; and a flag never runs ahead of
// the rank waiting for it (to write it for a later call, the writer needs the waiter to have
// finished this one): `flag - e >= 0` (signed) is the test, across the 2^32 wrap, as in the
// one-shot. The owner computes each sum once and everyone copies it: the same bits everywhere.
//
// Timeouts: a CTA that waits past timeout_ns for a rank's flag1 records (1, that rank, e, b); one
// that waits past 2 x timeout_ns for the owner's flag2 (the owner may itself wait timeout_ns for a
// slow rank first) records (2, the owner, e, b) unless a report is there already. Either writes NaN
// over every chunk of `out` the CTA handles and returns without advancing its epoch.
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
  // the mHC post (HC > 0 launches only): res / out [rows, HC, D], post [rows, HC], comb
  // [rows, HC, HC]; d16: 16-byte vectors of a row of x
  const uint4* res = nullptr;
  const float* post = nullptr;
  const float* comb = nullptr;
  int d16 = 0;
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

// Step 5 with the mHC post for one 16-byte vector gv of x (row t = gv / d16): acc, the rounded
// sum's float32 values -> out[t, j] for the HC streams j (the file's header).
template <typename T, int HC>
DEV void ar_post_vector(const ArCall& c, int gv, const float* acc) {
  using L = Lanes<T>;
  const int t = gv / c.d16, dv = gv - t * c.d16;
  const float* post = c.post + size_t(t) * HC;
  const float* comb = c.comb + size_t(t) * HC * HC;
  const size_t row0 = size_t(t) * HC * size_t(c.d16) + size_t(dv);   // res / out [t, 0, dv]
  static_assert(HC == MHC_STREAMS, "the post takes the block's 4 streams");
  float r[L::E][HC];
#pragma unroll
  for (int i = 0; i < HC; ++i) {
    float v[L::E];
    L::load(c.res[row0 + size_t(i) * c.d16], v);
#pragma unroll
    for (int k = 0; k < L::E; ++k) r[k][i] = v[k];
  }
#pragma unroll
  for (int j = 0; j < HC; ++j) {
    float y[L::E];
#pragma unroll
    for (int k = 0; k < L::E; ++k) y[k] = mhc_post_one(acc[k], r[k], post, comb, j);
    c.out[row0 + size_t(j) * c.d16] = L::store(y);
  }
}

// The steps in the file's header; grid ceil(nbytes / chunk), block min(AR_THREADS, chunk / 16).
// HC > 0: with the mHC post of HC streams (dsv4_allreduce_post).
template <typename T, int NR, int HC>
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
    const uint4 nan = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu);
    for (int v = threadIdx.x; v < nv; v += blockDim.x) {
      if constexpr (HC == 0) {
        out[v0 + v] = nan;
      } else {                   // every stream of the chunk's elements
        const int gv = v0 + v, t = gv / c.d16, dv = gv - t * c.d16;
#pragma unroll
        for (int j = 0; j < HC; ++j) out[(size_t(t) * HC + j) * size_t(c.d16) + dv] = nan;
      }
    }
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
    if constexpr (HC == 0) {
      out[v0 + v] = L::store(acc);
    } else {                     // the sum rounded once to T (the plain call's bits), then post
      L::load(L::store(acc), acc);
      ar_post_vector<T, HC>(c, v0 + v, acc);
    }
  }
  if (threadIdx.x == 0) *epoch_p = e;   // 6.
}

template <typename T, int HC = 0>
cudaError_t launch_ar(int world, cudaStream_t st, int pdl, const ArPeers& peers, const ArCall& c) {
  const dim3 grid(unsigned((c.n16 * 16 + c.chunk - 1) / c.chunk));
  const dim3 block(unsigned(std::min(AR_THREADS, c.chunk / 16)));
  char* own = peers.base[c.rank];
  switch (world) {
#define AR_CASE(N) \
  case N:          \
    return launch(allreduce_oneshot_kernel<T, N, HC>, grid, block, 0, st, pdl, peers, own, c);
    AR_CASE(2) AR_CASE(3) AR_CASE(4) AR_CASE(5) AR_CASE(6) AR_CASE(7) AR_CASE(8)
#undef AR_CASE
    default:
      return cudaErrorInvalidValue;
  }
}

// ---- the two-shot (the second part of the file's header) ----------------------------------------

constexpr int AR2_MAX_CTAS = 1024;

struct Ar2Layout {
  size_t flag1, flag2, recv, res, total;   // byte offsets of the regions; buffer bytes
};

// Slots of recv (and of res) in one buffer: ceil(K / N) rounds of N chunks, N - 1 from others each.
__host__ __device__ inline size_t ar2_slots(int cap, int chunk, int world) {
  const size_t k = size_t(cap) / size_t(chunk);
  return ((k - 1) / size_t(world) + 1) * size_t(world - 1);
}

__host__ __device__ inline Ar2Layout ar2_layout(int cap, int chunk, int ctas, int world) {
  const size_t k = size_t(cap) / size_t(chunk);
  const size_t slot_bytes = ar2_slots(cap, chunk, world) * size_t(chunk);
  Ar2Layout l;
  l.flag1 = ar_round(size_t(ctas) * sizeof(uint32_t));
  l.flag2 = l.flag1 + ar_round(k * AR_MAX_RANKS * sizeof(uint32_t));
  l.recv = l.flag2 + ar_round(k * sizeof(uint32_t));
  l.res = l.recv + slot_bytes;
  l.total = l.res + slot_bytes;
  return l;
}

bool ar2_sizes_ok(int cap, int chunk, int ctas, int world) {
  return ar_sizes_ok(cap, chunk) && ctas >= 1 && ctas <= AR2_MAX_CTAS && world >= 2 &&
         world <= AR_MAX_RANKS;
}

// The slot at rank b of chunk k from rank a (a != b): its owner's recv slot of a's part, or the
// res slot at b of the owner a's sum.
template <int NR>
DEV size_t ar2_slot(int k, int a, int b) {
  return size_t(k / NR) * (NR - 1) + size_t(a - (a > b));
}

// peers.base[r] for a rank r known only at run time, through static indices (the parameters stay
// in the constant bank; a dynamic index would copy them to the stack).
template <int NR>
DEV char* peer_base(const ArPeers& peers, int r) {
  char* p = nullptr;
#pragma unroll
  for (int q = 0; q < NR; ++q)
    if (q == r) p = peers.base[q];
  return p;
}

// status[0] = kind (1: the rank's own flag never came; 2: the owner's sums never came, the owner
// itself perhaps waiting for another rank), then as report_timeout. A kind-2 report leaves an
// earlier one in place: a kind 1 names the rank that is late, a kind 2 only who waited for it.
DEV void report_wait(volatile int* status, int kind, int missing, uint32_t e, int b) {
  if (status == nullptr || (kind == 2 && status[0] != 0)) return;
  status[1] = missing;
  status[2] = int(e);
  status[3] = b;
  __threadfence_system();
  status[0] = kind;
}

// Wait (acquire) until *f has reached epoch e; false (reported as `kind`, naming rank `from`) when
// it has not after limit_ns.
DEV bool ar2_wait(const uint32_t* f, uint32_t e, uint64_t limit_ns, int* status, int kind,
                  int from, int b) {
  const uint64_t t0 = global_ns();
  for (uint32_t spins = 1; int(ld_acquire_sys(f) - e) < 0; ++spins) {
    if ((spins & 255u) == 0 && global_ns() - t0 > limit_ns) {
      report_wait(status, kind, from, e, b);
      return false;
    }
  }
  return true;
}

// dst[0, n) = src[0, n) (16-byte vectors) by the CTA, U loads in flight a thread before their
// stores (the compiler may not move a load above a store that could alias it). L2: src was written
// by peers (ld_l2).
template <bool L2>
DEV void ar2_copy(uint4* dst, const uint4* src, int n) {
  constexpr int U = 2;
  const int step = blockDim.x;
  for (int v = threadIdx.x; v < n; v += U * step) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + u * step < n) r[u] = L2 ? ld_l2(src + v + u * step) : src[v + u * step];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + u * step < n) dst[v + u * step] = r[u];
  }
}

// NaN (0xFF bytes) over every chunk of `out` that CTA b handles: nothing downstream may read a
// partial result as data.
DEV void ar2_nan_out(const ArCall& c, int chunks, int cv) {
  for (int k = blockIdx.x; k < chunks; k += gridDim.x) {
    const int v0 = k * cv, nv = min(cv, c.n16 - v0);
    for (int v = threadIdx.x; v < nv; v += blockDim.x)
      c.out[v0 + v] = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu);
  }
}

// The steps in the file's header; grid: the fixed G CTAs, block min(AR_THREADS, chunk / 16).
template <typename T, int NR>
__global__ void __launch_bounds__(AR_THREADS, 2)
    allreduce_twoshot_kernel(ArPeers peers, char* own, ArCall c) {
  pdl_wait();                    // the input (and the previous launch's buffer reads) complete
  using L = Lanes<T>;
  const int rank = c.rank, chunk = c.chunk, cv = chunk / 16;   // cv: 16-byte vectors a chunk
  const Ar2Layout lay = ar2_layout(c.cap, chunk, int(gridDim.x), NR);
  const int b = blockIdx.x, G = gridDim.x;
  const int chunks = (c.n16 + cv - 1) / cv;
  uint32_t* epoch_p = reinterpret_cast<uint32_t*>(own) + b;
  __shared__ uint32_t s_epoch;
  if (threadIdx.x == 0) s_epoch = *epoch_p + 1;    // 0. only CTA b of this rank touches epochs[b]
  __syncthreads();
  const uint32_t e = s_epoch;

  // A. this rank's part of each chunk another rank owns, into the owner's recv slot; flag1
  for (int k = b; k < chunks; k += G) {
    const int o = k % NR;
    if (o == rank) continue;
    const int v0 = k * cv;
    char* owner = peer_base<NR>(peers, o);
    ar2_copy<false>(reinterpret_cast<uint4*>(owner + lay.recv +
                                             ar2_slot<NR>(k, rank, o) * size_t(chunk)),
                    c.x + v0, min(cv, c.n16 - v0));
    __syncthreads();             // every thread's pushes before the flag that announces them
    if (threadIdx.x == 0)
      st_release_sys(reinterpret_cast<uint32_t*>(owner + lay.flag1) + size_t(k) * AR_MAX_RANKS +
                         rank, e);
  }

  // B. the chunks this rank owns: thread a < NR waits for rank a's part; the sum in rank order
  // 0..NR-1 in float32, rounded once, into out and every other rank's res slot; flag2
  for (int k = b; k < chunks; k += G) {
    if (k % NR != rank) continue;
    const int v0 = k * cv, nv = min(cv, c.n16 - v0);
    bool late = false;
    if (threadIdx.x < NR && threadIdx.x != rank) {
      const uint32_t* f = reinterpret_cast<const uint32_t*>(own + lay.flag1) +
                          size_t(k) * AR_MAX_RANKS + threadIdx.x;
      late = !ar2_wait(f, e, c.timeout_ns, c.status, 1, threadIdx.x, b);
    }
    if (__syncthreads_or(late)) {
      ar2_nan_out(c, chunks, cv);
      return;
    }
    const uint4* x = c.x + v0;
    // the other ranks' slots of chunk k are consecutive, in rank order (this rank's left out)
    const uint4* recv =
        reinterpret_cast<const uint4*>(own + lay.recv) + size_t(k / NR) * (NR - 1) * cv;
#pragma unroll 1
    for (int v = threadIdx.x; v < nv; v += blockDim.x) {
      uint4 in[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r)
        in[r] = r == rank ? x[v] : ld_l2(recv + size_t(r - (r > rank)) * cv + v);
      float acc[L::E];
      L::load(in[0], acc);
#pragma unroll
      for (int r = 1; r < NR; ++r) L::add(in[r], acc);
      c.out[v0 + v] = L::store(acc);
    }
    // then to every other rank's res slot, one peer at a time, reading out back (this CTA's own
    // writes, after the barrier): NR sums' worth of stores in flight at once would take the
    // registers of a second CTA on the SM (ptxas: <= 64 a thread, no spills)
    __syncthreads();
#pragma unroll 1
    for (int r = 0; r < NR; ++r) {
      if (r == rank) continue;
      uint4* res = reinterpret_cast<uint4*>(peer_base<NR>(peers, r) + lay.res);
      ar2_copy<false>(res + ar2_slot<NR>(k, rank, r) * size_t(cv), c.out + v0, nv);
    }
    __syncthreads();             // every thread's stores before the flags that announce them
    if (threadIdx.x < NR && threadIdx.x != rank) {
      char* peer = peer_base<NR>(peers, threadIdx.x);
      st_release_sys(reinterpret_cast<uint32_t*>(peer + lay.flag2) + k, e);
    }
  }

  // C. the sums of the chunks other ranks own: wait for the owner's flag2, copy res into out
  for (int k = b; k < chunks; k += G) {
    const int o = k % NR;
    if (o == rank) continue;
    bool late = false;
    if (threadIdx.x == 0) {
      const uint32_t* f = reinterpret_cast<const uint32_t*>(own + lay.flag2) + k;
      late = !ar2_wait(f, e, 2 * c.timeout_ns, c.status, 2, o, b);
    }
    if (__syncthreads_or(late)) {
      ar2_nan_out(c, chunks, cv);
      return;
    }
    const int v0 = k * cv;
    const uint4* res = reinterpret_cast<const uint4*>(own + lay.res);
    ar2_copy<true>(c.out + v0, res + ar2_slot<NR>(k, o, rank) * size_t(cv), min(cv, c.n16 - v0));
  }
  if (threadIdx.x == 0) *epoch_p = e;   // D.
}

template <typename T>
cudaError_t launch_ar2(int world, int ctas, cudaStream_t st, int pdl, const ArPeers& peers,
                       const ArCall& c) {
  const dim3 grid(static_cast<unsigned>(ctas));
  const dim3 block(unsigned(std::min(AR_THREADS, c.chunk / 16)));
  char* own = peers.base[c.rank];
  switch (world) {
#define AR2_CASE(N) \
  case N:           \
    return launch(allreduce_twoshot_kernel<T, N>, grid, block, 0, st, pdl, peers, own, c);
    AR2_CASE(2) AR2_CASE(3) AR2_CASE(4) AR2_CASE(5) AR2_CASE(6) AR2_CASE(7) AR2_CASE(8)
#undef AR2_CASE
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

// The world's buffers and one launch's arguments, as every C entry below passes them.
ArPeers ar_peers(void* const* peers, int world) {
  ArPeers p = {};
  for (int r = 0; r < world; ++r) p.base[r] = static_cast<char*>(peers[r]);
  return p;
}

ArCall ar_call(const void* x, void* out, long long nbytes, int rank, int cap, int chunk,
               unsigned long long timeout_ns, void* status) {
  ArCall c;
  c.x = static_cast<const uint4*>(x);
  c.out = static_cast<uint4*>(out);
  c.n16 = int(nbytes / 16);
  c.rank = rank;
  c.cap = cap;
  c.chunk = chunk;
  c.timeout_ns = timeout_ns;
  c.status = static_cast<int*>(status);
  return c;
}

}  // namespace

extern "C" {

int dsv4_ar_ipc_handle_bytes() { return int(sizeof(cudaIpcMemHandle_t)); }

size_t dsv4_ar_buffer_bytes(int cap, int chunk) {
  return ar_sizes_ok(cap, chunk) ? ar_layout(cap, chunk).total : 0;
}

size_t dsv4_ar2_buffer_bytes(int cap, int chunk, int ctas, int world) {
  return ar2_sizes_ok(cap, chunk, ctas, world) ? ar2_layout(cap, chunk, ctas, world).total : 0;
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
  const ArPeers p = ar_peers(peers, world);
  const ArCall c = ar_call(x, out, nbytes, rank, cap, chunk, timeout_ns, status);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_ar<float>(world, st, pdl, p, c);
    case 1: return launch_ar<__nv_bfloat16>(world, st, pdl, p, c);
    default: return launch_ar<__half>(world, st, pdl, p, c);
  }
}

int dsv4_allreduce_post(void* const* peers, int world, int rank, const void* x,
                        const void* res, const float* post, const float* comb, void* out,
                        long long nbytes, int row_bytes, int hc, int dtype, int cap, int chunk,
                        unsigned long long timeout_ns, void* status, void* stream, int pdl) {
  const auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (world < 2 || world > AR_MAX_RANKS || rank < 0 || rank >= world || !ar_sizes_ok(cap, chunk) ||
      nbytes <= 0 || nbytes > cap || nbytes % 16 != 0 || row_bytes <= 0 || row_bytes % 16 != 0 ||
      nbytes % row_bytes != 0 || hc != 4 || (dtype != 0 && dtype != 1) || misaligned(x) ||
      misaligned(res) || misaligned(out) || post == nullptr || comb == nullptr)
    return -1;
  const ArPeers p = ar_peers(peers, world);
  ArCall c = ar_call(x, out, nbytes, rank, cap, chunk, timeout_ns, status);
  c.res = static_cast<const uint4*>(res);
  c.post = post;
  c.comb = comb;
  c.d16 = row_bytes / 16;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  return dtype == 0 ? launch_ar<float, 4>(world, st, pdl, p, c)
                    : launch_ar<__nv_bfloat16, 4>(world, st, pdl, p, c);
}

int dsv4_allreduce2(void* const* peers, int world, int rank, const void* x, void* out,
                    long long nbytes, int dtype, int cap, int chunk, int ctas,
                    unsigned long long timeout_ns, void* status, void* stream, int pdl) {
  if (world < 2 || world > AR_MAX_RANKS || rank < 0 || rank >= world ||
      !ar2_sizes_ok(cap, chunk, ctas, world) || nbytes <= 0 || nbytes > cap || nbytes % 16 != 0 ||
      dtype < 0 || dtype > 2 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out) % 16 != 0)
    return -1;
  const ArPeers p = ar_peers(peers, world);
  const ArCall c = ar_call(x, out, nbytes, rank, cap, chunk, timeout_ns, status);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_ar2<float>(world, ctas, st, pdl, p, c);
    case 1: return launch_ar2<__nv_bfloat16>(world, ctas, st, pdl, p, c);
    default: return launch_ar2<__half>(world, ctas, st, pdl, p, c);
  }
}

}  // extern "C"
