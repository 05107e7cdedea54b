// The C interface of the dsv4 CUDA C++ library (ctypes: dsv4/kernels/cuda/lib.py): plain
// pointers, sizes, the CUDA stream and a PDL switch. Every launcher returns 0, a cudaError_t, or
// -1 when no kernel is instantiated for the asked config. One file per kernel family implements
// its launchers (fp8_gemv.cu, fp8_mma.cu, bf16_gemv.cu, route.cu, fp4_up.cu, fp4_up_wg.cu,
// fp4_down.cu, topk.cu, allreduce.cu);
// prefetch.cu the L2 prefetch; dsv4_api.cu the version and the error strings.
#pragma once

#include <cstddef>

extern "C" {

// Version of this ABI (checked by the loader).
int dsv4_abi_version();

const char* dsv4_error_string(int code);


// Returns 0 or a cudaError_t; -1: no such config. Grid: blocks CTAs of 32 * warps threads, each
// ROWS = (32 / lc) * rpl rows; K == warps * lc * cpl * 16. nx activation rows (x row t at x + t * xs
// elements, its outputs at y0 / y1 + t * ys0 / ys1).
int dsv4_fp8_gemv(const void* w0, const void* s0, void* y0, const void* w1, const void* s1, void* y1,
                  const void* x, int n0, int K, int ng, float limit, int flags, int swiglu, int lc,
                  int rpl, int cpl, int warps, int blocks, int nx, int xs, int ys0, int ys1,
                  void* stream, int pdl);


// The same GEMV on tensor cores (fp8_mma_kernel): 1 <= nx <= 8 activation rows, act-quantized
// (FLAG_QUANT) or bf16 x (grouped or not); blocks tiles of 16 rows (a CTA each), 32 * warps
// threads; K == warps * 128 * spw. 0 < ctas < blocks: a fixed grid of ctas CTAs streaming the
// tiles, the next weights in flight across them (fp8_mma_stream_kernel; the same bits).
int dsv4_fp8_gemv_mma(const void* w0, const void* s0, void* y0, const void* w1, const void* s1,
                      void* y1, const void* x, int n0, int K, int ng, float limit, int flags,
                      int swiglu, int spw, int warps, int blocks, int nx, int xs, int ys0, int ys1,
                      int ctas, void* stream, int pdl);


// y [nx, N] float32 = x [nx, K] (float32 if x_f32, else bf16) @ w [N, K]^T bf16 on CUDA cores
// (the LM head): 1 <= nx <= 4, K a multiple of 512 up to 8,192; ctas CTAs streaming tiles of 4
// rows. Each product and sum rounded to float32 in one fixed order: the bits depend on neither
// ctas nor nx.
int dsv4_bf16_gemv(const void* w, const void* x, void* y, int N, int K, int nx, int x_f32,
                   int ctas, void* stream, int pdl);


// a [k, I] bf16 from x [D] bf16 and the routing idx [k] int64 / rw [k] float32; grid (I / 16, k),
// D / (128 * spw) warps; dec: the e2m1 decode (0: through e4m3 and cvt, 1: integer ops); depth:
// steps of weights in flight per warp (0: all). ctas > 0: fp4_up_stream_kernel on min(ctas, tiles)
// CTAs instead (dec 0, spw 1 or 2 (4 spills), k <= 64 and at most 4 rows; depth unused). kpr:
// pairs per activation row (pair j reads x row j / kpr).
int dsv4_fp4_up(const void* x, const void* idx, const void* rw, const void* w1, const void* s1,
                const void* w3, const void* s3, void* out, float limit, int I, int D, int k,
                int spw, int dec, int depth, int ctas, int kpr, void* stream, int pdl);


// The same a on Hopper's warpgroup MMA (fp4_up_wg.cu, sm_90a; an sm_90 GPU only, else -1): a
// persistent kernel on min(ctas, k * I / 32) CTAs streaming the checkpoint's bytes by tensor copies
// (w1 / w3 [E, I, D / 2], s1 / s3 [E, I, D / 32]); I % 32 == 0, D % 512 == 0, k / kpr <= 4 rows.
// The FP8 MMA's sums: new bits against dsv4_fp4_up's, the same bits for any ctas and row count.
int dsv4_fp4_up_wg(const void* x, const void* idx, const void* rw, const void* w1, const void* s1,
                   const void* w3, const void* s3, void* out, float limit, int E, int I, int D, int k,
                   int kpr, int ctas, void* stream, int pdl);


// y [D] (float32 or bf16) from a [k, I] bf16; ws [k, D] float32 and cnt [D / 16] int32 (zeros,
// left zero) are the caller's workspace; add [D] bf16 or null. Grid (D / 16, k). all_experts:
// fp4_down_all_kernel instead (grid D / 16, no workspace; k 6 (Flash, Pro), dec 0, the (spw, depth)
// instantiated below). rows > 1 (all_experts only): rows activation rows, a [rows * k, I], idx
// [rows * k], add / y [rows, D]. pdl 2: with PDL, and idx (with the weights and scales it
// addresses) read before the wait: only where idx was written before the kernel this launch waits
// for passed its own wait (the routing, with up between them; DecodeKernels), so that it is
// complete and visible when this kernel starts. post non-null: the block's mHC post of that
// output instead (y bf16 [rows, 4, D] the streams after; res bf16 [rows, 4, D] before; post
// [rows, 4], comb [rows, 4, 4] float32): y[b, j] = bf16(post[b, j] * bf16(sum) + sum_i comb[b, i,
// j] * res[b, i]), the float order of dsv4_allreduce_post's post.
int dsv4_fp4_down(const void* act, const void* idx, const void* w2, const void* s2, const void* add,
                  void* y, void* ws, void* cnt, int D, int I, int k, int y_f32, int spw, int dec,
                  int depth, int all_experts, int rows, const void* res, const float* post,
                  const float* comb, int ctas, void* stream, int pdl);


// The MoE routing of one token (kernels/decode/route.py semantics): logits [E] float32 with bias [E]
// float32 (score routing) or tid2eid [V, k] int64 + ids [1] int64 (hash routing); score 0 softmax,
// 1 sigmoid, 2 sqrt-softplus -> idx [k] int64 ascending, w [k] float32. One CTA per token: rows
// tokens (logits [rows, E], ids [rows], idx / w [rows, k]).
int dsv4_route(const void* logits, const void* bias, const void* tid2eid, const void* ids, int E,
               int k, int score, float route_scale, void* idx, void* w, int rows, void* stream,
               int pdl);


// out [rows, k] int64 = per row, the indices of the k largest of scores [rows, n] bf16
// (1 <= k <= n), see topk_bf16_kernel. One CTA per row.
int dsv4_topk_bf16(const void* scores, int n, int k, void* out, int rows, void* stream, int pdl);


// ---- the one-shot all-reduce over peer memory (allreduce.cu; dsv4/parallel/oneshot.py) ----------

// sizeof(cudaIpcMemHandle_t): the bytes of the handle dsv4_ar_alloc writes.
int dsv4_ar_ipc_handle_bytes();

// Bytes of one rank's buffer for messages of up to cap bytes in CTAs of chunk bytes; 0 when the
// sizes are not supported (chunk a multiple of 512, cap a multiple of chunk).
size_t dsv4_ar_buffer_bytes(int cap, int chunk);

// On `device`: cudaMalloc `bytes` into *ptr, zeroed (synchronously), and its CUDA IPC handle into
// ipc_handle (dsv4_ar_ipc_handle_bytes() bytes). The caller's current device is kept.
int dsv4_ar_alloc(int device, size_t bytes, void** ptr, void* ipc_handle);

// Map another process's buffer (its IPC handle) into this process on `device`; close it with
// dsv4_ar_close, free one's own with dsv4_ar_free.
int dsv4_ar_open(int device, const void* ipc_handle, void** ptr);
int dsv4_ar_close(int device, void* ptr);
int dsv4_ar_free(int device, void* ptr);

// Four host-mapped int status words (zeroed): *host for the CPU, *dev for the kernel.
int dsv4_ar_status_alloc(void** host, void** dev);
int dsv4_ar_status_free(void* host);

// out = the sum over the world ranks of x (nbytes, a multiple of 16, <= cap; dtype 0 float32,
// 1 bf16, 2 fp16; x and out 16-byte aligned, out == x allowed). peers[r]: rank r's buffer as mapped
// here (peers[rank]: this rank's own). Every rank makes the same sequence of calls (sizes and
// order); the sum runs in rank order in float32 (the same bits on every rank). A rank that does
// not arrive within timeout_ns: status = {1, that rank, epoch, CTA} and out = NaN. -1: not
// supported (sizes, world outside 2..8, alignment).
int dsv4_allreduce(void* const* peers, int world, int rank, const void* x, void* out,
                   long long nbytes, int dtype, int cap, int chunk, unsigned long long timeout_ns,
                   void* status, void* stream, int pdl);

// out = hc_post(the sum over the world ranks of x, res, post, comb) in one launch (allreduce.cu's
// header; dsv4.parallel.oneshot.OneShotAllReduce.post): x [rows, D] (nbytes, rows of row_bytes)
// summed as dsv4_allreduce sums it (the same arguments, buffer and epochs) and rounded to the
// dtype, then out[t, j] = dtype(post[t, j] * x[t] + sum_i comb[t, i, j] * res[t, i]) for hc = 4
// streams (res, out [rows, 4, D] of the dtype, apart from each other; post [rows, 4], comb
// [rows, 4, 4] float32); x itself is not written. dtype 0 float32 or 1 bf16. A rank that does not
// arrive: status as dsv4_allreduce's and out = NaN. -1: not supported (sizes, hc, dtype,
// alignment).
int dsv4_allreduce_post(void* const* peers, int world, int rank, const void* x,
                        const void* res, const float* post, const float* comb, void* out,
                        long long nbytes, int row_bytes, int hc, int dtype, int cap, int chunk,
                        unsigned long long timeout_ns, void* status, void* stream, int pdl);

// ---- the two-shot all-reduce of a large message (allreduce.cu; dsv4/parallel/twoshot.py) -------
// Its buffer is allocated, shared, mapped and freed with the dsv4_ar_* calls above.

// Bytes of one rank's buffer for messages of up to cap bytes in chunks of `chunk` bytes on a grid
// of ctas CTAs across world ranks; 0 when not supported (chunk a multiple of 512, cap a multiple
// of chunk, 1 <= ctas <= 1024, world 2..8).
size_t dsv4_ar2_buffer_bytes(int cap, int chunk, int ctas, int world);

// out = the sum over the world ranks of x, as dsv4_allreduce (the same arguments, the same bits):
// chunk k of the message summed by rank k % world and sent to the others, on ctas CTAs (the same
// on every rank and every call of a buffer). A rank that does not arrive: status = {1, that rank,
// epoch, CTA}, or {2, the rank whose sums never came, epoch, CTA} where it was a rank's sums that
// never came (within 2 x timeout_ns), and out = NaN. -1: not supported (sizes, world, alignment).
int dsv4_allreduce2(void* const* peers, int world, int rank, const void* x, void* out,
                    long long nbytes, int dtype, int cap, int chunk, int ctas,
                    unsigned long long timeout_ns, void* status, void* stream, int pdl);

// ---- the L2 prefetch (prefetch.cu; dsv4/backend/fused/prefetch.py) -----------------------------

#define DSV4_PREFETCH_MAX 8

// Bring count <= DSV4_PREFETCH_MAX byte ranges (ptrs[i], bytes[i]; each trimmed to its 16-byte
// aligned inside) into L2: ctas CTAs of `threads` threads, each thread a share of the ranges' pieces
// of `piece` bytes (a multiple of 128), mode 0 as bulk prefetches (sm_90; older GPUs use mode 1),
// 1 as a prefetch per 128-byte line. Writes nothing; a hint. No PDL (a side branch's launch).
int dsv4_l2_prefetch(const void* const* ptrs, const unsigned long long* bytes, int count, int mode,
                     int ctas, int threads, int piece, void* stream);

// A plain streaming read of p[0, nbytes) (16-byte aligned, a multiple of 16): ctas CTAs of
// `threads` threads, each 16-byte word read once; sink [ctas] 16-byte words gets each CTA's XOR
// of its words. The bound a weight-streaming kernel of nbytes meets (dsv4.bench.layer_kernels).
int dsv4_read_bytes(const void* p, unsigned long long nbytes, void* sink, int ctas, int threads,
                    void* stream);

}  // extern "C"
