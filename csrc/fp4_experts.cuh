// The routed FP4 experts' shared part (fp4_up.cu, fp4_down.cu): the e2m1 decodes, the
// act-quant of a warp's activation slice into f16 MMA operands, one 128-step of the tensor-core
// dot (ExpertStep, ExpertWarp), the scale loads and the shared-memory layout.
//
// The routed FP4 experts of decode tokens on tensor cores (dsv4_fp4_up, dsv4_fp4_down). An e2m1
// code is e4m3's bit pattern shifted down by two (value * 2^-6), so 8 codes become two e4m3
// registers in a few integer ops, then f16 pairs (cvt) for mma.m16n8k16 f16 against the
// act-quantized e4m3 activation (exact in f16); each MMA column holds one 32-wide scale group
// (the activation fragment is zero outside its group), and the per-32 scale is applied in float32
// outside the tensor core. down sums the k experts in slot order through a per-row-tile
// semaphore (deterministic). Variants: fp4_up_stream_kernel (a fixed grid of CTAs streaming
// tiles, the next tile's weights in flight) and fp4_down_all_kernel (all k experts of a row tile
// in one CTA, no semaphore); each gives the bits of its per-tile kernel. Launch configs on the
// Python side: dsv4/kernels/cuda/experts.py.
#pragma once

#include "dsv4_common.cuh"

namespace {

// 8 e2m1 codes (nibble r = element r) -> e4m3 bytes (value * 2^-6): lo = elements 0, 2, 4, 6,
// hi = elements 1, 3, 5, 7 (byte b of each = element 2b / 2b + 1).
DEV void e2m1x8_to_e4m3(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
  hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
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
__host__ __device__ constexpr size_t expert_smem_bytes(int warps, int nm) {
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

// up's output of one row from its gate / up sums (fp4_up.cu, fp4_up_wg.cu): each rounded to bf16
// (fp4_gemm outputs bf16), u clamped to +-limit and g from above (limit 0: none), then SwiGLU
// and the route weight rw.
DEV __nv_bfloat16 up_swiglu(float gs, float us, float limit, float rw) {
  float gv = bf16_round(gs), uv = bf16_round(us);
  if (limit > 0.0f) {
    uv = fminf(fmaxf(uv, -limit), limit);
    gv = fminf(gv, limit);
  }
  return __float2bfloat16_rn(gv / (1.0f + expf(-gv)) * uv * rw);
}

// A per-tile expert kernel's instantiation as one switch key: (spw, e2m1 decode, steps in flight;
// depth 0 = spw). Used by both launchers' case labels, so key and labels cannot drift apart.
constexpr int expert_variant(int spw, int dec, int depth) {
  return (spw * 2 + (dec != 0)) * 10 + (depth > 0 ? depth : spw);
}

}  // namespace
