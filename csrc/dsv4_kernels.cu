// Batch-1 decode GEMVs of DeepSeek-V4 in CUDA C++ (sm_89+; PDL on sm_90+), loaded by
// dsv4/kernels/cuda_lib.py through ctypes (a plain C ABI: pointers, sizes, the CUDA stream).
//
//  * dsv4_fp8_gemv: W8A8 FP8 GEMV (e4m3 weights, 128x128 ue8m0 scales) on CUDA cores with float32
//    accumulation of exact products, the activation quantized per 128 (ue8m0, e4m3 RNE) in the
//    kernel; variants: two matrices on one x (wq_a + wkv), fused clamped SwiGLU (w1 + w3), grouped
//    x without act quant (wo_a). Every weight byte is requested before the PDL wait.
//  * dsv4_fp8_gemv_mma: the same GEMV on tensor cores (mma.m16n8k16, f16 operands: the e4m3
//    weights and act-quantized activations are exact in f16) for up to 8 activation rows, one per
//    B column: the speculative verify rows for about the time of one.
//  * dsv4_route: the MoE routing of one token (one CTA; warp-shuffle top-k).
//  * dsv4_topk_bf16: the indexer's top-k (one CTA per row of scores, radix select).
//  * dsv4_fp4_up / dsv4_fp4_down: the routed FP4 experts of one token on tensor cores. An e2m1
//    code is e4m3's bit pattern shifted down by two (value * 2^-6), so 8 codes become two e4m3
//    registers in a few integer ops, then f16 pairs (cvt) for mma.m16n8k16 f16 against the
//    act-quantized e4m3 activation (exact in f16); each MMA column holds one 32-wide scale group
//    (the activation fragment is zero outside its group), and the per-32 scale is applied in
//    float32 outside the tensor core. down sums the k experts in slot order through a
//    per-row-tile semaphore (deterministic). Variants: dsv4_fp4_up_stream (a fixed grid of CTAs
//    streaming tiles, the next tile's weights in flight) and dsv4_fp4_down_all (all k experts of
//    a row tile in one CTA, no semaphore); each gives the bits of its per-tile kernel.
//
// Row tiles never straddle a 128-row scale block. All reductions run in a fixed order: results
// are deterministic, and the same with and without PDL or CUDA-graph capture.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

#define DEV __device__ __forceinline__
constexpr unsigned FULL = 0xffffffffu;

// ---- PDL, loads, conversions -----------------------------------------------------------------

// Wait for the previous kernel (its writes visible), then let the next kernel launch. Only loads
// of immutable data (weights) may come before this; every other access comes after it.
DEV void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Weight bytes: read once per token, so not kept in L1; volatile keeps them before the PDL wait.
DEV uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

DEV uint32_t ld_stream_u8(const void* p) {
  uint16_t r;
  asm volatile("ld.global.L1::no_allocate.u8 %0, [%1];\n" : "=h"(r) : "l"(p));
  return r;
}

DEV uint32_t ld_stream_u32(const void* p) {
  uint32_t r;
  asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];\n" : "=r"(r) : "l"(p));
  return r;
}

DEV uint2 ld_stream_u64(const void* p) {
  uint2 r;
  asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// ue8m0 byte -> 2^(b-127) as float32 (byte 0 -> 0, as the Triton kernels).
DEV float e8m0(uint32_t b) { return __uint_as_float((b & 0xFFu) << 23); }

DEV float pow2f(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }   // -126 <= e <= 127

DEV float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Four e4m3 bytes (byte j = element j) -> four float32 (exact).
DEV void e4m3x4_to_f32(uint32_t v, float* f) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xFFFFu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v >> 16), __NV_E4M3);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}

// float32 -> e4m3 byte, round to nearest even, saturating (the value is already clamped).
DEV uint32_t f32_to_e4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// act_quant's block exponent: 2^e with e = ceil(log2(max(amax, 1e-4) * fp32(1/448))) from the bits.
DEV int block_exponent(float amax) {
  const uint32_t b = __float_as_uint(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
  return int((b >> 23) & 0xFFu) - 127 + ((b & 0x7FFFFFu) != 0u);
}

// e4m3 value of x / 2^e, clamped to +-448, rounded (the operand an FP8 GEMM sees, without 2^e).
DEV float quant_e4m3(float x, float inv) {
  const float v = fminf(fmaxf(x * inv, -448.0f), 448.0f);
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(f32_to_e4m3(v)), __NV_E4M3);
  return __half2float(*reinterpret_cast<const __half*>(&h));
}

// Load n consecutive activation values (bf16 or float32) as float32; n a multiple of 4, 8-byte aligned.
template <int N>
DEV void load_act(const void* base, size_t elem, bool f32, float* v) {
  if (f32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + elem);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 t = p[i];
      v[4 * i] = t.x; v[4 * i + 1] = t.y; v[4 * i + 2] = t.z; v[4 * i + 3] = t.w;
    }
  } else {
    const uint2* p = reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + elem);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint2 t = p[i];
      v[4 * i] = __uint_as_float(t.x << 16);
      v[4 * i + 1] = __uint_as_float(t.x & 0xFFFF0000u);
      v[4 * i + 2] = __uint_as_float(t.y << 16);
      v[4 * i + 3] = __uint_as_float(t.y & 0xFFFF0000u);
    }
  }
}

// ---- FP8 GEMV ----------------------------------------------------------------------------------

struct Fp8Args {
  const uint8_t* w0;   // matrix 0: weight [rows, K] e4m3, scale [rows/128, K/128] ue8m0, output [rows]
  const uint8_t* s0;
  void* y0;
  const uint8_t* w1;   // TWO: matrix 1 (row tiles past n0 / ROWS); SWIGLU: w3 (same rows as w0)
  const uint8_t* s1;
  void* y1;
  const void* x;       // activation: [K] or, grouped, [G * K] (rows [g*ng, (g+1)*ng) read group g)
  int n0;              // rows of matrix 0
  int K;
  int ng;              // rows per activation group; 0: one group
  float limit;         // SwiGLU clamp (0: none)
  int flags;           // FLAG_*
  int nx;              // activation rows (>= 1): row t reads x + t * xs, writes y0 / y1 + t * ys0 / ys1
  int xs;              // elements between activation rows
  int ys0;             // elements between output rows of y0
  int ys1;             // elements between output rows of y1
};
constexpr int FLAG_X_F32 = 1, FLAG_Y_F32 = 2, FLAG_QUANT = 4, FLAG_TWO = 8;

// One CTA: ROWS = (32 / LC) * RPL rows (inside one 128-row scale block) x all of K. Warp w reads
// the K chunks [w * LC * CPL, (w + 1) * LC * CPL) (16 bytes each); lane = (lr, lc) reads chunks
// lc + LC * c (c < CPL) of rows lr + LR * i (i < RPL). Each lane dots 16 weights with 16
// activation values per (row, chunk) in float32, applies the weight scale of the chunk's block,
// then partial sums meet in a shuffle butterfly (over the LC lanes) and a fixed-order sum over warps.
// Several activation rows (nx > 1, the speculative step's verify rows; MULTI) reuse the weights held
// in registers: each row runs the arithmetic of a one-row launch (!MULTI: no row loop), so its
// output has the same bits.
template <int LC, int RPL, int CPL, bool SWIGLU, bool MULTI>
__global__ void __launch_bounds__(512) fp8_gemv_kernel(const Fp8Args a) {
  constexpr int LR = 32 / LC, ROWS = LR * RPL, NM = SWIGLU ? 2 : 1;
  extern __shared__ float red[];   // [warps][NM][ROWS]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int lr = lane / LC, lc = lane % LC;
  const int K = a.K;
  int row0 = blockIdx.x * ROWS;
  const uint8_t* wp[NM];
  const uint8_t* sp[NM];
  void* yp = a.y0;
  int ys = a.ys0;
  wp[0] = a.w0;
  sp[0] = a.s0;
  if constexpr (SWIGLU) {
    wp[1] = a.w1;
    sp[1] = a.s1;
  } else if ((a.flags & FLAG_TWO) && row0 >= a.n0) {
    row0 -= a.n0;
    wp[0] = a.w1;
    sp[0] = a.s1;
    yp = a.y1;
    ys = a.ys1;
  }
  const int kc0 = warp * (LC * CPL) + lc;            // this lane's first 16-byte chunk along K

  // every weight and scale byte of the lane, before the PDL wait (immutable)
  uint4 wv[NM][RPL][CPL];
  uint32_t sb[NM][CPL];
#pragma unroll
  for (int m = 0; m < NM; ++m) {
#pragma unroll
    for (int i = 0; i < RPL; ++i)
#pragma unroll
      for (int c = 0; c < CPL; ++c)
        wv[m][i][c] = ld_stream(wp[m] + size_t(row0 + lr + LR * i) * K + 16 * (kc0 + LC * c));
#pragma unroll
    for (int c = 0; c < CPL; ++c)
      sb[m][c] = ld_stream_u8(sp[m] + (row0 >> 7) * (K >> 7) + ((kc0 + LC * c) >> 3));
  }
  pdl_wait();

  // the activation chunks, act-quantized per 128 (8 chunks: lanes lc ^ 1, 2, 4)
  const bool xf32 = a.flags & FLAG_X_F32;
  const size_t xoff0 = a.ng > 0 ? size_t(row0 / a.ng) * K : 0;
#pragma unroll 1
  for (int xr = 0; xr < (MULTI ? a.nx : 1); ++xr) {   // activation rows
    const size_t xoff = xoff0 + size_t(xr) * a.xs;
    // an opaque zero per row: the e4m3 decode below depends on it, so the compiler cannot hoist
    // the decoded weights (16 floats per 16-byte chunk) out of the row loop, where they spill
    uint32_t z = 0;
    if constexpr (MULTI) asm volatile("mov.b32 %0, 0;" : "=r"(z));
    float xv[CPL][16];
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      load_act<16>(a.x, xoff + 16 * size_t(kc0 + LC * c), xf32, xv[c]);
      if (a.flags & FLAG_QUANT) {
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(xv[c][j]));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 4));
        const int e = block_exponent(amax);
        const float inv = pow2f(-e), sc = pow2f(e);
#pragma unroll
        for (int j = 0; j < 16; ++j) xv[c][j] = quant_e4m3(xv[c][j], inv) * sc;
      }
    }

    float acc[NM][RPL];
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int i = 0; i < RPL; ++i) {
        float t = 0.0f;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const uint32_t words[4] = {wv[m][i][c].x ^ z, wv[m][i][c].y ^ z, wv[m][i][c].z ^ z,
                                     wv[m][i][c].w ^ z};
          float p = 0.0f;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            float f[4];
            e4m3x4_to_f32(words[q], f);
#pragma unroll
            for (int j = 0; j < 4; ++j) p = fmaf(f[j], xv[c][4 * q + j], p);
          }
          t = fmaf(p, e8m0(sb[m][c]), t);
        }
        acc[m][i] = t;
      }

    // butterfly over the LC lanes of a row group: halve the row set while there is more than one
    // row per lane, then add across the remaining lanes; the lane keeps rows base .. base + NV - 1
    constexpr int NV = RPL >= LC ? RPL / LC : 1;
    int base = 0;
    int n = RPL;
#pragma unroll
    for (int off = LC / 2; off >= 1; off >>= 1) {
      if (n > 1) {
        const int h = n / 2;
        const bool upper = lane & off;
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
          for (int j = 0; j < h; ++j) {
            const float send = upper ? acc[m][j] : acc[m][j + h];
            const float keep = upper ? acc[m][j + h] : acc[m][j];
            acc[m][j] = keep + __shfl_xor_sync(FULL, send, off);
          }
        if (upper) base += h;
        n = h;
      } else {
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[m][0] += __shfl_xor_sync(FULL, acc[m][0], off);
      }
    }
    constexpr int WMASK = RPL < LC ? LC / RPL - 1 : 0;   // lanes that only repeated a full add
    if (xr > 0) __syncthreads();   // the previous row's sums are read before red is written again
    if ((lc & WMASK) == 0) {
#pragma unroll
      for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int j = 0; j < NV; ++j) red[(warp * NM + m) * ROWS + lr + LR * (base + j)] = acc[m][j];
    }
    __syncthreads();
    if (threadIdx.x < ROWS) {
      const int r = threadIdx.x;
      float t[NM];
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        t[m] = 0.0f;
        for (int w = 0; w < nwarps; ++w) t[m] += red[(w * NM + m) * ROWS + r];
      }
      float y = t[0];
      if constexpr (SWIGLU) {   // fp8_gemm outputs bf16; the clamped SwiGLU runs on those values
        float g = bf16_round(t[0]), u = bf16_round(t[1]);
        if (a.limit > 0.0f) {
          u = fminf(fmaxf(u, -a.limit), a.limit);
          g = fminf(g, a.limit);
        }
        y = g / (1.0f + expf(-g)) * u;
      }
      const size_t o = size_t(xr) * ys + row0 + r;
      if (a.flags & FLAG_Y_F32)
        static_cast<float*>(yp)[o] = y;
      else
        static_cast<__nv_bfloat16*>(yp)[o] = __float2bfloat16_rn(y);
    }
  }
}

// ---- MoE routing -------------------------------------------------------------------------------

// The routing of one token, as dsv4/kernels/route.py: scores (softmax / sigmoid / sqrt-softplus,
// libdevice exp/log1p, IEEE sqrt and division), the top-k of scores + bias (k rounds of max, the
// lowest id among equal values, ids clamped into [0, E)) or the token's tid2eid row, experts sorted
// by id, weights normalized (not for softmax) and scaled.
struct RouteArgs {
  const float* logits;      // [E] float32 (the gate GEMV)
  const float* bias;        // [E] float32 (score routing) or null
  const int64_t* tid2eid;   // [V, k] int64 (hash routing) or null
  const int64_t* ids;       // [1] int64: the token (hash routing)
  int E;
  int score;                // 0 softmax, 1 sigmoid, 2 sqrt-softplus
  float route_scale;
};
constexpr int ROUTE_MAX_E = 512, ROUTE_MAX_K = 16;

// By the whole CTA (E <= 512): all threads load the logits and the bias into shared memory at
// once (one memory round trip) and compute the scores; warp 0 picks the experts from shared
// memory (k rounds of a warp argmax) and their weights. s_score, s_bias: [E]; results in s_idx,
// s_w. Every thread must call it.
DEV void route_cta(const RouteArgs& ra, int k, float* s_score, float* s_bias, int64_t* s_idx,
                   float* s_w) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, E = ra.E;
  for (int e = tid; e < E; e += nt) {
    s_score[e] = ra.logits[e];
    s_bias[e] = ra.bias != nullptr ? ra.bias[e] : 0.0f;
  }
  __syncthreads();
  if (ra.score == 0) {   // softmax: max and sum by warp 0 (E / 32 values per lane), kept in s_w
    if (tid < 32) {
      float mx = -INFINITY, sum = 0.0f;
      for (int e = lane; e < E; e += 32) mx = fmaxf(mx, s_score[e]);
      for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
      for (int e = lane; e < E; e += 32) sum += expf(s_score[e] - mx);
      for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(FULL, sum, off);
      if (lane == 0) {
        s_w[0] = mx;
        s_w[1] = sum;
      }
    }
    __syncthreads();
  }
  const float mx = s_w[0], sum = s_w[1];
  for (int e = tid; e < E; e += nt) {   // in place: each thread its own experts
    const float lg = s_score[e];
    if (ra.score == 0)
      s_score[e] = __fdiv_rn(expf(lg - mx), sum);
    else if (ra.score == 1)
      s_score[e] = __fdiv_rn(1.0f, 1.0f + expf(-lg));
    else
      s_score[e] = __fsqrt_rn(lg > 20.0f ? lg : log1pf(expf(lg)));
  }
  __syncthreads();
  if (tid < 32) {
    int sel = E;   // lane j < k ends with expert j
    if (ra.tid2eid != nullptr) {
      if (lane < k) sel = int(ra.tid2eid[ra.ids[0] * k + lane]);
    } else {
      for (int t = 0; t < k; ++t) {
        float bm = -INFINITY;
        int be = ROUTE_MAX_E;   // none yet; NaN never qualifies
        for (int e = lane; e < E; e += 32) {   // the lowest id among equal values
          const float b = s_score[e] + s_bias[e];
          if (b == b && (be == ROUTE_MAX_E || b > bm)) {
            bm = b;
            be = e;
          }
        }
        for (int off = 16; off >= 1; off >>= 1) {
          const float ob = __shfl_xor_sync(FULL, bm, off);
          const int oe = __shfl_xor_sync(FULL, be, off);
          if (ob > bm || (ob == bm && oe < be)) {
            bm = ob;
            be = oe;
          }
        }
        const int a = min(be, E - 1);      // NaN scores: still a valid expert id
        if (lane == t) sel = a;
        if (lane == 0) s_bias[a] = -INFINITY;   // taken
        __syncwarp();
      }
    }
    sel = lane < k ? min(max(sel, 0), E - 1) : E;
    int rank = 0;   // the ids sorted: rank = ids below, or equal at a lower lane
    for (int j = 0; j < k; ++j) {
      const int o = __shfl_sync(FULL, sel, j);
      rank += (o < sel) || (o == sel && j < lane);
    }
    if (lane < k) s_idx[rank] = sel;
    __syncwarp();
    if (lane == 0) {
      float tot = 0.0f;
      for (int j = 0; j < k; ++j) tot += s_score[s_idx[j]];
      for (int j = 0; j < k; ++j) {
        const float w = s_score[s_idx[j]];
        s_w[j] = (ra.score != 0 ? __fdiv_rn(w, tot) : w) * ra.route_scale;
      }
    }
  }
  __syncthreads();
}

// One CTA: the routing of the token into idx [k] int64 (ascending) and w [k] float32.
// CTA b: token b of the launch (the speculative verify rows): logits row b, ids[b], idx / w row b.
__global__ void __launch_bounds__(256) route_kernel(const RouteArgs ra, int k, int64_t* idx, float* w) {
  __shared__ float s_score[ROUTE_MAX_E], s_bias[ROUTE_MAX_E];
  __shared__ int64_t s_idx[ROUTE_MAX_K];
  __shared__ float s_w[ROUTE_MAX_K];
  RouteArgs rb = ra;
  rb.logits += size_t(blockIdx.x) * ra.E;
  if (rb.ids != nullptr) rb.ids += blockIdx.x;
  idx += size_t(blockIdx.x) * k;
  w += size_t(blockIdx.x) * k;
  pdl_wait();   // the logits come from the gate GEMV
  route_cta(rb, k, s_score, s_bias, s_idx, s_w);
  if (threadIdx.x < k) {
    idx[threadIdx.x] = s_idx[threadIdx.x];
    w[threadIdx.x] = s_w[threadIdx.x];
  }
}

// ---- FP4 experts on tensor cores --------------------------------------------------------------

// 8 e2m1 codes (nibble r = element r) -> e4m3 bytes (value * 2^-6): lo = elements 0, 2, 4, 6,
// hi = elements 1, 3, 5, 7 (byte b of each = element 2b / 2b + 1).
DEV void e2m1x8_to_e4m3(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
  hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

DEV void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four e4m3 bytes -> two f16x2 (exact): lo = bytes 0, 1; hi = bytes 2, 3.
DEV void e4m3x4_to_f16x4(uint32_t v, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
}

// 8 e2m1 codes -> 4 f16x2 (value * 2^-6, exact): p[0] = (e0, e2), p[1] = (e4, e6), p[2] = (e1, e3),
// p[3] = (e5, e7) (the order quant_slice stores the activation in).
DEV void e2m1x8_to_f16(uint32_t w, uint32_t (&p)[4]) {
  uint32_t lo, hi;
  e2m1x8_to_e4m3(w, lo, hi);
  e4m3x4_to_f16x4(lo, p[0], p[1]);
  e4m3x4_to_f16x4(hi, p[2], p[3]);
}

// 8 e2m1 codes -> 4 f16x2 with integer ops only (value * 2^-14; +-0.5 become f16 subnormals):
// p[0] = (e0, e4), p[1] = (e1, e5), p[2] = (e2, e6), p[3] = (e3, e7), each pair's codes 16 bits
// apart, so one shift per field serves both halves.
DEV void e2m1x8_to_f16_int(uint32_t w, uint32_t (&p)[4]) {
  p[0] = ((w << 9) & 0x0E000E00u) | ((w << 12) & 0x80008000u);
  p[1] = ((w << 5) & 0x0E000E00u) | ((w << 8) & 0x80008000u);
  p[2] = ((w << 1) & 0x0E000E00u) | ((w << 4) & 0x80008000u);
  p[3] = ((w >> 3) & 0x0E000E00u) | (w & 0x80008000u);
}

// Two float32 -> e4m3 (RNE, saturating: the clamp of act_quant) -> f16x2 (exact): lo in the low half.
DEV uint32_t f32x2_to_e4m3_f16x2(float lo, float hi) {
  uint32_t r;
  asm("{\n.reg .b16 t;\ncvt.rn.satfinite.e4m3x2.f32 t, %2, %1;\ncvt.rn.f16x2.e4m3x2 %0, t;\n}"
      : "=r"(r)
      : "f"(lo), "f"(hi));
  return r;
}

// Position (in halves) of element r of a word in the activation operand: the order in which the
// weight decode DEC packs a word's 8 codes into its 4 f16x2 (0: e0 e2 e4 e6 e1 e3 e5 e7; 1: e0 e4
// e1 e5 e2 e6 e3 e7).
template <int DEC>
DEV int x_pos(int r) { return DEC == 0 ? (r & 1) * 4 + (r >> 1) : (r & 3) * 2 + (r >> 2); }

// The 16-byte chunk of a warp's activation operand that holds chunk c (8 elements: group c / 4,
// word c % 4), swizzled so that the four lanes (q, q) reading a step's word w (chunks 4q + w of
// the step) hit four different bank groups (w, w + 4, w ^ 2, (w ^ 2) + 4 of the 8 16-byte
// groups) and the other lanes' zero chunks (see expert_smem) two more: one shared-memory
// wavefront per load (the unswizzled layout with a zero operand per lane q took ~8).
DEV int xchunk(int c) { return c ^ ((c >> 2) & 2); }

// act_quant of one warp's slice of an activation row (SPW blocks of 128, bf16) into shared memory
// as f16 MMA operands: the e4m3 values (exact in f16), 16 bytes per 32-group and word (8
// elements) in the order x_pos<DEC>; ef[s] = 2^(e_s + 6) (DEC 0) or 2^(e_s + 14) (DEC 1): the
// block's scale times the power of two the weight decode leaves out.
template <int SPW, int DEC>
DEV void quant_slice(const __nv_bfloat16* act, uint16_t* xs, float* ef, int lane) {
  constexpr int EPL = 4 * SPW, LPB = 32 / SPW;   // elements per lane, lanes per 128-block
  float v[EPL];
  load_act<EPL>(act, size_t(lane) * EPL, false, v);
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < EPL; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int off = 1; off < LPB; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, off));
  const int e = block_exponent(amax);
  const float inv = pow2f(-e);
#pragma unroll
  for (int j = 0; j < EPL; j += 2) {
    const uint32_t h = f32x2_to_e4m3_f16x2(v[j] * inv, v[j + 1] * inv);
    const int t = lane * EPL + j, c = xchunk(t >> 3) * 8;
    xs[c + x_pos<DEC>(t & 7)] = uint16_t(h & 0xFFFFu);
    xs[c + x_pos<DEC>((t + 1) & 7)] = uint16_t(h >> 16);
  }
  if (lane % LPB == 0) ef[lane / LPB] = pow2f(e + (DEC == 0 ? 6 : 14));
}

// One 128-step of the tensor-core part shared by up and down, for NM matrices on the same rows:
// lane (g, q) holds 16 bytes of row g and of row g + 8 at group 4s + q (wa, wb) and the 4 scale
// bytes of groups 4s .. 4s + 3 of each row (sa, sb). B column n = q carries group 4s + q only
// (lane (q, q) reads it from the step's xs, the other lanes a zero chunk: xq, see expert_smem),
// so after the group's 8 MMAs C[r][n] is row r's dot with group 4s + n (n < 4).
// Adds to tot[m][0] / tot[m][1] (rows g / g + 8) the dots of groups 4s + 2q and 4s + 2q + 1
// scaled by their ue8m0 and f (lanes q < 2; lanes q >= 2 hold zero columns).
template <int NM>
struct ExpertStep {
  uint4 wa[NM], wb[NM];
  uint32_t sa[NM], sb[NM];
};

template <int NM, int DEC>
DEV void fp4_step(const ExpertStep<NM>& st, const uint4* xq, float f, int q, float (&tot)[NM][2]) {
  float c[NM][4];
#pragma unroll
  for (int m = 0; m < NM; ++m) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 b = xq[w ^ ((q >> 1) << 1)];
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const uint32_t ra = w == 0 ? st.wa[m].x : w == 1 ? st.wa[m].y : w == 2 ? st.wa[m].z : st.wa[m].w;
      const uint32_t rb = w == 0 ? st.wb[m].x : w == 1 ? st.wb[m].y : w == 2 ? st.wb[m].z : st.wb[m].w;
      uint32_t pa[4], pb[4];
      if constexpr (DEC == 0) {
        e2m1x8_to_f16(ra, pa);
        e2m1x8_to_f16(rb, pb);
      } else {
        e2m1x8_to_f16_int(ra, pa);
        e2m1x8_to_f16_int(rb, pb);
      }
      mma_f16(c[m], pa[0], pb[0], pa[1], pb[1], b.x, b.y);
      mma_f16(c[m], pa[2], pb[2], pa[3], pb[3], b.z, b.w);
    }
  }
  if (q < 2) {
    const int sh = 16 * (q & 1);
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      tot[m][0] = fmaf(c[m][0], e8m0(st.sa[m] >> sh) * f, tot[m][0]);
      tot[m][0] = fmaf(c[m][1], e8m0(st.sa[m] >> (sh + 8)) * f, tot[m][0]);
      tot[m][1] = fmaf(c[m][2], e8m0(st.sb[m] >> sh) * f, tot[m][1]);
      tot[m][1] = fmaf(c[m][3], e8m0(st.sb[m] >> (sh + 8)) * f, tot[m][1]);
    }
  }
}

// A warp's SPW steps with DEPTH steps of weights in flight: prefetch() requests steps
// 0 .. DEPTH - 1, run() refills a step's registers with step s + DEPTH once step s is computed
// (DEPTH = SPW: everything at once, as many registers). wp[m] / sp[m]: matrix m's row g (bytes / scale bytes at the warp's
// first group); rows g + 8 are 8 * wrow / 8 * srow bytes further.
template <int SPW, int NM, int DEC, int DEPTH>
struct ExpertWarp {
  const uint8_t* wp[NM];
  const uint8_t* sp[NM];
  size_t wrow, srow;
  int q;
  ExpertStep<NM> st[DEPTH];

  DEV void load(int s) {
    ExpertStep<NM>& e = st[s % DEPTH];
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const uint8_t* w = wp[m] + size_t(4 * s + q) * 16;
      e.wa[m] = ld_stream(w);
      e.wb[m] = ld_stream(w + 8 * wrow);
      e.sa[m] = ld_stream_u32(sp[m] + 4 * s);
      e.sb[m] = ld_stream_u32(sp[m] + 4 * s + 8 * srow);
    }
  }
  DEV void prefetch() {
#pragma unroll
    for (int s = 0; s < DEPTH && s < SPW; ++s) load(s);
  }
  DEV void run(const uint4* xq, int xstride, const float* ef, float (&tot)[NM][2]) {
#pragma unroll
    for (int s = 0; s < SPW; ++s) {
      fp4_step<NM, DEC>(st[s % DEPTH], xq + s * xstride, ef[s], q, tot);
      if (s + DEPTH < SPW) load(s + DEPTH);
    }
  }
};

// The scale words of a warp's K slice (word s: the ue8m0 bytes of groups 4s .. 4s + 3, step s)
// in one load per 32 rows: lane l reads its row's SPW words at p (l & 15: the row in the tile;
// l >> 4: the matrix or expert, see spread_scales). A per-step load per fragment row asked the
// memory system for 8 lines for 32 useful bytes, as many line requests as the weights'.
template <int SPW>
DEV void ld_scales(const uint8_t* p, uint32_t (&sc)[SPW]) {
  static_assert(SPW == 1 || SPW == 2 || SPW == 4, "spw");
  if constexpr (SPW == 1) {
    sc[0] = ld_stream_u32(p);
  } else if constexpr (SPW == 2) {
    const uint2 v = ld_stream_u64(p);
    sc[0] = v.x;
    sc[1] = v.y;
  } else {
    const uint4 v = ld_stream(p);
    sc[0] = v.x;
    sc[1] = v.y;
    sc[2] = v.z;
    sc[3] = v.w;
  }
}

// Lane (g, q)'s scale words of rows g and g + 8 (sa, sb) from the lanes 16h .. 16h + 15 that
// loaded them (ld_scales): word w of those lanes.
DEV void spread_scales(uint32_t w, int h, int g, uint32_t& sa, uint32_t& sb) {
  sa = __shfl_sync(FULL, w, 16 * h + g);
  sb = __shfl_sync(FULL, w, 16 * h + g + 8);
}

// Bytes of the expert_smem layout below (nm red rows per warp).
template <int SPW>
constexpr size_t expert_smem_bytes(int warps, int nm) {
  return 128 + size_t(warps) * (256 * SPW + 4 * SPW) + size_t(warps) * nm * 16 * sizeof(float);
}

// Shared-memory layout of the expert kernels: 128 zero bytes (the B operand of the lanes off
// their column), per warp xs (its activation operand, 256 * SPW bytes, chunks swizzled by xchunk)
// and ef (SPW floats), then red [warps][NM][16]. Returns xq, this lane's B operands of step 0 as
// fp4_step reads them (its word w at xq[w ^ ((q >> 1) << 1)]): xs + 4q for lane (q, q), then
// 16 chunks further per step (xstride), else zero + 1 for every step (xstride 0; its chunks
// 1 + (w ^ 0 or 2) lie in bank groups apart from the four lanes (q, q)'s, see xchunk).
template <int SPW>
DEV const uint4* expert_smem(uint8_t* smem, int warp, int nwarps, int g, int q, float*& ef,
                             float*& red, uint4*& xs, int& xstride) {
  uint4* zero = reinterpret_cast<uint4*>(smem);
  if (threadIdx.x < 8) zero[threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
  xs = reinterpret_cast<uint4*>(smem + 128 + warp * 256 * SPW);
  ef = reinterpret_cast<float*>(smem + 128 + nwarps * 256 * SPW) + warp * SPW;
  red = reinterpret_cast<float*>(smem + 128 + nwarps * 256 * SPW) + nwarps * SPW;
  xstride = g == q ? 16 : 0;
  return g == q ? xs + 4 * q : zero + 1;
}

// up's epilogue, the warp's part: its gate / up sums tot of the tile's 16 rows -> red[warp]
// ([warps][2][16]).
DEV void up_partial(float (&tot)[2][2], float* red, int warp, int g, int q) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) tot[m][h] += __shfl_xor_sync(FULL, tot[m][h], 1);
  if (q == 0) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      red[(warp * 2 + m) * 16 + g] = tot[m][0];
      red[(warp * 2 + m) * 16 + g + 8] = tot[m][1];
    }
  }
}

// up's epilogue, the rest (one warp, every warp's part in red): lane r < 16 writes row r0 + r of
// expert slot j: the warps' gate (lane r) and up (lane r + 16) sums in warp order, bf16, clamp,
// SwiGLU, route weight -> a.
DEV void up_finish(const float* red, int lane, int nwarps, const float* rw, __nv_bfloat16* out,
                   float limit, int I, int j, int r0) {
  const int r = lane & 15, m = lane >> 4;
  float sum = 0.0f;
#pragma unroll 16
  for (int w = 0; w < nwarps; ++w) sum += red[(w * 2 + m) * 16 + r];
  const float us = __shfl_down_sync(FULL, sum, 16);
  if (lane >= 16) return;
  float gv = bf16_round(sum), uv = bf16_round(us);   // fp4_gemm outputs bf16
  if (limit > 0.0f) {
    uv = fminf(fmaxf(uv, -limit), limit);
    gv = fminf(gv, limit);
  }
  out[size_t(j) * I + r0 + r] = __float2bfloat16_rn(gv / (1.0f + expf(-gv)) * uv * rw[j]);
}

// up's epilogue for one tile (expert slot j, rows r0 .. r0 + 15): the warps' gate / up sums tot
// meet in red ([warps][2][16]; a block barrier), then warp 0 adds them up and writes the rows.
DEV void up_epilogue(float (&tot)[2][2], float* red, int warp, int nwarps, int g, int q,
                     const float* rw, __nv_bfloat16* out, float limit, int I, int j, int r0) {
  up_partial(tot, red, warp, g, q);
  __syncthreads();
  if (threadIdx.x < 32) up_finish(red, threadIdx.x, nwarps, rw, out, limit, I, j, r0);
}

// a[j, r] = bf16(silu(g) * u * rw[j]), g / u = bf16(W8A8 w1 / w3 of expert idx[j] at x), u clamped
// to +-limit and g from above (limit 0: none). Grid (I / 16, k); warp w: K slice [w*128*SPW, ...).
// Pair j reads activation row j / kpr (x [k / kpr, D]: the speculative verify rows' pairs).
template <int SPW, int DEC, int DEPTH>
__global__ void __launch_bounds__(512) fp4_up_kernel(const __nv_bfloat16* x, const int64_t* idx,
                                                     const float* rw, const uint8_t* w1, const uint8_t* s1,
                                                     const uint8_t* w3, const uint8_t* s3,
                                                     __nv_bfloat16* out, float limit, int I, int D,
                                                     int kpr) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, j = blockIdx.y, r0 = blockIdx.x * 16;
  uint4* xs;
  float *ef, *red;
  int xstride;
  const uint4* xq = expert_smem<SPW>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  pdl_wait();   // the experts come from the routing kernel
  const int64_t e = idx[j];
  const int k0 = warp * 128 * SPW;
  const size_t rowa = size_t(e) * I + r0 + g;
  ExpertWarp<SPW, 2, DEC, DEPTH> ew;
  ew.wrow = size_t(D) / 2;
  ew.srow = size_t(D) / 32;
  ew.q = q;
  ew.wp[0] = w1 + rowa * ew.wrow + (k0 >> 5) * 16;
  ew.wp[1] = w3 + rowa * ew.wrow + (k0 >> 5) * 16;
  ew.sp[0] = s1 + rowa * ew.srow + (k0 >> 5);
  ew.sp[1] = s3 + rowa * ew.srow + (k0 >> 5);
  ew.prefetch();   // the first weights load while the activation is quantized
  quant_slice<SPW, DEC>(x + size_t(j / kpr) * D + k0, reinterpret_cast<uint16_t*>(xs), ef, lane);
  __syncthreads();   // xs, and the zero operand
  float tot[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  ew.run(xq, xstride, ef, tot);
  up_epilogue(tot, red, warp, nwarps, g, q, rw, out, limit, I, j, r0);
}

// fp4_up_kernel over a fixed grid: CTA c takes the (expert, 16-row) tiles c, c + G, c + 2G, ...
// (tile t: expert slot t / (I / 16), rows 16 * (t % (I / 16))), its warps' weights for the next
// tile in flight (registers A / B in turn) while the current one is computed and reduced, so an
// SM keeps loading between tiles instead of idling through each CTA's compute and epilogue. x is
// quantized once. No block barrier per tile (it cost ~20% of the kernel's time: every warp waited
// for the one whose weights came last): each warp leaves its sums in the tile parity's red buffer
// and counts itself in (shared atomic); the warp that arrives last adds them up in warp order
// (up_finish: the sums and bits of fp4_up_kernel<SPW>), resets the count and bumps the buffer's
// generation, which a warp two tiles ahead waits for before it overwrites the buffer. k <= 64
// pairs; pair j reads activation row j / kpr (TR > 1: up to TR rows, the speculative verify rows,
// each quantized once into its own slice of xs / ef: a pair's sums are those of a one-row launch).
constexpr int UP_STREAM_MAX_K = 64, UP_STREAM_ROWS = 4;
template <int SPW, int DEC, int TR>
__global__ void __launch_bounds__(512) fp4_up_stream_kernel(const __nv_bfloat16* x,
                                                            const int64_t* idx, const float* rw,
                                                            const uint8_t* w1, const uint8_t* s1,
                                                            const uint8_t* w3, const uint8_t* s3,
                                                            __nv_bfloat16* out, float limit, int I,
                                                            int D, int k, int kpr) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int64_t s_e[UP_STREAM_MAX_K];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  uint4* xs;
  float *ef, *red;
  int xstride;
  const uint4* xq = expert_smem<SPW * TR>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  const int rt = I / 16, tiles = rt * k, G = gridDim.x;
  const int k0 = warp * 128 * SPW;
  const size_t wrow = size_t(D) / 2, srow = size_t(D) / 32;
  __shared__ int s_cnt[2];            // warps done with the parity's current tile
  __shared__ volatile int s_gen[2];   // the parity's tiles added up so far
  pdl_wait();   // the experts come from the routing kernel
  if (threadIdx.x < k) s_e[threadIdx.x] = idx[threadIdx.x];
  if (threadIdx.x < 2) {
    s_cnt[threadIdx.x] = 0;
    s_gen[threadIdx.x] = 0;
  }
  __syncthreads();
  ExpertStep<2> A[SPW], B[SPW];   // the weights of a tile (sa / sb: see compute)
  uint32_t scA[SPW], scB[SPW];     // its scale words (ld_scales: lanes 0-15 w1, 16-31 w3)
  auto load = [&](ExpertStep<2>(&st)[SPW], uint32_t(&sc)[SPW], int t) {
    const size_t row0 = size_t(s_e[t / rt]) * I + (t % rt) * 16, rowa = row0 + g;
    const uint8_t* wp[2] = {w1 + rowa * wrow + (k0 >> 5) * 16 + q * 16,
                            w3 + rowa * wrow + (k0 >> 5) * 16 + q * 16};
#pragma unroll
    for (int s = 0; s < SPW; ++s)
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        st[s].wa[m] = ld_stream(wp[m] + s * 64);
        st[s].wb[m] = ld_stream(wp[m] + s * 64 + 8 * wrow);
      }
    ld_scales<SPW>((lane < 16 ? s1 : s3) + (row0 + (lane & 15)) * srow + (k0 >> 5), sc);
  };
  // red: two [warps][2][16] buffers, one per tile parity (see the expert_smem size); use: how
  // many tiles of this parity the CTA did before this one
  auto compute = [&](const ExpertStep<2>(&st)[SPW], const uint32_t(&sc)[SPW], int t, int par,
                     int use) {
    float tot[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    const int xr = TR > 1 ? (t / rt) / kpr * SPW : 0;   // the pair's row: its first step of xs
#pragma unroll
    for (int s = 0; s < SPW; ++s) {
      ExpertStep<2> e = st[s];
#pragma unroll
      for (int m = 0; m < 2; ++m) spread_scales(sc[s], m, g, e.sa[m], e.sb[m]);
      fp4_step<2, DEC>(e, xq + (xr + s) * xstride, ef[xr + s], q, tot);
    }
    float* rp = red + par * nwarps * 32;
    while (s_gen[par] != use) {   // the buffer's previous tile not yet added up (rare)
    }
    __threadfence_block();
    up_partial(tot, rp, warp, g, q);
    __syncwarp();   // the warp's writes, then lane 0's count
    int last = 0;
    if (lane == 0) {
      __threadfence_block();
      last = atomicAdd(&s_cnt[par], 1) == nwarps - 1;
      __threadfence_block();
    }
    if (__shfl_sync(FULL, last, 0)) {
      __syncwarp();
      up_finish(rp, lane, nwarps, rw, out, limit, I, t / rt, (t % rt) * 16);
      __syncwarp();   // every read of rp, then the buffer is free
      if (lane == 0) {
        s_cnt[par] = 0;
        __threadfence_block();
        s_gen[par] = use + 1;
      }
    }
  };
  int t = blockIdx.x, n = 0;
  if (t < tiles) load(A, scA, t);
  for (int r = 0; r < (TR > 1 ? k / kpr : 1); ++r)
    quant_slice<SPW, DEC>(x + size_t(r) * D + k0, reinterpret_cast<uint16_t*>(xs + r * SPW * 16),
                          ef + r * SPW, lane);
  __syncthreads();   // xs, and the zero operand
  while (t < tiles) {   // n: the CTA's tiles so far (even ones use A and red buffer 0)
    if (t + G < tiles) load(B, scB, t + G);
    compute(A, scA, t, 0, n >> 1);
    t += G;
    ++n;
    if (t >= tiles) break;
    if (t + G < tiles) load(A, scA, t + G);
    compute(B, scB, t, 1, n >> 1);
    t += G;
    ++n;
  }
}

// y[r] = sum_j bf16(W8A8 w2[idx[j]] @ a[j])[r] in float32, slot order j = 0..k-1, (+ add[r]),
// rounded to y's dtype. Grid (D / 16, k): CTA (t, j) writes expert j's bf16 rows of tile t to
// ws[j, :]; the last CTA of tile t (semaphore cnt[t], reset by it) adds them up in slot order.
template <int SPW, int DEC, int DEPTH>
__global__ void __launch_bounds__(512) fp4_down_kernel(const __nv_bfloat16* act, const int64_t* idx,
                                                       const uint8_t* w2, const uint8_t* s2,
                                                       const __nv_bfloat16* add, void* y,
                                                       float* ws, int* cnt, int D, int I, int k,
                                                       int y_f32) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, j = blockIdx.y, r0 = blockIdx.x * 16;
  uint4* xs;
  float *ef, *red;
  int xstride;
  const uint4* xq = expert_smem<SPW>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  pdl_wait();
  const int64_t e = idx[j];
  const int k0 = warp * 128 * SPW;
  const size_t rowa = size_t(e) * D + r0 + g;
  ExpertWarp<SPW, 1, DEC, DEPTH> ew;
  ew.wrow = size_t(I) / 2;
  ew.srow = size_t(I) / 32;
  ew.q = q;
  ew.wp[0] = w2 + rowa * ew.wrow + (k0 >> 5) * 16;
  ew.sp[0] = s2 + rowa * ew.srow + (k0 >> 5);
  ew.prefetch();
  quant_slice<SPW, DEC>(act + size_t(j) * I + k0, reinterpret_cast<uint16_t*>(xs), ef, lane);
  __syncthreads();   // xs, and the zero operand
  float tot[1][2] = {{0.0f, 0.0f}};
  ew.run(xq, xstride, ef, tot);
  tot[0][0] += __shfl_xor_sync(FULL, tot[0][0], 1);
  tot[0][1] += __shfl_xor_sync(FULL, tot[0][1], 1);
  if (q == 0) {
    red[warp * 16 + g] = tot[0][0];
    red[warp * 16 + g + 8] = tot[0][1];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float t = 0.0f;
    for (int w = 0; w < nwarps; ++w) t += red[w * 16 + threadIdx.x];
    ws[size_t(j) * D + r0 + threadIdx.x] = bf16_round(t);   // fp4_gemm outputs bf16
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int done = atomicAdd(cnt + blockIdx.x, 1);
    last = done == k - 1;
    if (last) cnt[blockIdx.x] = 0;   // ready for the next launch
  }
  __syncthreads();
  if (last && threadIdx.x < 16) {
    __threadfence();
    const int r = r0 + threadIdx.x;
    float t = 0.0f;
    for (int jj = 0; jj < k; ++jj) t += __ldcg(ws + size_t(jj) * D + r);
    if (add != nullptr) t += __bfloat162float(add[r]);
    if (y_f32)
      static_cast<float*>(y)[r] = t;
    else
      static_cast<__nv_bfloat16*>(y)[r] = __float2bfloat16_rn(t);
  }
}

// fp4_down_kernel with all NE experts of a row tile in one CTA: y[r] = sum_j bf16(W8A8 w2[idx[j]] @
// a[j])[r] in float32, slot order j = 0..NE-1, (+ add[r]). Grid D / 16; warp w takes the K slice
// [w*128*SPW, ...) of every expert and streams its NE * SPW steps (expert-major) with DEPTH steps
// of weights in flight across the expert boundaries. The sums are those of fp4_down_kernel with
// the same SPW (per expert: warps in order, then bf16; experts in slot order), without its
// workspace, semaphore and second pass, and with one CTA per row tile instead of NE. Grid axis y:
// the activation row b (the speculative verify rows): act, idx, add and y move to row b's.
template <int SPW, int NE, int DEC, int DEPTH>
__global__ void __launch_bounds__(512) fp4_down_all_kernel(const __nv_bfloat16* act,
                                                           const int64_t* idx, const uint8_t* w2,
                                                           const uint8_t* s2,
                                                           const __nv_bfloat16* add, void* y,
                                                           int D, int I, int y_f32) {
  constexpr int NS = NE * SPW;
  static_assert(NE % 2 == 0, "the scale loads take two experts");
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, r0 = blockIdx.x * 16;
  act += size_t(blockIdx.y) * NE * I;
  idx += size_t(blockIdx.y) * NE;
  if (add != nullptr) add += size_t(blockIdx.y) * D;
  y = static_cast<char*>(y) + size_t(blockIdx.y) * D * (y_f32 ? 4 : 2);
  uint4* xs;
  float *ef, *red;   // the expert_smem layout with NS steps per warp; red [warps][NE][16]
  int xstride;
  const uint4* xq = expert_smem<NS>(smem, warp, nwarps, g, q, ef, red, xs, xstride);
  pdl_wait();
  const int k0 = warp * 128 * SPW;
  const size_t wrow = size_t(I) / 2, srow = size_t(I) / 32;
  const uint8_t* wp[NE];
#pragma unroll
  for (int j = 0; j < NE; ++j) {
    const size_t row = size_t(idx[j]) * D + r0 + g;
    wp[j] = w2 + row * wrow + (k0 >> 5) * 16 + q * 16;
  }
  ExpertStep<1> st[DEPTH];   // sa / sb: see the step loop
  auto load = [&](int s) {
    ExpertStep<1>& e = st[s % DEPTH];
    const int j = s / SPW, t = s % SPW;
    e.wa[0] = ld_stream(wp[j] + t * 64);
    e.wb[0] = ld_stream(wp[j] + t * 64 + 8 * wrow);
  };
#pragma unroll
  for (int s = 0; s < DEPTH && s < NS; ++s) load(s);
  uint32_t sc[NE / 2][SPW];   // experts 2i (lanes 0-15) and 2i + 1 (lanes 16-31), ld_scales
#pragma unroll
  for (int i = 0; i < NE / 2; ++i)
    ld_scales<SPW>(s2 + (size_t(idx[2 * i + (lane >> 4)]) * D + r0 + (lane & 15)) * srow + (k0 >> 5),
                   sc[i]);
#pragma unroll
  for (int j = 0; j < NE; ++j)
    quant_slice<SPW, DEC>(act + size_t(j) * I + k0, reinterpret_cast<uint16_t*>(xs + j * SPW * 16),
                          ef + j * SPW, lane);
  __syncthreads();   // xs, and the zero operand
  float tot[NE][1][2];
#pragma unroll
  for (int j = 0; j < NE; ++j) tot[j][0][0] = tot[j][0][1] = 0.0f;
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    ExpertStep<1> e = st[s % DEPTH];
    spread_scales(sc[s / SPW / 2][s % SPW], (s / SPW) & 1, g, e.sa[0], e.sb[0]);
    fp4_step<1, DEC>(e, xq + s * xstride, ef[s], q, tot[s / SPW]);
    if (s + DEPTH < NS) load(s + DEPTH);
  }
#pragma unroll
  for (int j = 0; j < NE; ++j) {
    tot[j][0][0] += __shfl_xor_sync(FULL, tot[j][0][0], 1);
    tot[j][0][1] += __shfl_xor_sync(FULL, tot[j][0][1], 1);
    if (q == 0) {
      red[(warp * NE + j) * 16 + g] = tot[j][0][0];
      red[(warp * NE + j) * 16 + g + 8] = tot[j][0][1];
    }
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    const int r = threadIdx.x;
    float acc = 0.0f;
    for (int j = 0; j < NE; ++j) {
      float t = 0.0f;
      for (int w = 0; w < nwarps; ++w) t += red[(w * NE + j) * 16 + r];
      acc += bf16_round(t);   // fp4_gemm outputs bf16
    }
    if (add != nullptr) acc += __bfloat162float(add[r0 + r]);
    if (y_f32)
      static_cast<float*>(y)[r0 + r] = acc;
    else
      static_cast<__nv_bfloat16*>(y)[r0 + r] = __float2bfloat16_rn(acc);
  }
}

// ---- FP8 GEMV on tensor cores ------------------------------------------------------------------

// The W8A8 FP8 GEMV of up to MMA_MAX_X activation rows on tensor cores (mma.m16n8k16, f16 operands,
// float32 accumulation): A = 16 weight rows (e4m3 -> f16 by cvt: exact), B column n = activation
// row n act-quantized per 128 (the e4m3 values, exact in f16; columns >= nx are zero), so a row's
// result never depends on the other columns: one row in a launch of nx gets the bits of a one-row
// launch. C restarts at zero for every 128-block, is scaled by the weight's and the row's block
// scales (powers of two: exact) and added into float32 sums in block order; warps split K and meet
// in a fixed-order sum. Every weight and scale byte is requested before the PDL wait.
//
// One CTA: 16 rows (inside one 128-row scale block; FLAG_TWO: of one matrix) x all of K; warp w
// takes the 128-blocks [w * SPW, (w + 1) * SPW). Lane (g, q) (g = lane / 4, q = lane % 4) holds
// the 16-byte chunks q and q + 4 of every block of rows g and g + 8: word j of chunk c is the A
// operand of one MMA for the four lanes q (bytes 0, 1 at k = 2q, 2q + 1; bytes 2, 3 at k = 2q + 8,
// 2q + 9), so B's lane (g, q) needs activation row g at the same 4 K positions, in natural order:
// the warp first act-quantizes its K slice of each row into shared memory (xs, f16).
constexpr int MMA_MAX_X = 8;

// Halves per xs row: a 16-byte pad puts the rows' reads in different banks.
template <int SPW>
__host__ __device__ constexpr int mma_xrow() { return 128 * SPW + 8; }

// Bytes of fp8_mma_kernel's shared memory: per warp xs [nx][mma_xrow] f16 and ef [nx][SPW] float
// (the row's block scales), then red [warps][NM][16][8] float.
template <int SPW, int NM>
constexpr size_t fp8_mma_smem(int warps, int nx) {
  return size_t(warps) * nx * (2 * mma_xrow<SPW>() + 4 * SPW) + size_t(warps) * NM * 128 * 4;
}

template <int SPW, bool SWIGLU>
__global__ void __launch_bounds__(512) fp8_mma_kernel(const Fp8Args a) {
  constexpr int NM = SWIGLU ? 2 : 1, XR = mma_xrow<SPW>();
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3, nx = a.nx, K = a.K;
  int row0 = blockIdx.x * 16;
  const uint8_t* wp[NM];
  const uint8_t* sp[NM];
  void* yp = a.y0;
  int ys = a.ys0;
  wp[0] = a.w0;
  sp[0] = a.s0;
  if constexpr (SWIGLU) {
    wp[1] = a.w1;
    sp[1] = a.s1;
  } else if ((a.flags & FLAG_TWO) && row0 >= a.n0) {
    row0 -= a.n0;
    wp[0] = a.w1;
    sp[0] = a.s1;
    yp = a.y1;
    ys = a.ys1;
  }
  const int kb0 = warp * SPW;   // the warp's first 128-block

  // weights [matrix][block][row g / g + 8][chunk q / q + 4] and the blocks' scale bytes
  uint4 wv[NM][SPW][2][2];
  uint32_t sw[NM][SPW];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int s = 0; s < SPW; ++s) {
      const uint8_t* p = wp[m] + size_t(row0 + g) * K + size_t(kb0 + s) * 128 + 16 * q;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < 2; ++c) wv[m][s][h][c] = ld_stream(p + size_t(8 * h) * K + 64 * c);
      sw[m][s] = ld_stream_u8(sp[m] + (row0 >> 7) * (K >> 7) + kb0 + s);
    }
  pdl_wait();

  // the warp's K slice of every activation row as f16 operands (lane l: elements [4 SPW l, +4 SPW)
  // of the slice): act-quantized (FLAG_QUANT: the e4m3 values, ef = the block's scale), or
  // (bf16 x, no act quant: wo_a) scaled by a power of two that puts the block's largest magnitude
  // in [2^15, 2^16): every bf16 value of the block down to 2^-33 of that magnitude is exact in f16
  __half* xs = reinterpret_cast<__half*>(smem) + size_t(warp) * nx * XR;
  float* ef = reinterpret_cast<float*>(smem + size_t(nwarps) * nx * XR * 2) + warp * nx * SPW;
  float* red = reinterpret_cast<float*>(smem + size_t(nwarps) * nx * (2 * XR + 4 * SPW));
  {
    constexpr int EPL = 4 * SPW, LPB = 32 / SPW;   // elements per lane, lanes per 128-block
    const bool xf32 = a.flags & FLAG_X_F32, quant = a.flags & FLAG_QUANT;
    const size_t xoff =
        (a.ng > 0 ? size_t(row0 / a.ng) * K : 0) + size_t(kb0) * 128 + size_t(lane) * EPL;
    for (int n = 0; n < nx; ++n) {
      float v[EPL];
      load_act<EPL>(a.x, size_t(n) * a.xs + xoff, xf32, v);
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < EPL; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
      for (int off = 1; off < LPB; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, off));
      const int e = quant ? block_exponent(amax)
                          : max(int((__float_as_uint(amax) >> 23) & 0xFFu) - 127 - 15, -126);
      const float inv = pow2f(-e);
      uint32_t* dst = reinterpret_cast<uint32_t*>(xs + n * XR + lane * EPL);
      if (quant) {
#pragma unroll
        for (int j = 0; j < EPL; j += 2)
          dst[j / 2] = f32x2_to_e4m3_f16x2(v[j] * inv, v[j + 1] * inv);
      } else {
#pragma unroll
        for (int j = 0; j < EPL; j += 2) {
          const __half2 h = __floats2half2_rn(v[j] * inv, v[j + 1] * inv);
          dst[j / 2] = *reinterpret_cast<const uint32_t*>(&h);
        }
      }
      if (lane % LPB == 0) ef[n * SPW + lane / LPB] = pow2f(e);
    }
  }
  __syncwarp();

  float tot[NM][2][2] = {};   // [matrix][row g / g + 8][column 2q / 2q + 1]
#pragma unroll
  for (int s = 0; s < SPW; ++s) {
    float c[NM][4];
#pragma unroll
    for (int m = 0; m < NM; ++m) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
#pragma unroll
    for (int ch = 0; ch < 2; ++ch) {
      uint4 b[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
      if (g < nx) {
        const uint4* xp = reinterpret_cast<const uint4*>(xs + g * XR + s * 128 + 16 * (q + 4 * ch));
        b[0] = xp[0];
        b[1] = xp[1];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t b0 = j == 0 ? b[0].x : j == 1 ? b[0].z : j == 2 ? b[1].x : b[1].z;
        const uint32_t b1 = j == 0 ? b[0].y : j == 1 ? b[0].w : j == 2 ? b[1].y : b[1].w;
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          const uint4& ra = wv[m][s][0][ch];
          const uint4& rb = wv[m][s][1][ch];
          const uint32_t wa = j == 0 ? ra.x : j == 1 ? ra.y : j == 2 ? ra.z : ra.w;
          const uint32_t wb = j == 0 ? rb.x : j == 1 ? rb.y : j == 2 ? rb.z : rb.w;
          uint32_t alo, ahi, blo, bhi;
          e4m3x4_to_f16x4(wa, alo, ahi);
          e4m3x4_to_f16x4(wb, blo, bhi);
          mma_f16(c[m], alo, blo, ahi, bhi, b0, b1);
        }
      }
    }
    // C[r][n]: c[0] (g, 2q), c[1] (g, 2q + 1), c[2] (g + 8, 2q), c[3] (g + 8, 2q + 1)
    const float f0 = 2 * q < nx ? ef[(2 * q) * SPW + s] : 0.0f;
    const float f1 = 2 * q + 1 < nx ? ef[(2 * q + 1) * SPW + s] : 0.0f;
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const float ws = e8m0(sw[m][s]);
      tot[m][0][0] = fmaf(c[m][0], ws * f0, tot[m][0][0]);
      tot[m][0][1] = fmaf(c[m][1], ws * f1, tot[m][0][1]);
      tot[m][1][0] = fmaf(c[m][2], ws * f0, tot[m][1][0]);
      tot[m][1][1] = fmaf(c[m][3], ws * f1, tot[m][1][1]);
    }
  }

  // red[warp][m][row][column]; then thread (column n, row r) adds the warps' sums in warp order
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* rp = red + ((warp * NM + m) * 16 + g + 8 * h) * 8 + 2 * q;
      rp[0] = tot[m][h][0];
      rp[1] = tot[m][h][1];
    }
  __syncthreads();
  for (int t = threadIdx.x; t < 16 * nx; t += blockDim.x) {
    const int r = t & 15, n = t >> 4;
    float v[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      v[m] = 0.0f;
      for (int w = 0; w < nwarps; ++w) v[m] += red[((w * NM + m) * 16 + r) * 8 + n];
    }
    float y = v[0];
    if constexpr (SWIGLU) {   // fp8_gemm outputs bf16; the clamped SwiGLU runs on those values
      float gt = bf16_round(v[0]), u = bf16_round(v[1]);
      if (a.limit > 0.0f) {
        u = fminf(fmaxf(u, -a.limit), a.limit);
        gt = fminf(gt, a.limit);
      }
      y = gt / (1.0f + expf(-gt)) * u;
    }
    const size_t o = size_t(n) * ys + row0 + r;
    if (a.flags & FLAG_Y_F32)
      static_cast<float*>(yp)[o] = y;
    else
      static_cast<__nv_bfloat16*>(yp)[o] = __float2bfloat16_rn(y);
  }
}

// ---- top-k of the indexer scores ------------------------------------------------------------------

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

// ---- launching -----------------------------------------------------------------------------------

template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                   int pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...);
  if (err != cudaSuccess) (void)cudaGetLastError();   // a launch error is not sticky: clear it
  return err;
}

using Fp8Launch = cudaError_t (*)(const Fp8Args&, int, int, cudaStream_t, int);
template <int LC, int RPL, int CPL, bool SW>
cudaError_t fp8_launch(const Fp8Args& a, int blocks, int warps, cudaStream_t st, int pdl) {
  constexpr int ROWS = (32 / LC) * RPL, NM = SW ? 2 : 1;
  return launch(a.nx > 1 ? fp8_gemv_kernel<LC, RPL, CPL, SW, true> : fp8_gemv_kernel<LC, RPL, CPL, SW, false>,
                dim3(blocks), dim3(32 * warps),
                size_t(warps) * NM * ROWS * sizeof(float), st, pdl, a);
}

Fp8Args fp8_args(const void* w0, const void* s0, void* y0, const void* w1, const void* s1, void* y1,
                 const void* x, int n0, int K, int ng, float limit, int flags, int nx, int xs,
                 int ys0, int ys1) {
  Fp8Args a;
  a.w0 = static_cast<const uint8_t*>(w0);
  a.s0 = static_cast<const uint8_t*>(s0);
  a.y0 = y0;
  a.w1 = static_cast<const uint8_t*>(w1);
  a.s1 = static_cast<const uint8_t*>(s1);
  a.y1 = y1;
  a.x = x;
  a.n0 = n0;
  a.K = K;
  a.ng = ng;
  a.limit = limit;
  a.flags = flags;
  a.nx = nx;
  a.xs = xs;
  a.ys0 = ys0;
  a.ys1 = ys1;
  return a;
}

template <int SPW, bool SW>
cudaError_t fp8_mma_launch(const Fp8Args& a, int blocks, int warps, cudaStream_t st, int pdl) {
  const size_t smem = fp8_mma_smem<SPW, SW ? 2 : 1>(warps, a.nx);
  if (smem > 48 * 1024) {   // above the default limit: opt in (no stream operation: capture-safe)
    const cudaError_t err = cudaFuncSetAttribute(
        fp8_mma_kernel<SPW, SW>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return err;
    }
  }
  return launch(fp8_mma_kernel<SPW, SW>, dim3(blocks), dim3(32 * warps), smem, st, pdl, a);
}

// The instantiated tensor-core configs: SPW * NM <= 4 blocks of weights per lane (64 registers).
Fp8Launch fp8_mma_pick(int spw, bool sw) {
  switch (spw * 2 + sw) {
    case 2: return fp8_mma_launch<1, false>;
    case 3: return fp8_mma_launch<1, true>;
    case 4: return fp8_mma_launch<2, false>;
    case 5: return fp8_mma_launch<2, true>;
    case 8: return fp8_mma_launch<4, false>;
    default: return nullptr;
  }
}

// The instantiated configs: RPL * CPL * NM <= 16 weight chunks per lane.
template <int LC, int CPL, bool SW>
Fp8Launch fp8_pick_rpl(int rpl) {
  constexpr int NM = SW ? 2 : 1;
  switch (rpl) {
    case 1: return fp8_launch<LC, 1, CPL, SW>;
    case 2: return fp8_launch<LC, 2, CPL, SW>;
    case 4: return fp8_launch<LC, 4, CPL, SW>;
    case 8:
      if constexpr (8 * CPL * NM <= 16) return fp8_launch<LC, 8, CPL, SW>;
      return nullptr;
    case 16:
      if constexpr (16 * CPL * NM <= 16) return fp8_launch<LC, 16, CPL, SW>;
      return nullptr;
    default: return nullptr;
  }
}

template <int LC, bool SW>
Fp8Launch fp8_pick_cpl(int cpl, int rpl) {
  switch (cpl) {
    case 1: return fp8_pick_rpl<LC, 1, SW>(rpl);
    case 2: return fp8_pick_rpl<LC, 2, SW>(rpl);
    default: return nullptr;
  }
}

template <bool SW>
Fp8Launch fp8_pick(int lc, int cpl, int rpl) {
  switch (lc) {
    case 8: return fp8_pick_cpl<8, SW>(cpl, rpl);
    case 16: return fp8_pick_cpl<16, SW>(cpl, rpl);
    case 32: return fp8_pick_cpl<32, SW>(cpl, rpl);
    default: return nullptr;
  }
}


// A per-tile expert kernel's instantiation as one switch key: (spw, e2m1 decode, steps in flight;
// depth 0 = spw). Used by both launchers' case labels, so key and labels cannot drift apart.
constexpr int expert_variant(int spw, int dec, int depth) {
  return (spw * 2 + (dec != 0)) * 10 + (depth > 0 ? depth : spw);
}

}  // namespace

extern "C" {

// Version of this ABI (checked by the loader).
int dsv4_abi_version() { return 5; }

const char* dsv4_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// Returns 0 or a cudaError_t; -1: no such config. Grid: blocks CTAs of 32 * warps threads, each
// ROWS = (32 / lc) * rpl rows; K == warps * lc * cpl * 16. nx activation rows (x row t at x + t * xs
// elements, its outputs at y0 / y1 + t * ys0 / ys1).
int dsv4_fp8_gemv(const void* w0, const void* s0, void* y0, const void* w1, const void* s1, void* y1,
                  const void* x, int n0, int K, int ng, float limit, int flags, int swiglu, int lc,
                  int rpl, int cpl, int warps, int blocks, int nx, int xs, int ys0, int ys1,
                  void* stream, int pdl) {
  const Fp8Launch fn = swiglu ? fp8_pick<true>(lc, cpl, rpl) : fp8_pick<false>(lc, cpl, rpl);
  if (fn == nullptr || warps < 1 || warps > 16 || blocks < 1 || nx < 1) return -1;
  return fn(fp8_args(w0, s0, y0, w1, s1, y1, x, n0, K, ng, limit, flags, nx, xs, ys0, ys1), blocks,
            warps, static_cast<cudaStream_t>(stream), pdl);
}

// The same GEMV on tensor cores (fp8_mma_kernel): 1 <= nx <= 8 activation rows, act-quantized
// (FLAG_QUANT) or bf16 x (grouped or not); blocks CTAs of 16 rows, 32 * warps threads;
// K == warps * 128 * spw.
int dsv4_fp8_gemv_mma(const void* w0, const void* s0, void* y0, const void* w1, const void* s1,
                      void* y1, const void* x, int n0, int K, int ng, float limit, int flags,
                      int swiglu, int spw, int warps, int blocks, int nx, int xs, int ys0, int ys1,
                      void* stream, int pdl) {
  const Fp8Launch fn = fp8_mma_pick(spw, swiglu != 0);
  if (fn == nullptr || warps < 1 || warps > 16 || blocks < 1 || nx < 1 || nx > MMA_MAX_X ||
      K != warps * 128 * spw || (!(flags & FLAG_QUANT) && (flags & FLAG_X_F32)) || ng < 0 ||
      ng % 16 || (ng && (flags & FLAG_TWO)) || (swiglu && (flags & FLAG_TWO)))
    return -1;
  return fn(fp8_args(w0, s0, y0, w1, s1, y1, x, n0, K, ng, limit, flags, nx, xs, ys0, ys1), blocks,
            warps, static_cast<cudaStream_t>(stream), pdl);
}

// a [k, I] bf16 from x [D] bf16 and the routing idx [k] int64 / rw [k] float32; grid (I / 16, k),
// D / (128 * spw) warps; dec: the e2m1 decode (0: through e4m3 and cvt, 1: integer ops); depth:
// steps of weights in flight per warp (0: all). ctas > 0: fp4_up_stream_kernel on min(ctas, tiles)
// CTAs instead (dec 0, spw 1 or 2 (4 spills), k <= 64 and at most 4 rows; depth unused). kpr:
// pairs per activation row (pair j reads x row j / kpr).
int dsv4_fp4_up(const void* x, const void* idx, const void* rw, const void* w1, const void* s1,
                const void* w3, const void* s3, void* out, float limit, int I, int D, int k,
                int spw, int dec, int depth, int ctas, int kpr, void* stream, int pdl) {
  const int warps = D / (128 * spw);
  if (warps < 1 || warps > 16 || I % 16 || D % (128 * spw) || k < 1 || ctas < 0 || kpr < 1)
    return -1;
  const dim3 grid(I / 16, k), block(32 * warps);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const auto* xp = static_cast<const __nv_bfloat16*>(x);
  const auto* ip = static_cast<const int64_t*>(idx);
  const auto* rp = static_cast<const float*>(rw);
  const auto* w1p = static_cast<const uint8_t*>(w1);
  const auto* s1p = static_cast<const uint8_t*>(s1);
  const auto* w3p = static_cast<const uint8_t*>(w3);
  const auto* s3p = static_cast<const uint8_t*>(s3);
  auto* op = static_cast<__nv_bfloat16*>(out);
#define DSV4_UP(S, DC, R) \
  launch(fp4_up_kernel<S, DC, R>, grid, block, expert_smem_bytes<S>(warps, 2), st, pdl, xp, ip, rp, \
         w1p, s1p, w3p, s3p, op, limit, I, D, kpr)
#define DSV4_UPS(S, R) \
  launch(fp4_up_stream_kernel<S, 0, R>, dim3(ctas < (I / 16) * k ? ctas : (I / 16) * k), block, \
         expert_smem_bytes<S * R>(warps, 4), st, pdl, xp, ip, rp, w1p, s1p, w3p, s3p, op, limit, I, \
         D, k, kpr)
  if (ctas > 0) {
    const int rows = k / kpr;
    if (dec != 0 || k > UP_STREAM_MAX_K || k % kpr || rows > UP_STREAM_ROWS) return -1;
    switch (spw * 10 + (rows > 1)) {
      case 10: return DSV4_UPS(1, 1);
      case 20: return DSV4_UPS(2, 1);
      case 11: return DSV4_UPS(1, UP_STREAM_ROWS);
      case 21: return DSV4_UPS(2, UP_STREAM_ROWS);
      default: return -1;
    }
  }
  switch (expert_variant(spw, dec, depth)) {
    case expert_variant(1, 0, 1): return DSV4_UP(1, 0, 1);
    case expert_variant(2, 0, 2): return DSV4_UP(2, 0, 2);
    case expert_variant(2, 0, 1): return DSV4_UP(2, 0, 1);
    case expert_variant(4, 0, 4): return DSV4_UP(4, 0, 4);
    case expert_variant(4, 0, 3): return DSV4_UP(4, 0, 3);
    case expert_variant(4, 0, 2): return DSV4_UP(4, 0, 2);
    case expert_variant(4, 1, 4): return DSV4_UP(4, 1, 4);
    case expert_variant(4, 1, 2): return DSV4_UP(4, 1, 2);
    default: return -1;
  }
#undef DSV4_UP
#undef DSV4_UPS
}

// y [D] (float32 or bf16) from a [k, I] bf16; ws [k, D] float32 and cnt [D / 16] int32 (zeros,
// left zero) are the caller's workspace; add [D] bf16 or null. Grid (D / 16, k). all_experts:
// fp4_down_all_kernel instead (grid D / 16, no workspace; k 6 (Flash, Pro), dec 0, the (spw, depth)
// instantiated below). rows > 1 (all_experts only): rows activation rows, a [rows * k, I], idx
// [rows * k], add / y [rows, D].
int dsv4_fp4_down(const void* act, const void* idx, const void* w2, const void* s2, const void* add,
                  void* y, void* ws, void* cnt, int D, int I, int k, int y_f32, int spw, int dec,
                  int depth, int all_experts, int rows, void* stream, int pdl) {
  const int warps = I / (128 * spw);
  if (warps < 1 || warps > 16 || D % 16 || I % (128 * spw) || k < 1 || rows < 1 ||
      (rows > 1 && !all_experts))
    return -1;
  const dim3 grid(D / 16, k), block(32 * warps);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const auto* ap = static_cast<const __nv_bfloat16*>(act);
  const auto* ip = static_cast<const int64_t*>(idx);
  const auto* wp = static_cast<const uint8_t*>(w2);
  const auto* sp = static_cast<const uint8_t*>(s2);
  const auto* dp = static_cast<const __nv_bfloat16*>(add);
  auto* wsp = static_cast<float*>(ws);
  auto* cp = static_cast<int*>(cnt);
#define DSV4_DOWN(S, DC, R) \
  launch(fp4_down_kernel<S, DC, R>, grid, block, expert_smem_bytes<S>(warps, 1), st, pdl, ap, ip, \
         wp, sp, dp, y, wsp, cp, D, I, k, y_f32)
#define DSV4_DOWN_ALL(S, E, R) \
  launch(fp4_down_all_kernel<S, E, 0, R>, dim3(D / 16, rows), block, expert_smem_bytes<S * E>(warps, E), st, \
         pdl, ap, ip, wp, sp, dp, y, D, I, y_f32)
  if (all_experts) {
    if (dec != 0) return -1;
    switch ((k * 10 + spw) * 100 + (depth > 0 ? depth : spw)) {
      case 6202: return DSV4_DOWN_ALL(2, 6, 2);
      case 6204: return DSV4_DOWN_ALL(2, 6, 4);
      case 6206: return DSV4_DOWN_ALL(2, 6, 6);
      case 6404: return DSV4_DOWN_ALL(4, 6, 4);
      default: return -1;
    }
  }
  switch (expert_variant(spw, dec, depth)) {
    case expert_variant(1, 0, 1): return DSV4_DOWN(1, 0, 1);
    case expert_variant(2, 0, 2): return DSV4_DOWN(2, 0, 2);
    case expert_variant(2, 0, 1): return DSV4_DOWN(2, 0, 1);
    case expert_variant(4, 0, 4): return DSV4_DOWN(4, 0, 4);
    case expert_variant(4, 0, 2): return DSV4_DOWN(4, 0, 2);
    case expert_variant(2, 1, 2): return DSV4_DOWN(2, 1, 2);
    default: return -1;
  }
#undef DSV4_DOWN
#undef DSV4_DOWN_ALL
}

// The MoE routing of one token (kernels/route.py semantics): logits [E] float32 with bias [E]
// float32 (score routing) or tid2eid [V, k] int64 + ids [1] int64 (hash routing); score 0 softmax,
// 1 sigmoid, 2 sqrt-softplus -> idx [k] int64 ascending, w [k] float32. One CTA per token: rows
// tokens (logits [rows, E], ids [rows], idx / w [rows, k]).
int dsv4_route(const void* logits, const void* bias, const void* tid2eid, const void* ids, int E,
               int k, int score, float route_scale, void* idx, void* w, int rows, void* stream,
               int pdl) {
  if (k < 1 || k > ROUTE_MAX_K || E < k || E > ROUTE_MAX_E || (bias == nullptr) == (tid2eid == nullptr) ||
      score < 0 || score > 2 || rows < 1)
    return -1;
  RouteArgs ra;
  ra.logits = static_cast<const float*>(logits);
  ra.bias = static_cast<const float*>(bias);
  ra.tid2eid = static_cast<const int64_t*>(tid2eid);
  ra.ids = static_cast<const int64_t*>(ids);
  ra.E = E;
  ra.score = score;
  ra.route_scale = route_scale;
  return launch(route_kernel, dim3(rows), dim3(256), 0, static_cast<cudaStream_t>(stream), pdl, ra, k,
                static_cast<int64_t*>(idx), static_cast<float*>(w));
}

// out [rows, k] int64 = per row, the indices of the k largest of scores [rows, n] bf16
// (1 <= k <= n), see topk_bf16_kernel. One CTA per row.
int dsv4_topk_bf16(const void* scores, int n, int k, void* out, int rows, void* stream, int pdl) {
  if (k < 1 || k > n || rows < 1) return -1;
  const int threads = n >= 1024 ? 1024 : ((n + 31) / 32) * 32;
  return launch(topk_bf16_kernel, dim3(rows), dim3(threads), 0, static_cast<cudaStream_t>(stream), pdl,
                static_cast<const uint16_t*>(scores), n, k, static_cast<int64_t*>(out));
}

}  // extern "C"
