// The routed FP4 experts' up of decode tokens on Hopper's warpgroup MMA (dsv4_fp4_up_wg, sm_90a):
// what dsv4_fp4_up computes (w1 and w3 of each routed expert, the clamped SwiGLU, the route
// weight) from a persistent kernel, one CTA an SM, whose producer warps stream the checkpoint's
// bytes into shared memory by 2-D tensor copies while its consumer warpgroups compute.
//
// Work. A tile = 32 inter rows of one pair j (expert slot): those rows of w1 and the same rows of
// w3, the 64 rows of one warpgroup MMA (rows 0-31 gate, 32-63 up). A unit = a tile's KC columns
// of K (KC / 2 weight bytes and KC / 32 scale bytes a row): four tensor copies (w1's and w3's
// weights, their scales) into one slot. CTA b takes tiles b, b + G, ...; in each, consumer
// warpgroup w takes units [w CPT / WGS, (w + 1) CPT / WGS) (CPT = D / KC), fed by a producer warp
// of its own through NBUF slots. The warpgroups' sums of a tile meet in shared memory (a named
// barrier of the consumers) and warp 0 adds them in warpgroup order and writes the tile's 32
// outputs, so a tile's bits depend on neither the grid nor the CTA that computes it: a launch of
// T rows gives each pair the bits of its one-row launch.
//
// Arithmetic. e2m1 decodes to e4m3 with bit operations (value * 2^-6) into the A registers; the
// act-quantized activation (per-128 e4m3, dsv4_fp4_up's) is B in shared memory, 1 KB a 128-block:
// wgmma kk (K 32) of a block takes elements 8kk .. 8kk + 7 of each of the block's 4 scale groups
// (lane (g, q) holds group q's), and B's column n carries only group n's (column 4 + n: group n
// of the next activation row, so two rows share one B), so d's column n is one group's dot and
// the per-32 e8m0 scales and the block's activation scale are applied in float32 per block. The
// FP8 MMA does not accumulate in IEEE float32: a group's dot carries up to ~1e-4 of its magnitude
// of error, new bits against dsv4_fp4_up's f16 MMAs and well inside bf16's rounding of g and u.
#include <cudaTypedefs.h>   // PFN_cuTensorMapEncodeTiled

#include "dsv4_api.h"
#include "fp4_experts.cuh"
#include "tma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "fp4_up_wg.cu: build sm_90 as sm_90a (wgmma); dsv4/kernels/cuda/lib.py does"
#endif

namespace {

// warpgroups a CTA, slots a warpgroup, K a unit, inter rows a tile, activation rows at most
constexpr int UPW_WGS = 4, UPW_NBUF = 2, UPW_KC = 512, UPW_TILE = 32, UPW_ROWS = 4;

// fp4_up_wg_kernel's shared memory (byte offsets): xs, the B operands ((rows + 1) / 2 sets of D /
// 128 KB, at 0), the slots [wgs][nbuf] (1 KB aligned), ef [rows][D / 128] (the activation blocks'
// scales times 2^6), red [2][wgs][64] (a tile's sums, by tile parity), the mbarriers (full
// [wgs][nbuf], then empty)
struct UpWgSmem {
  size_t slots, ef, red, bars, total;
  __host__ __device__ UpWgSmem(int D, int rows, int wgs, int nbuf, int kc) {
    const size_t kb = size_t(D) / 128, ub = size_t(64) * (kc / 2 + kc / 32);
    slots = size_t((rows + 1) / 2) * kb * 1024;
    ef = slots + size_t(wgs) * nbuf * ub;
    red = ef + (size_t(rows) * kb * 4 + 15) / 16 * 16;
    bars = red + size_t(2) * wgs * 64 * 4;
    total = bars + size_t(2) * wgs * nbuf * 8;
  }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
DEV void bar_consumers(int n) { asm volatile("bar.sync 1, %0;\n" ::"r"(n) : "memory"); }

// A lane's operands of one 128-block from its 16 bytes of rows g (A) and g + 8 (B): la / lb the
// even elements, ha / hb the odd ones, as e4m3 (word kk feeds wgmma kk).
DEV void decode_block(const uint4& A, const uint4& B, uint32_t (&la)[4], uint32_t (&ha)[4],
                      uint32_t (&lb)[4], uint32_t (&hb)[4]) {
  e2m1x8_to_e4m3(A.x, la[0], ha[0]); e2m1x8_to_e4m3(B.x, lb[0], hb[0]);
  e2m1x8_to_e4m3(A.y, la[1], ha[1]); e2m1x8_to_e4m3(B.y, lb[1], hb[1]);
  e2m1x8_to_e4m3(A.z, la[2], ha[2]); e2m1x8_to_e4m3(B.z, lb[2], hb[2]);
  e2m1x8_to_e4m3(A.w, la[3], ha[3]); e2m1x8_to_e4m3(B.w, lb[3], hb[3]);
}

// t0 / t1 (rows g, g + 8) += a block's column sums d (columns 2 (q & 1), + 1: groups of the
// block) scaled by the rows' group scales sa / sb (zero for the lanes of the other row's columns)
// and f (the activation block's scale times the decode's 2^6)
DEV void scale_add(float& t0, float& t1, const float (&d)[4], uint32_t sa, uint32_t sb, float f,
               int q) {
  const int sh = 16 * (q & 1);
  t0 += (d[0] * e8m0(sa >> sh) + d[1] * e8m0(sa >> (sh + 8))) * f;
  t1 += (d[2] * e8m0(sb >> sh) + d[3] * e8m0(sb >> (sh + 8))) * f;
}

// The activation rows act-quantized into B (the consumers, warp w of nw): xs zeroed, then block
// (r, kb)'s e4m3 values at their columns and ef[r][kb] = 2^(e + 6); then the async proxy's fence
// and the consumers' barrier.
DEV void quant_b(const __nv_bfloat16* x, uint8_t* xs, float* ef, int rows, int D, size_t xs_bytes,
                 int tid, int nct) {
  for (size_t i = tid; i < xs_bytes / 16; i += nct)
    reinterpret_cast<uint4*>(xs)[i] = make_uint4(0u, 0u, 0u, 0u);
  bar_consumers(nct);
  const int KB = D / 128, lane = tid & 31;
  // lane's elements 4 lane .. 4 lane + 3 of a block: group n, wgmma kk, word positions 4 (lane & 1)
  // + i -> byte i0 + (i >> 1) of half (i & 1) of the column's 16 bytes at 4n
  const int n = lane >> 3, kk = (lane >> 1) & 3, i0 = 2 * (lane & 1);
  for (int b = tid >> 5; b < rows * KB; b += nct >> 5) {
    const int r = b / KB, kb = b % KB;
    float v[4];
    load_act<4>(x, size_t(r) * D + size_t(kb) * 128 + lane * 4, false, v);
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, off));
    const int e = block_exponent(amax);
    const float inv = pow2f(-e);
    uint8_t* p =
        xs + (size_t(r >> 1) * KB + kb) * 1024 + kk * 256 + ((r & 1) * 4 + n) * 16 + 4 * n + i0;
    p[0] = uint8_t(f32_to_e4m3(v[0] * inv));
    p[128] = uint8_t(f32_to_e4m3(v[1] * inv));
    p[1] = uint8_t(f32_to_e4m3(v[2] * inv));
    p[129] = uint8_t(f32_to_e4m3(v[3] * inv));
    if (lane == 0) ef[b] = pow2f(e + 6);
  }
  fence_async_smem();
  bar_consumers(nct);
}

// a tile's output row r (< 32) from the warpgroups' sums red [wgs][64] (gate r, up 32 + r) added
// in warpgroup order, then up_swiglu
DEV void up_wg_finish(const float* red, int wgs, int r, float rw, float limit, __nv_bfloat16* o) {
  float gs = 0.0f, us = 0.0f;
  for (int w = 0; w < wgs; ++w) {
    gs += red[w * 64 + r];
    us += red[w * 64 + 32 + r];
  }
  *o = up_swiglu(gs, us, limit, rw);
}
#endif

// a[j, r] as dsv4_fp4_up (x [k / kpr, D] bf16, idx [k], rw [k]); tw1 / ts1 / tw3 / ts3: tensor maps
// of w1's and w3's bytes [E * I, D / 2] (boxes 32 rows x KC / 2) and scales [E * I, D / 32] (32 x
// KC / 32). WGS consumer warpgroups, then WGS producer warps (lane 0 works).
template <int WGS, int NBUF, int KC>
__global__ void __launch_bounds__(WGS * 160, 1) fp4_up_wg_kernel(
    const __nv_bfloat16* __restrict__ x, const int64_t* __restrict__ idx,
    const float* __restrict__ rw,
    const __grid_constant__ CUtensorMap tw1, const __grid_constant__ CUtensorMap ts1,
    const __grid_constant__ CUtensorMap tw3, const __grid_constant__ CUtensorMap ts3,
    __nv_bfloat16* __restrict__ out, float limit, int I, int D, int k, int kpr) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BPU = KC / 128, RS = KC / 2, SR = KC / 32, WB = 64 * RS, UB = WB + 64 * SR;
  constexpr int NCT = WGS * 128;
  extern __shared__ __align__(1024) uint8_t smem[];
  const int KB = D / 128, CPT = D / KC, rows = k / kpr, RT = I / UPW_TILE, tiles = RT * k;
  const UpWgSmem L(D, rows, WGS, NBUF, KC);
  float* ef = reinterpret_cast<float*>(smem + L.ef);
  float* red = reinterpret_cast<float*>(smem + L.red);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L.bars);
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int i = 0; i < WGS * NBUF; ++i) {
      mbar_init(&bars[i], 1);
      mbar_init(&bars[WGS * NBUF + i], 4);   // a slot is free once the warpgroup's 4 warps read it
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  } else if (tid == NCT) {
    tma_prefetch_map(&tw1);
    tma_prefetch_map(&tw3);
    tma_prefetch_map(&ts1);
    tma_prefetch_map(&ts3);
  }
  __syncthreads();
  pdl_wait();   // x, idx and rw come from the kernels before
  const bool producer = tid >= NCT;
  const int wgi = producer ? (tid - NCT) >> 5 : tid >> 7;
  const int ua = wgi * CPT / WGS, ub = (wgi + 1) * CPT / WGS;
  uint64_t* full = bars + wgi * NBUF;
  uint64_t* empty = bars + WGS * NBUF + wgi * NBUF;
  uint8_t* ring = smem + L.slots + size_t(wgi) * NBUF * UB;
  if (producer) {
    if ((tid & 31) == 0) {
      int n = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int row = int(idx[t / RT]) * I + (t % RT) * UPW_TILE;   // past the bank: zeros
        for (int u = ua; u < ub; ++u, ++n) {
          const int s = n % NBUF;
          uint8_t* slot = ring + s * UB;
          mbar_wait(&empty[s], ((n / NBUF) & 1) ^ 1);
          mbar_expect(&full[s], UB);
          tma_2d(slot, &tw1, u * RS, row, &full[s]);
          tma_2d(slot + 32 * RS, &tw3, u * RS, row, &full[s]);
          tma_2d(slot + WB, &ts1, u * SR, row, &full[s]);
          tma_2d(slot + WB + 32 * SR, &ts3, u * SR, row, &full[s]);
        }
      }
    }
    return;
  }
  quant_b(x, smem, ef, rows, D, L.slots, tid, NCT);
  const int lane = tid & 31, warp = (tid >> 5) & 3, g = lane >> 2, q = lane & 3;
  const uint32_t xb0 = smem_u32(smem);
  float d[2][4];
  uint32_t la[2][4], ha[2][4], lb[2][4], hb[2][4], sa[2], sb[2];
  int n = 0, par = 0;   // the warpgroup's units so far (slot, phase); the tile's parity (red)
#pragma unroll 1
  for (int t = blockIdx.x; t < tiles; t += gridDim.x, par ^= 1) {
    const int j = t / RT, xr = j / kpr, h = xr & 1;
    const bool mine = (q >> 1) == h;   // the lane's columns are this row's
    const uint32_t xb = xb0 + uint32_t((xr >> 1) * KB) * 1024u;
    const float* efr = ef + xr * KB;
    float t0 = 0.0f, t1 = 0.0f;
#pragma unroll 1
    for (int u = ua; u < ub; ++u, ++n) {
      const int s = n % NBUF;
      mbar_wait(&full[s], (n / NBUF) & 1);
      const uint8_t* slot = ring + s * UB;
#pragma unroll
      for (int blk = 0; blk < BPU; ++blk) {
        const int p = blk & 1;
        const uint8_t* wr = slot + (warp * 16 + g) * RS + blk * 64 + q * 16;
        const uint4 A = *reinterpret_cast<const uint4*>(wr);
        const uint4 B = *reinterpret_cast<const uint4*>(wr + 8 * RS);
        const uint8_t* sr = slot + WB + (warp * 16 + g) * SR + blk * 4;
        sa[p] = mine ? *reinterpret_cast<const uint32_t*>(sr) : 0u;
        sb[p] = mine ? *reinterpret_cast<const uint32_t*>(sr + 8 * SR) : 0u;
        decode_block(A, B, la[p], ha[p], lb[p], hb[p]);
        if (blk == BPU - 1) {   // the unit is in registers: its slot is free
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[s]);
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)   // the operands computed before the fence
          asm volatile("" : "+r"(la[p][kk]), "+r"(lb[p][kk]), "+r"(ha[p][kk]), "+r"(hb[p][kk])
                       :: "memory");
        asm volatile("" : "+f"(d[p][0]), "+f"(d[p][1]), "+f"(d[p][2]), "+f"(d[p][3])::"memory");
        wg_fence();
        const int kb = u * BPU + blk;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_e4m3_rs(d[p], la[p][kk], lb[p][kk], ha[p][kk], hb[p][kk],
                        wg_desc(xb + kb * 1024 + kk * 256, 128, 256), kk > 0);
        wg_commit();
        if (blk > 0) {   // block blk - 1 retired, block blk in flight
          wg_wait1();
          asm volatile("" : "+f"(d[p ^ 1][0]), "+f"(d[p ^ 1][1]), "+f"(d[p ^ 1][2]),
                       "+f"(d[p ^ 1][3]) :: "memory");
          scale_add(t0, t1, d[p ^ 1], sa[p ^ 1], sb[p ^ 1], efr[kb - 1], q);
        }
      }
      wg_wait0();
      constexpr int pl = (BPU - 1) & 1;
      asm volatile("" : "+f"(d[pl][0]), "+f"(d[pl][1]), "+f"(d[pl][2]), "+f"(d[pl][3])::"memory");
      scale_add(t0, t1, d[pl], sa[pl], sb[pl], efr[u * BPU + BPU - 1], q);
    }
    // the warpgroup's sums of the tile's 64 rows (lane q == 2h: its columns and its pair's) -> red
    const float s0 = t0 + __shfl_xor_sync(FULL, t0, 1), s1 = t1 + __shfl_xor_sync(FULL, t1, 1);
    float* rp = red + par * WGS * 64;
    if (q == 2 * h) {
      rp[wgi * 64 + warp * 16 + g] = s0;
      rp[wgi * 64 + warp * 16 + g + 8] = s1;
    }
    bar_consumers(NCT);   // red[par] complete, its previous use read (warp 0 passed the last barrier)
    if (tid < UPW_TILE)
      up_wg_finish(rp, WGS, tid, rw[j], limit, out + size_t(j) * I + (t % RT) * UPW_TILE + tid);
  }
#endif
}

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

EncodeTiled encode_tiled() {
  static EncodeTiled fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiled>(p);
  }
  return fn;
}

// a 2-D tensor map of the bytes [rows, inner] at base (row-major), boxes of box_rows x box_inner
bool byte_map(CUtensorMap* m, const void* base, uint64_t inner, uint64_t rows, uint32_t box_inner,
              uint32_t box_rows) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  cuuint64_t dims[2] = {inner, rows}, strides[1] = {inner};
  cuuint32_t box[2] = {box_inner, box_rows}, es[2] = {1, 1};
  return encode(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box,
                es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

extern "C" {

// a [k, I] bf16 as dsv4_fp4_up, on an sm_90 GPU (H100 / H200): fp4_up_wg_kernel on min(ctas,
// k * I / 32) CTAs (one an SM). w1 / w3 [E, I, D / 2] and s1 / s3 [E, I, D / 32], contiguous and
// 16-byte aligned; I % 32 == 0, D % 512 == 0, k / kpr <= 4 activation rows, within the shared
// memory (-1 otherwise, or on another GPU).
int dsv4_fp4_up_wg(const void* x, const void* idx, const void* rw, const void* w1, const void* s1,
                   const void* w3, const void* s3, void* out, float limit, int E, int I, int D,
                   int k, int kpr, int ctas, void* stream, int pdl) {
  if (E < 1 || I < UPW_TILE || I % UPW_TILE || D < UPW_KC || D % UPW_KC || k < 1 || kpr < 1 ||
      k % kpr || k / kpr > UPW_ROWS || ctas < 1)
    return -1;
  int dev = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err != cudaSuccess) return err;
  if (major != 9 || minor != 0) return -1;
  const size_t smem = UpWgSmem(D, k / kpr, UPW_WGS, UPW_NBUF, UPW_KC).total;
  if (smem > 227 * 1024) return -1;
  const uint64_t rows = uint64_t(E) * I;
  CUtensorMap m[4];
  if (!byte_map(&m[0], w1, D / 2, rows, UPW_KC / 2, UPW_TILE) ||
      !byte_map(&m[1], s1, D / 32, rows, UPW_KC / 32, UPW_TILE) ||
      !byte_map(&m[2], w3, D / 2, rows, UPW_KC / 2, UPW_TILE) ||
      !byte_map(&m[3], s3, D / 32, rows, UPW_KC / 32, UPW_TILE))
    return cudaErrorInvalidValue;
  auto kern = fp4_up_wg_kernel<UPW_WGS, UPW_NBUF, UPW_KC>;
  err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  const int tiles = k * (I / UPW_TILE);
  return launch(kern, dim3(ctas < tiles ? ctas : tiles), dim3(UPW_WGS * 160), smem,
                static_cast<cudaStream_t>(stream), pdl, static_cast<const __nv_bfloat16*>(x),
                static_cast<const int64_t*>(idx), static_cast<const float*>(rw), m[0], m[1], m[2],
                m[3],
                static_cast<__nv_bfloat16*>(out), limit, I, D, k, kpr);
}

}  // extern "C"
