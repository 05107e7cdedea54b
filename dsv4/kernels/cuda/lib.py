"""The CUDA C++ decode kernels (`csrc/`: FP8 GEMV on CUDA cores and on tensor cores, the MoE
routing, the routed FP4 experts on tensor cores, the indexer's top-k, the one-shot and two-shot
all-reduces over peer memory of dsv4.parallel, the L2 prefetch of weights; the C interface in
csrc/dsv4_api.h) through ctypes. Every source is built into one library, once per set of sources,
GPU architecture and nvcc, with `nvcc` (about a minute) into `~/.cache/dsv4/cuda/`, or taken from a
prebuilt .so (DSV4_CUDA_LIB, read by dsv4.backend). Where neither works (no nvcc, GPU older than
sm_89, DSV4_CUDA_KERNELS=0: the backend decides) the Triton kernels serve instead; `status()` says
why. Launches go to the tensors' device and current stream, with programmatic dependent launch
when asked (and the device has it), and are capture-safe.
Tests: `python -m pytest tests/dsv4/kernels/test_cuda_kernels.py`.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

ABI = 16
CSRC = Path(__file__).resolve().parents[3] / "csrc"
# the kernel families and the C interface, compiled into one library (the headers are in the key)
SOURCES = ("fp8_gemv.cu", "fp8_mma.cu", "bf16_gemv.cu", "route.cu", "fp4_up.cu", "fp4_up_wg.cu",
           "fp4_down.cu", "topk.cu", "allreduce.cu", "prefetch.cu", "dsv4_api.cu")
HEADERS = ("dsv4_common.cuh", "fp8.cuh", "fp4_experts.cuh", "tma.cuh", "dsv4_api.h")
MIN_CAPABILITY = (8, 9)        # cvt e4m3x2 (sm_89); PDL needs sm_90 and is compiled out below

FLAG_X_F32, FLAG_Y_F32, FLAG_QUANT, FLAG_TWO = 1, 2, 4, 8

_lock = threading.Lock()
_libs: dict[str, object] = {}      # arch -> CDLL, or the reason it is unavailable (str)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv4" / "cuda"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


def build(arch: str, out: Path | None = None, nvcc: str | None = None) -> Path:
    """Compile csrc/ (SOURCES, including HEADERS) for sm_`arch` ("90": as sm_90a, for the warpgroup
    MMA) into one shared library; returns its path. Raises RuntimeError with the compiler's
    message on failure."""
    nvcc = nvcc or _nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    files = [CSRC / f for f in SOURCES + HEADERS]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise RuntimeError(f"CUDA sources {missing} not found (install the repository with pip -e)")
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for f in files:                     # every source and header, by name and content
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    key = hashlib.sha256(h.digest() + arch.encode() + ver.encode()).hexdigest()[:16]
    out = out or cache_dir() / key / "libdsv4_kernels.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    sm = arch + "a" if arch == "90" else arch         # sm_90a: Hopper's wgmma (fp4_up_wg.cu)
    print(f"dsv4: building the CUDA kernels for sm_{sm} (once) into {out.parent}",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
               f"-gencode=arch=compute_{sm},code=sm_{sm}", "-o", str(so),
               *(str(CSRC / f) for f in SOURCES)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{(r.stderr or r.stdout)[-3000:]}")
        os.replace(so, out)        # atomic: concurrent builders agree on the result
    return out


def _declare(lib) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.dsv4_abi_version.restype = i
    lib.dsv4_error_string.restype = ctypes.c_char_p
    lib.dsv4_error_string.argtypes = [i]
    lib.dsv4_fp8_gemv.restype = i
    lib.dsv4_fp8_gemv.argtypes = [p, p, p, p, p, p, p, i, i, i, f, i, i, i, i, i, i, i, i, i, i, i,
                                   p, i]
    lib.dsv4_fp8_gemv_mma.restype = i
    lib.dsv4_fp8_gemv_mma.argtypes = [p, p, p, p, p, p, p, i, i, i, f, i, i, i, i, i, i, i, i, i,
                                       i, p, i]
    lib.dsv4_bf16_gemv.restype = i
    lib.dsv4_bf16_gemv.argtypes = [p, p, p, i, i, i, i, i, p, i]
    lib.dsv4_fp4_up.restype = i
    lib.dsv4_fp4_up.argtypes = [p, p, p, p, p, p, p, p, f, i, i, i, i, i, i, i, i, p, i]
    lib.dsv4_fp4_up_wg.restype = i
    lib.dsv4_fp4_up_wg.argtypes = [p, p, p, p, p, p, p, p, f, i, i, i, i, i, i, p, i]
    lib.dsv4_route.restype = i
    lib.dsv4_route.argtypes = [p, p, p, p, i, i, i, f, p, p, i, p, i]
    lib.dsv4_topk_bf16.restype = i
    lib.dsv4_topk_bf16.argtypes = [p, i, i, p, i, p, i]
    lib.dsv4_fp4_down.restype = i
    lib.dsv4_fp4_down.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, i, i, i, i, i, p, p, p, i,
                                  p, i]
    # the all-reduces (allreduce.cu; their host side: dsv4/parallel/oneshot.py, twoshot.py)
    pp = ctypes.POINTER(p)
    lib.dsv4_ar_ipc_handle_bytes.restype = i
    lib.dsv4_ar_buffer_bytes.restype = ctypes.c_size_t
    lib.dsv4_ar_buffer_bytes.argtypes = [i, i]
    lib.dsv4_ar_alloc.restype = i
    lib.dsv4_ar_alloc.argtypes = [i, ctypes.c_size_t, pp, p]
    lib.dsv4_ar_open.restype = i
    lib.dsv4_ar_open.argtypes = [i, p, pp]
    for fn in (lib.dsv4_ar_close, lib.dsv4_ar_free):
        fn.restype = i
        fn.argtypes = [i, p]
    lib.dsv4_ar_status_alloc.restype = i
    lib.dsv4_ar_status_alloc.argtypes = [pp, pp]
    lib.dsv4_ar_status_free.restype = i
    lib.dsv4_ar_status_free.argtypes = [p]
    lib.dsv4_allreduce.restype = i
    lib.dsv4_allreduce.argtypes = [pp, i, i, p, p, ctypes.c_longlong, i, i, i, ctypes.c_ulonglong,
                                   p, p, i]
    lib.dsv4_allreduce_post.restype = i
    lib.dsv4_allreduce_post.argtypes = [pp, i, i, p, p, p, p, p, ctypes.c_longlong, i, i, i, i, i,
                                        ctypes.c_ulonglong, p, p, i]
    lib.dsv4_ar2_buffer_bytes.restype = ctypes.c_size_t
    lib.dsv4_ar2_buffer_bytes.argtypes = [i, i, i, i]
    lib.dsv4_allreduce2.restype = i
    lib.dsv4_allreduce2.argtypes = [pp, i, i, p, p, ctypes.c_longlong, i, i, i, i,
                                    ctypes.c_ulonglong, p, p, i]
    lib.dsv4_l2_prefetch.restype = i
    lib.dsv4_l2_prefetch.argtypes = [pp, ctypes.POINTER(ctypes.c_ulonglong), i, i, i, i, i, p]
    lib.dsv4_read_bytes.restype = i
    lib.dsv4_read_bytes.argtypes = [p, ctypes.c_ulonglong, p, i, i, p]


def _load(arch: str, path: str | None):
    if path:
        if not Path(path).exists():
            return f"DSV4_CUDA_LIB={path} does not exist"
    else:
        try:
            path = str(build(arch))
        except RuntimeError as e:
            return f"build failed: {e}"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return f"cannot load {path}: {e}"
    # the version first: a library of another ABI may lack the entry points _declare names
    lib.dsv4_abi_version.restype = ctypes.c_int
    if lib.dsv4_abi_version() != ABI:
        return f"{path}: ABI {lib.dsv4_abi_version()}, expected {ABI} (rebuild)"
    _declare(lib)
    return lib


def lib_for(device: torch.device):
    """The loaded library for `device`'s architecture, or None (see status())."""
    got = _get(device)
    return None if isinstance(got, str) else got


def _get(device: torch.device, path: str | None = None):
    """The library of device's architecture (loaded on first use: from `path`, a prebuilt .so,
    or built), or why not (str). Later calls return the first load's result."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"compute capability {cap} < {MIN_CAPABILITY}"
    arch = f"{cap[0]}{cap[1]}"
    if arch not in _libs:
        with _lock:
            if arch not in _libs:
                _libs[arch] = _load(arch, path)
                if isinstance(_libs[arch], str):
                    print(f"dsv4: CUDA C++ kernels unavailable ({_libs[arch].splitlines()[0]}); "
                          f"using the Triton kernels", file=sys.stderr)
    return _libs[arch]


def status(device, path: str | None = None) -> str:
    """'ok' when the CUDA C++ kernels serve `device`, else why not. path: a prebuilt library to
    load (DSV4_CUDA_LIB), for the first load of the device's architecture."""
    got = _get(torch.device(device), path)
    return got if isinstance(got, str) else "ok"


def usable(*tensors: torch.Tensor) -> bool:
    """The CUDA kernels may take these tensors: the library is there for their device, and each is
    contiguous and 16-byte aligned."""
    t0 = tensors[0]
    if not t0.is_cuda or lib_for(t0.device) is None:
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


IMPLS = ("cuda", "triton")   # who serves an op that has both (dsv4.backend: Backend.gemv)


def pick(what: str, impl: str, *tensors: torch.Tensor, fits: bool = True,
         declined: bool = False, strict: bool = False) -> bool:
    """Whether one launch of `what` takes the CUDA C++ kernel (else the Triton one). impl: the
    backend's decision for the device, "cuda" (the CUDA C++ library serves it) or "triton". Not
    when impl is "triton" or the call is `declined` (an option only Triton has); with "cuda", yes
    when the kernel `fits` this launch and is usable(*tensors), else Triton, unless `strict` (a
    CUDA launch config was given, or a test insists): then a ValueError naming status()."""
    if impl not in IMPLS:
        raise ValueError(f"{what}: impl = {impl!r}; expected one of {IMPLS}")
    if impl == "triton" or declined:
        return False
    if fits and usable(*tensors):
        return True
    if strict:
        raise ValueError(f"{what}: the CUDA kernel is unavailable for these tensors "
                         f"({status(tensors[0].device)})")
    return False


def _check(err: int, what: str, lib) -> None:
    if err == -1:
        raise ValueError(f"{what}: launch configuration not supported by the CUDA kernels")
    if err != 0:
        raise RuntimeError(f"{what}: CUDA error {err} ({lib.dsv4_error_string(err).decode()})")


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def fp8_gemv(lib, x, w0, s0, y0, w1, s1, y1, *, n0: int, rows: int, K: int, ng: int,
             limit: float, flags: int, swiglu: bool, cfg, pdl: bool, nx: int = 1, xs: int = 0,
             ys0: int = 0, ys1: int = 0) -> None:
    """dsv4_fp8_gemv (see csrc): rows / cfg.rows CTAs; nx activation rows with element strides
    xs (x), ys0 / ys1 (the outputs)."""
    err = lib.dsv4_fp8_gemv(w0.data_ptr(), s0.data_ptr(), y0.data_ptr(), w1.data_ptr(),
                            s1.data_ptr(), y1.data_ptr(), x.data_ptr(), n0, K, ng, limit, flags,
                            int(swiglu), cfg.lc, cfg.rpl, cfg.cpl, cfg.warps, rows // cfg.rows,
                            nx, xs, ys0, ys1, _stream(y0), int(pdl))
    _check(err, "fp8 GEMV (CUDA)", lib)


def fp8_gemv_mma(lib, x, w0, s0, y0, w1, s1, y1, *, n0: int, rows: int, K: int, ng: int,
                 limit: float, flags: int, swiglu: bool, cfg, pdl: bool, nx: int = 1,
                 xs: int = 0, ys0: int = 0, ys1: int = 0) -> None:
    """dsv4_fp8_gemv_mma (see csrc): the tensor-core GEMV, rows / 16 tiles (a CTA each, or
    cfg.ctas CTAs streaming them), nx <= 8 rows."""
    err = lib.dsv4_fp8_gemv_mma(w0.data_ptr(), s0.data_ptr(), y0.data_ptr(), w1.data_ptr(),
                                s1.data_ptr(), y1.data_ptr(), x.data_ptr(), n0, K, ng, limit,
                                flags, int(swiglu), cfg.spw, cfg.warps, rows // cfg.rows, nx, xs,
                                ys0, ys1, cfg.ctas, _stream(y0), int(pdl))
    _check(err, "fp8 GEMV (CUDA, tensor cores)", lib)


def bf16_gemv(lib, x, w, y, *, nx: int, ctas: int, pdl: bool) -> None:
    """dsv4_bf16_gemv (see csrc): y [nx, N] float32 = x [nx, K] (float32 or bf16) @ w^T, on ctas
    CTAs."""
    N, K = w.shape
    err = lib.dsv4_bf16_gemv(w.data_ptr(), x.data_ptr(), y.data_ptr(), N, K, nx,
                             int(x.dtype == torch.float32), ctas, _stream(y), int(pdl))
    _check(err, "bf16 GEMV (CUDA)", lib)


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def fp4_up(lib, x, idx, rw, w1, s1, w3, s3, out, limit: float, I: int, D: int, k: int,
           cfg, pdl: bool, kpr: int | None = None) -> None:
    """dsv4_fp4_up: k pairs, kpr of them per activation row (default k: one row)."""
    err = lib.dsv4_fp4_up(x.data_ptr(), idx.data_ptr(), rw.data_ptr(), w1.data_ptr(),
                          s1.data_ptr(), w3.data_ptr(), s3.data_ptr(), out.data_ptr(), limit, I, D,
                          k, cfg.spw, cfg.dec, cfg.depth, cfg.ctas, kpr or k, _stream(out),
                          int(pdl))
    _check(err, "fp4 experts up (CUDA)", lib)


def fp4_up_wg(lib, x, idx, rw, w1, s1, w3, s3, out, limit: float, E: int, I: int, D: int,
              k: int, kpr: int, ctas: int, pdl: bool) -> None:
    """dsv4_fp4_up_wg: the up on Hopper's warpgroup MMA, k pairs, kpr of them per activation row,
    on min(ctas, k * I / 32) CTAs."""
    err = lib.dsv4_fp4_up_wg(x.data_ptr(), idx.data_ptr(), rw.data_ptr(), w1.data_ptr(),
                             s1.data_ptr(), w3.data_ptr(), s3.data_ptr(), out.data_ptr(), limit, E,
                             I, D, k, kpr, ctas, _stream(out), int(pdl))
    _check(err, "fp4 experts up (CUDA, wgmma)", lib)


def route(lib, logits, bias, tid2eid, ids, k: int, score: int, route_scale: float, idx, w,
          pdl: bool, rows: int = 1) -> None:
    """dsv4_route: rows tokens (logits [rows, E], idx / w [rows * k])."""
    err = lib.dsv4_route(logits.data_ptr(), _ptr(bias), _ptr(tid2eid), _ptr(ids),
                         logits.numel() // rows, k, score, route_scale, idx.data_ptr(),
                         w.data_ptr(), rows, _stream(w), int(pdl))
    _check(err, "routing (CUDA)", lib)


def topk_bf16(lib, scores, k: int, out, pdl: bool) -> None:
    """Per row of scores [rows, n] bf16 (contiguous): the k best entries -> out [rows, k] int64."""
    rows, n = scores.shape
    err = lib.dsv4_topk_bf16(scores.data_ptr(), n, k, out.data_ptr(), rows, _stream(out), int(pdl))
    _check(err, "top-k (CUDA)", lib)


def fp4_down(lib, a, idx, w2, s2, add, y, ws, cnt, D: int, I: int, k: int, y_f32: bool, cfg,
             pdl: int, rows: int = 1, post: tuple | None = None) -> None:
    """dsv4_fp4_down; ws / cnt None (unused) for cfg.all_experts; rows > 1: all_experts only;
    cfg.ctas > 0 (with all_experts): the ring kernel on that many CTAs, depth slots.
    pdl: 0 off, 1 on, 2 on with idx and its weights read before the wait (dsv4_api.h says when).
    post: (res, post, comb) of the block's mHC post (y then the streams [rows, 4, D] bf16)."""
    res, pw, comb = post or (None, None, None)
    err = lib.dsv4_fp4_down(a.data_ptr(), idx.data_ptr(), w2.data_ptr(), s2.data_ptr(),
                            _ptr(add), y.data_ptr(), _ptr(ws), _ptr(cnt), D, I, k, int(y_f32),
                            cfg.spw, cfg.dec, cfg.depth, int(cfg.all_experts), rows, _ptr(res),
                            _ptr(pw), _ptr(comb), cfg.ctas, _stream(y), int(pdl))   # pdl 0, 1, 2
    _check(err, "fp4 experts down (CUDA)", lib)


AR_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # dsv4_allreduce's dtype


def allreduce(lib, peers, world: int, rank: int, x, out, cap: int, chunk: int, timeout_ns: int,
              status: int, pdl: bool) -> None:
    """dsv4_allreduce (see csrc/allreduce.cu): out = the sum over the ranks of x (contiguous,
    16-byte aligned, x.nbytes a multiple of 16 and <= cap); peers: a ctypes array of the world's
    buffer pointers; status: the device address of the host-mapped status words."""
    err = lib.dsv4_allreduce(peers, world, rank, x.data_ptr(), out.data_ptr(),
                             x.numel() * x.element_size(), AR_DTYPES[x.dtype], cap, chunk,
                             timeout_ns, status, _stream(out), int(pdl))
    _check(err, "all-reduce (CUDA, one-shot)", lib)


def allreduce_post(lib, peers, world: int, rank: int, x, res, post, comb, out, cap: int,
                   chunk: int, timeout_ns: int, status: int, pdl: bool) -> None:
    """dsv4_allreduce_post (see csrc/allreduce.cu): out = hc_post(the sum over the ranks of x,
    res, post, comb) in one launch; x [rows, D] (float32 / bf16, contiguous, 16-byte aligned,
    x.nbytes <= cap), res and out [rows, 4, D] of x's dtype, post [rows, 4] and comb [rows, 4, 4]
    float32, all contiguous; x is not written."""
    err = lib.dsv4_allreduce_post(peers, world, rank, x.data_ptr(), res.data_ptr(),
                                  post.data_ptr(), comb.data_ptr(), out.data_ptr(),
                                  x.numel() * x.element_size(), x.shape[-1] * x.element_size(),
                                  res.shape[-2], AR_DTYPES[x.dtype], cap, chunk, timeout_ns,
                                  status, _stream(out), int(pdl))
    _check(err, "all-reduce + mHC post (CUDA, one-shot)", lib)


def allreduce2(lib, peers, world: int, rank: int, x, out, cap: int, chunk: int, ctas: int,
               timeout_ns: int, status: int, pdl: bool) -> None:
    """dsv4_allreduce2 (see csrc/allreduce.cu, the two-shot): as allreduce(), the message's chunks
    of `chunk` bytes summed by their owners (rank chunk % world) on a fixed grid of ctas CTAs."""
    err = lib.dsv4_allreduce2(peers, world, rank, x.data_ptr(), out.data_ptr(),
                              x.numel() * x.element_size(), AR_DTYPES[x.dtype], cap, chunk, ctas,
                              timeout_ns, status, _stream(out), int(pdl))
    _check(err, "all-reduce (CUDA, two-shot)", lib)


PREFETCH_MAX = 8   # ranges per dsv4_l2_prefetch launch (DSV4_PREFETCH_MAX)


def l2_prefetch(lib, tensors, *, mode: int, ctas: int, threads: int, piece: int) -> None:
    """dsv4_l2_prefetch of the tensors' bytes (each contiguous, on one device) on the current
    stream of their device, in launches of PREFETCH_MAX ranges: a hint, nothing is written."""
    for i in range(0, len(tensors), PREFETCH_MAX):
        part = tensors[i:i + PREFETCH_MAX]
        ptrs = (ctypes.c_void_p * len(part))(*(t.data_ptr() for t in part))
        nbytes = (ctypes.c_ulonglong * len(part))(*(t.numel() * t.element_size() for t in part))
        err = lib.dsv4_l2_prefetch(ptrs, nbytes, len(part), mode, ctas, threads, piece,
                                   _stream(part[0]))
        _check(err, "L2 prefetch (CUDA)", lib)


def read_bytes(lib, x: torch.Tensor, sink: torch.Tensor, ctas: int, threads: int) -> None:
    """dsv4_read_bytes: a plain streaming read of x's bytes (contiguous, 16-byte aligned, a
    multiple of 16) on the current stream of its device; sink (>= ctas * 16 bytes, contiguous)
    gets each CTA's XOR of its 16-byte words."""
    if not x.is_contiguous() or not sink.is_contiguous() or sink.numel() * sink.element_size() \
            < 16 * ctas:
        raise ValueError(f"read_bytes: x and sink contiguous, sink of at least {16 * ctas} bytes")
    err = lib.dsv4_read_bytes(x.data_ptr(), x.numel() * x.element_size(), sink.data_ptr(), ctas,
                              threads, _stream(x))
    _check(err, "read (CUDA)", lib)


def main(argv=None) -> int:
    """`python -m dsv4.kernels.cuda.lib [ARCH] [OUT]`: build the library (default: this GPU's arch,
    into the cache) and print its path."""
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        arch = argv[0]
    elif torch.cuda.is_available():
        arch = "".join(map(str, torch.cuda.get_device_capability()))
    else:
        arch = "90"
    print(build(arch, Path(argv[1]) if len(argv) > 1 else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
