// What every kernel family of the dsv4 CUDA C++ library shares (csrc/*.cu, built into one library
// by dsv4/kernels/cuda/lib.py, called through the C interface in dsv4_api.h): PDL, streaming
// weight loads, e4m3 / ue8m0 / bf16 conversions, act_quant's block exponent, activation loads,
// the f16 tensor-core MMA with its e4m3 conversions, and the launch helper. Everything here has
// internal linkage (an anonymous namespace): each file gets its own inlined copy.
//
// Row tiles never straddle a 128-row scale block. All reductions run in a fixed order: results
// are deterministic, and the same with and without PDL or CUDA-graph capture.
#pragma once

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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One bulk prefetch of [p, p + size) into L2 (sm_90's copy engine; p 16-byte aligned, size a
// multiple of 16): a hint, nothing read into registers.
DEV void l2_bulk_prefetch(const void* p, unsigned size) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(size) : "memory");
}
#endif

// ue8m0 byte -> 2^(b-127) as float32 (byte 0 -> 0, as the Triton kernels).
DEV float e8m0(uint32_t b) { return __uint_as_float((b & 0xFFu) << 23); }

DEV float pow2f(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }   // -126 <= e <= 127

DEV float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The block's mHC post of one element (dsv4.numerics.mhc.hc_post) for stream j of the 4: v the
// sublayer's output there (already rounded to the activation dtype), r[i] stream i's residual,
// post [4] and comb [4, 4] (comb[i, j] at i * 4 + j) the row's: post[j] * v + sum_i comb[i, j] *
// r[i] in float32, i in order (one float order for every kernel that takes the post).
constexpr int MHC_STREAMS = 4;
DEV float mhc_post_one(float v, const float (&r)[MHC_STREAMS], const float* post,
                       const float* comb, int j) {
  float s = comb[j] * r[0];
#pragma unroll
  for (int i = 1; i < MHC_STREAMS; ++i) s = fmaf(comb[i * MHC_STREAMS + j], r[i], s);
  return fmaf(post[j], v, s);
}

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

// Two float32 -> e4m3 (RNE, saturating: the clamp of act_quant) -> f16x2 (exact): lo in the low half.
DEV uint32_t f32x2_to_e4m3_f16x2(float lo, float hi) {
  uint32_t r;
  asm("{\n.reg .b16 t;\ncvt.rn.satfinite.e4m3x2.f32 t, %2, %1;\ncvt.rn.f16x2.e4m3x2 %0, t;\n}"
      : "=r"(r)
      : "f"(lo), "f"(hi));
  return r;
}

// ---- launching -----------------------------------------------------------------------------------

// Dynamic shared memory above the default 48 KB: opt the kernel in (not a stream operation:
// capture-safe). cudaSuccess, or the error (cleared: not sticky).
inline cudaError_t smem_opt_in(const void* fn, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

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

}  // namespace
