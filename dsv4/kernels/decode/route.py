"""MoE routing of one decode token in one launch, after the gate GEMV: scores (sqrt-softplus,
sigmoid or softmax), the top-k of scores + bias (or the token's hash row of tid2eid), the weights
normalized and scaled, the k experts sorted by id (the order the reference adds them in).
Replaces ~10 torch launches per layer. Reference: `route_reference` (= dsv4.model.moe.MoE.route + sort).
Test: tests/dsv4/kernels/test_decode_kernels_interp.py (interpreter), tests/dsv4/kernels/test_decode_kernels.py (CUDA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..common import interpreting, launch_args, on_device, pdl_wait
from ..common import pdl as pdl_on
from ..cuda import lib as cuda_cpp

SCORE_FUNCS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _exp(x, ACC: tl.constexpr):
    """exp as torch computes it (libdevice on the GPU; the interpreter's exp is numpy's)."""
    if ACC:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _log1p(t, ACC: tl.constexpr):
    if ACC:
        return libdevice.log1p(t)
    u = 1.0 + t                                 # interpreter: the classic accurate log1p
    return tl.where(u == 1.0, t, tl.log(u) * (t / (u - 1.0)))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, tid2eid_ptr, ids_ptr, w_ptr, idx_ptr, route_scale,
                  E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                  SCORE: tl.constexpr, HASH: tl.constexpr, ACC: tl.constexpr, PDL: tl.constexpr):
    # logits [T, E] f32 -> w [T * K] f32, idx [T * K] int64 (each row's ascending expert ids).
    # A program a row.
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * E
    w_ptr += row * K
    idx_ptr += row * K
    e = tl.arange(0, EP)
    em = e < E
    lg = tl.load(logits_ptr + e, mask=em, other=0.0)
    if SCORE == 0:
        z = tl.where(em, lg, float("-inf"))
        p = _exp(z - tl.max(z, axis=0), ACC)
        s = tl.div_rn(p, tl.sum(p, axis=0))
    elif SCORE == 1:
        s = tl.div_rn(1.0, 1.0 + _exp(-lg, ACC))
    else:   # torch softplus (threshold 20), then sqrt
        s = tl.sqrt_rn(tl.where(lg > 20.0, lg, _log1p(_exp(lg, ACC), ACC)))
    j = tl.arange(0, KP)
    if HASH:
        tok = tl.load(ids_ptr + row).to(tl.int64)
        sel = tl.load(tid2eid_ptr + tok * K + j, mask=j < K, other=EP).to(tl.int32)
    else:   # top-k of the biased scores: k rounds of max, lowest id among equal values
        b = tl.where(em, s + tl.load(bias_ptr + e, mask=em, other=0.0), float("-inf"))
        sel = tl.full([KP], EP, tl.int32)
        for t in tl.static_range(K):
            m = tl.max(b, axis=0)
            a = tl.min(tl.where(b == m, e, EP), axis=0)
            a = tl.minimum(a, E - 1)               # NaN scores: still a valid expert id
            sel = tl.where(j == t, a, sel)
            b = tl.where(e == a, float("-inf"), b)
    sel = tl.minimum(tl.maximum(sel, 0), tl.where(j < K, E - 1, EP))   # padding sorts last
    sel = tl.sort(sel)
    w = tl.sum(tl.where(e[None, :] == sel[:, None], s[None, :], 0.0), axis=1)      # [KP]
    if SCORE != 0:
        w = tl.div_rn(w, tl.sum(tl.where(j < K, w, 0.0), axis=0))
    w = w * route_scale
    tl.store(w_ptr + j, w, mask=j < K)
    tl.store(idx_ptr + j, sel.to(tl.int64), mask=j < K)


def route_decode(logits: torch.Tensor, k: int, score_func: str, route_scale: float, *,
                 bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
                 ids: torch.Tensor | None = None, impl: str = "cuda", strict: bool = False,
                 out: tuple | None = None, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [1, E] float32 (the gate's output) -> (weights [k] f32, experts [k] int64 ascending).
    Score routing (bias [E] f32) or hash routing (tid2eid [V, k] int64 and ids [1]: the token).
    Capture-safe, deterministic; expert ids are clamped into [0, E) (no out-of-range reads).
    One launch: the CUDA C++ kernel (csrc/route.cu: warp-shuffle top-k, the same libdevice
    math) where the CUDA kernels serve the device and E <= 512, k <= 16, else the Triton kernel
    below; impl (the backend's decision: "cuda" or "triton") picks one. T tokens (the speculative
    verify rows, a prefill chunk's rows): logits [T, E], ids [T] -> [T * k] each (token t's k in
    slots t*k ..), each token as its own call, in one launch (a CTA or program a row). out:
    (weights, experts) to write (contiguous float32 / int64)."""
    E = logits.shape[-1]
    T = logits.numel() // E if logits.numel() % E == 0 else 0
    if T < 1 or logits.dtype != torch.float32 or score_func not in SCORE_FUNCS:
        raise ValueError(f"route_decode: logits {tuple(logits.shape)} {logits.dtype}, score "
                         f"{score_func!r}; expected float32 rows and one of {list(SCORE_FUNCS)}")
    hashed = tid2eid is not None
    if hashed == (bias is not None) or (hashed and (ids is None or tid2eid.shape[1] != k
                                                    or ids.numel() != T)):
        raise ValueError("route_decode: pass bias (score routing) or tid2eid [V, k] with ids "
                         "(hash routing, one per token)")
    if out is None:
        w = torch.empty(T * k, dtype=torch.float32, device=logits.device)
        idx = torch.empty(T * k, dtype=torch.int64, device=logits.device)
    else:
        w, idx = out
        if (w.numel() != T * k or idx.numel() != T * k or w.dtype != torch.float32
                or idx.dtype != torch.int64 or not (w.is_contiguous() and idx.is_contiguous())):
            raise ValueError(f"route_decode: out {tuple(w.shape)} {w.dtype} / {tuple(idx.shape)} "
                             f"{idx.dtype}; expected contiguous [{T * k}] float32 / int64")
    tensors = [logits] + [t for t in (bias, tid2eid, ids) if t is not None]
    fits = (E <= 512 and k <= 16 and (bias is None or bias.dtype == torch.float32)
            and (tid2eid is None or (tid2eid.dtype == ids.dtype == torch.int64)))
    if cuda_cpp.pick("route_decode", impl, *tensors, fits=fits, strict=strict):
        with on_device(w):
            cuda_cpp.route(cuda_cpp.lib_for(w.device), logits, bias, tid2eid, ids, k,
                           SCORE_FUNCS[score_func], float(route_scale), idx, w, pdl_on(w, pdl),
                           rows=T)
        return w, idx
    with on_device(w):
        _route_kernel[(T,)](logits.contiguous(), logits if hashed else bias,
                            tid2eid if hashed else idx,
                            ids.reshape(-1).contiguous() if hashed else idx, w, idx,
                            float(route_scale), E=E,
                            EP=triton.next_power_of_2(E), K=k, KP=max(2, triton.next_power_of_2(k)),
                            SCORE=SCORE_FUNCS[score_func], HASH=hashed, ACC=not interpreting(),
                            num_warps=4,
                            **launch_args(w, pdl))
    return w, idx


def route_reference(logits, k, score_func, route_scale, *, bias=None, tid2eid=None, ids=None):
    """The torch path (dsv4.model.moe.MoE.route, then sorted by expert id as MoE.decode does)."""
    lg = logits.reshape(1, -1).float()
    if score_func == "softmax":
        s = lg.softmax(dim=-1)
    elif score_func == "sigmoid":
        s = lg.sigmoid()
    else:
        s = F.softplus(lg).sqrt()
    if tid2eid is not None:
        idx = tid2eid.index_select(0, ids.reshape(-1))
    else:
        idx = (s + bias).topk(k, dim=-1, sorted=False).indices
    w = s.gather(1, idx)
    if score_func != "softmax":
        w = w / w.sum(dim=-1, keepdim=True)
    w = w * route_scale
    idx, order = idx[0].sort()
    return w[0].index_select(0, order), idx
