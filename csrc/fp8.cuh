// The FP8 GEMVs' shared part (fp8_gemv.cu on CUDA cores, fp8_mma.cu on tensor cores): the
// arguments of a launch, its flags, and the prologue both kernels open with.
#pragma once

#include "dsv4_common.cuh"

namespace {

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

// The prologue of both FP8 GEMVs, for a CTA whose first row is row0 (declared before it): the
// matrices it reads (wp, sp: NM of each) and the output it writes (yp, ys: y0 / y1 and their row
// strides). SWIGLU: w1 (matrix 0) and w3 (matrix 1) on the same rows; FLAG_TWO: the row tiles at
// or past n0 belong to matrix 1 (wq_a + wkv in one launch), row0 then counted from its first
// row. A macro, not a function: a forced-inline function compiles the FLAG_TWO choice into
// selects on the uniform datapath instead of the kernels' branch (other SASS for 57 of the
// instantiated kernels); the macro gives them the code of the statements written out.
#define DSV4_FP8_OPERANDS(a, NM, SWIGLU)           \
  const uint8_t* wp[NM];                           \
  const uint8_t* sp[NM];                           \
  void* yp = (a).y0;                               \
  int ys = (a).ys0;                                \
  wp[0] = (a).w0;                                  \
  sp[0] = (a).s0;                                  \
  if constexpr (SWIGLU) {                          \
    wp[1] = (a).w1;                                \
    sp[1] = (a).s1;                                \
  } else if (((a).flags & FLAG_TWO) && row0 >= (a).n0) { \
    row0 -= (a).n0;                                \
    wp[0] = (a).w1;                                \
    sp[0] = (a).s1;                                \
    yp = (a).y1;                                   \
    ys = (a).ys1;                                  \
  }

// One output element of both FP8 GEMVs from its float32 sums v (SWIGLU: v[0] the gate w1, v[1] the
// up w3): fp8_gemm outputs bf16, so the clamped SwiGLU runs on those values; stored at yp[o] as
// float32 (FLAG_Y_F32) or bf16.
template <int NM, bool SWIGLU>
DEV void fp8_store(const Fp8Args& a, const float (&v)[NM], void* yp, size_t o) {
  float y = v[0];
  if constexpr (SWIGLU) {
    float g = bf16_round(v[0]), u = bf16_round(v[1]);
    if (a.limit > 0.0f) {
      u = fminf(fmaxf(u, -a.limit), a.limit);
      g = fminf(g, a.limit);
    }
    y = g / (1.0f + expf(-g)) * u;
  }
  if (a.flags & FLAG_Y_F32)
    static_cast<float*>(yp)[o] = y;
  else
    static_cast<__nv_bfloat16*>(yp)[o] = __float2bfloat16_rn(y);
}

using Fp8Launch = cudaError_t (*)(const Fp8Args&, int, int, cudaStream_t, int);

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

}  // namespace
