"""The named kernel ops of one device, with its Backend's launch switches applied (PDL, the CUDA
C++ kernels or Triton: `Backend.gemv`, the prefill GEMMs' tuning). The one module that imports the
kernels, each family on first use (so `import dsv4` and the torch path need no Triton). The fused
implementations (dsv4.backend.fused) call them; which sublayer takes them is decided once
(dsv4.backend.bind). The ops run what they are asked to, so tests may call an op on any device
(the interpreter tests of the fused paths on the CPU).
"""
from __future__ import annotations

from functools import cached_property

import torch

from .decision import Backend, resolve


class Ops:
    """The model's kernel ops on one device (`ops.backend`: the decisions)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.pdl = backend.pdl
        self.impl = backend.gemv      # "cuda": the CUDA C++ kernels where a launch fits; "triton"

    @classmethod
    def for_device(cls, device, act: torch.dtype = torch.bfloat16, cfg=None,
                   options=None) -> "Ops":
        """The ops of a component built on its own (tests, tools): resolve(device, act, cfg,
        options); a model passes its own to every component."""
        return cls(resolve(device, act, cfg, options))

    # ---- kernel families, imported on first use -----------------------------------------------
    @cached_property
    def _mhc(self):
        from ..kernels.decode import mhc
        return mhc

    @cached_property
    def _mhc_rows(self):
        from ..kernels.prefill import mhc
        return mhc

    @cached_property
    def _prep(self):
        from ..kernels.decode import attention_prep
        return attention_prep

    @cached_property
    def _attn(self):
        from ..kernels.decode import attention
        return attention

    @cached_property
    def _attn_rows(self):
        from ..kernels.prefill import attention
        return attention

    @cached_property
    def _comp(self):
        from ..kernels.decode import compressor
        return compressor

    @cached_property
    def _comp_rows(self):
        from ..kernels.prefill import compressor
        return compressor

    @cached_property
    def _index(self):
        from ..kernels.decode import indexer
        return indexer

    @cached_property
    def _index_rows(self):
        from ..kernels.prefill import indexer
        return indexer

    @cached_property
    def _fp8(self):
        from ..kernels.decode import fp8_linear
        return fp8_linear

    @cached_property
    def _bf16(self):
        from ..kernels.decode import bf16_linear
        return bf16_linear

    @cached_property
    def _experts(self):
        from ..kernels.decode import fp4_experts
        return fp4_experts

    @cached_property
    def _route(self):
        from ..kernels.decode import route
        return route

    @cached_property
    def _cuda_experts(self):
        from ..kernels.cuda import experts
        return experts

    @cached_property
    def _argmax(self):
        from ..kernels.decode import argmax
        return argmax

    @cached_property
    def _journal(self):
        from ..kernels.decode import journal
        return journal

    @cached_property
    def _gemm(self):
        from ..kernels.prefill import gemm
        return gemm

    @cached_property
    def _moe(self):
        from ..kernels.prefill import moe
        return moe

    @cached_property
    def tuning(self):
        """The prefill GEMMs' switches (DSV4_PREFILL_MMA, _CUBLAS, DSV4_SPLIT_PROGRAMS)."""
        o = self.backend.options
        return self._gemm.Tuning(mma=o.prefill_mma, cublas=o.prefill_cublas,
                                 split_programs=o.split_programs)

    # ---- mHC -----------------------------------------------------------------------------------
    def hc_pre_norm(self, h, fn, scale, base, norm, cfg, branch=None, mixed=None):
        """Decode rows h [T, c, D] -> (RMSNorm(hc_pre(h)) [T, D], post [T, c], comb [T, c, c]);
        mixed: h's partial mixes from hc_post_mix."""
        return self._mhc.hc_pre_norm(h, fn, scale, base, norm, cfg.norm_eps, cfg.hc_eps,
                                     cfg.hc_sinkhorn_iters, branch, pdl=self.pdl, mixed=mixed)

    def hc_post(self, x, res, post, comb, out=None):
        return self._mhc.hc_post(x, res, post, comb, out=out, pdl=self.pdl)

    def hc_post_mix(self, x, res, post, comb, fn):
        """hc_post and the next hc_pre's partial mixes of its output (fn) in one launch -> (the
        streams, hc_pre_norm's mixed); None where the shapes do not fit it."""
        if not self._mhc.post_mix_fits(res.shape[-1], fn.shape[0]):
            return None
        return self._mhc.hc_post_mix(x, res, post, comb, fn, pdl=self.pdl)

    def hc_head_norm(self, h, fn, scale, base, norm, norm_eps, hc_eps):
        return self._mhc.hc_head_norm(h, fn, scale, base, norm, norm_eps, hc_eps, pdl=self.pdl)

    def hc_pre_norm_rows(self, h, fn, scale, base, norm, cfg):
        return self._mhc_rows.hc_pre_norm_rows(h, fn, scale, base, norm, cfg.norm_eps,
                                               cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def hc_post_rows(self, x, res, post, comb):
        return self._mhc_rows.hc_post_rows(x, res, post, comb)

    # ---- attention -----------------------------------------------------------------------------
    def rms_norm_row(self, x, w, eps):
        return self._prep.rms_norm_row(x, w, eps, pdl=self.pdl)

    def rms_norm_rows(self, x, w, eps):
        return self._prep.rms_norm_rows(x, w, eps)

    def attention_prep(self, q, kv, kv_norm, kv_cache, pos, freqs, eps, n_heads, window):
        return self._prep.attention_prep(q, kv, kv_norm, kv_cache, pos, freqs, eps, n_heads,
                                         window, pdl=self.pdl)

    def attention_prep_rows(self, q, kv, kv_norm, pos, freqs, eps, n_heads, decode=False):
        return self._prep.attention_prep_rows(q, kv, kv_norm, pos, freqs, eps, n_heads,
                                              decode=decode, pdl=self.pdl)

    def sparse_attention_decode(self, *args, **kw):
        return self._attn.sparse_attention_decode(*args, pdl=self.pdl, **kw)

    def sparse_attention_decode_rows(self, *args, **kw):
        return self._attn.sparse_attention_decode_rows(*args, pdl=self.pdl, **kw)

    def sparse_attention_rows(self, q, kv, idx, sink, scale, freqs, pos0):
        return self._attn_rows.sparse_attention_rows(q, kv, idx, sink, scale, freqs, pos0)

    # ---- compressor and indexer ----------------------------------------------------------------
    def compressor_decode(self, *args):
        return self._comp.compressor_decode(*args, pdl=self.pdl)

    def compress_rows(self, *args):
        return self._comp_rows.compress_rows(*args)

    def compress_ext(self, *args):
        return self._comp_rows.compress_ext(*args)

    def compress_state(self, *args):
        return self._comp_rows.compress_state(*args)

    def index_query(self, q, pos, freqs, n_heads):
        return self._index.index_query(q, pos, freqs, n_heads, pdl=self.pdl)

    def index_scores(self, q, w, keys, pos, wscale):
        return self._index.index_scores(q, w, keys, pos, wscale, pdl=self.pdl)

    def index_topk(self, scores, k):
        return self._index.index_topk(scores, k, impl=self.impl, pdl=self.pdl)

    def index_scores_rows(self, q, w, keys, pos0):
        return self._index_rows.index_scores_rows(q, w, keys, pos0)

    # ---- GEMVs of decode rows ------------------------------------------------------------------
    def fp8_linear(self, x, w, s, **kw):
        return self._fp8.fp8_linear(x, w, s, impl=self.impl, pdl=self.pdl, **kw)

    def fp8_linear2(self, x, wa, sa, wb, sb):
        return self._fp8.fp8_linear2(x, wa, sa, wb, sb, impl=self.impl, pdl=self.pdl)

    def fp8_swiglu(self, x, w1, s1, w3, s3, limit):
        return self._fp8.fp8_swiglu(x, w1, s1, w3, s3, limit, impl=self.impl, pdl=self.pdl)

    def bf16_linear(self, x, w, **kw):
        """The head-sized ones on the CUDA C++ kernel where the backend has it (the head's
        switch: Options.head_cuda, DSV4_HEAD_CUDA), the rest on Triton."""
        impl = self.impl if self.backend.options.head_cuda else "triton"
        return self._bf16.bf16_linear(x, w, impl=impl, pdl=self.pdl, **kw)

    def bf16_linear_multi(self, x, ws, dtypes):
        return self._bf16.bf16_linear_multi(x, ws, dtypes, pdl=self.pdl)

    # ---- MoE of decode rows --------------------------------------------------------------------
    def route_decode(self, logits, k, score_func, route_scale, **kw):
        return self._route.route_decode(logits, k, score_func, route_scale, impl=self.impl,
                                        pdl=self.pdl, **kw)

    def fp4_experts_up(self, x, idx, w, w1, s1, w3, s3, limit):
        return self._experts.fp4_experts_up(x, idx, w, w1, s1, w3, s3, limit, impl=self.impl,
                                            pdl=self.pdl)

    def fp4_experts_down(self, a, idx, w2, s2, **kw):
        return self._experts.fp4_experts_down(a, idx, w2, s2, impl=self.impl, pdl=self.pdl,
                                              **kw)

    def down_workspace(self, k: int, inter: int, x: torch.Tensor):
        """The routed down kernel's workspace for k experts per row of x (one per layer: no two
        layers share one), or () where the kernel needs none."""
        E, D = self._cuda_experts, x.shape[-1]
        return (E.down_workspace(k, D, x.device, shared=False)
                if E.down_needs_workspace(k, inter, D) else ())

    # ---- a prefill chunk's GEMMs ---------------------------------------------------------------
    def prefill_linear(self, x, w, scale, fmt, **kw):
        return self._gemm.linear(x, w, scale, fmt, tuning=self.tuning, **kw)

    def prefill_moe(self, x, w, idx, bank: tuple, fmt: str, shared: tuple, shared_fmt: str,
                    limit: float):
        """A prefill chunk's routed + shared experts on the grouped GEMMs (kernels.prefill.moe)."""
        return self._moe.grouped_moe(x, w, idx, bank, fmt, shared, shared_fmt, limit,
                                     tuning=self.tuning)

    # ---- the L2 prefetch of weights ----------------------------------------------------------
    def argmax_rows(self, x):
        return self._argmax.argmax_rows(x)

    def l2_prefetch(self, tensors) -> None:
        """Bring the tensors' bytes into L2 on the current stream (csrc/prefetch.cu; a hint:
        nothing is written). Only where the CUDA C++ library serves the device (Backend.prefetch
        is empty elsewhere)."""
        from ..kernels.cuda import lib
        mode, ctas, threads, piece = self.backend.options.prefetch_cfg
        if torch.cuda.get_device_capability(tensors[0].device) < (9, 0):
            mode = 1                  # the bulk prefetch is sm_90's
        lib.l2_prefetch(lib.lib_for(tensors[0].device), tensors, mode=mode, ctas=ctas,
                        threads=threads, piece=piece)

    # ---- speculative decoding ------------------------------------------------------------------
    def accept_greedy(self, logits, drafts, limit, eos, pending, y, keep, record) -> bool:
        """A speculative step's greedy acceptance in one launch (kernels.decode.accept) after the
        rows' argmax of logits [T, V]; False, with nothing computed, where the kernels do not
        serve this device (verify.accept's torch ops then)."""
        if not self.backend.kernels:
            return False
        from ..kernels.decode import accept
        accept.accept_greedy(self.argmax_rows(logits), drafts, limit, eos, pending, y, keep,
                             record)
        return True

    def journal(self, entries):
        """The one-launch journal of a layer's state slots (dsv4.runtime.speculative.journal), or
        None where the kernels do not serve this device (the torch loop then)."""
        return self._journal.JournalKernel(entries) if self.backend.kernels else None
