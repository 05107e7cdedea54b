"""The decision: which implementation serves each op of the model on one device -- the CUDA C++
kernels (csrc/, dsv4.kernels.cuda), the Triton kernels (dsv4.kernels.decode / .prefill), Triton's
interpreter (the prefill kernels on the CPU, for tests) or the torch reference -- made once, when
a model is built, from the device, the activation dtype, the checkpoint's formats and shapes and
the runtime switches (dsv4.backend.options). `Backend.table()` reports it per op, in the words
the decision itself uses ("cuda", "triton", "interpret", "torch"): `dsv4 decode --json` `backend`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .options import BRANCHES, ENV, SPLIT_PROGRAMS, Options

__all__ = ["BRANCHES", "ENV", "SPLIT_PROGRAMS", "Backend", "Options", "resolve"]


@dataclass(frozen=True)
class Backend:
    """The implementation of every op on one device for one model, resolved once (`resolve`).

    Device facts: `kernels` (the Triton kernels may run here: CUDA, triton importable,
    DSV4_KERNELS != 0), `prefill` (the multi-row kernels of a prefill chunk: "triton",
    "interpret" or "torch"), `gemv` (who serves the ops that have a CUDA C++ kernel -- the FP8
    GEMVs, the routed experts, the routing, the indexer's top-k: "cuda" or "triton"; a launch a
    CUDA kernel does not fit takes Triton), `cuda_status` ("ok", or why the CUDA C++ library does
    not serve this device), the launch switches. Model decisions (from the config; False without
    one): which sublayer runs its fused kernels. Per-call conditions (a decode call's row count, a
    GEMM's dtypes, a launch a CUDA kernel does not fit) stay with the op."""
    device: torch.device
    act: torch.dtype
    options: Options = field(default_factory=Options)
    kernels: bool = False
    prefill: str = "torch"
    gemv: str = "triton"
    cuda_status: str = "not a CUDA device"
    pdl: bool = False                    # launches with PDL (each also needs sm_90)
    branches: frozenset = frozenset()    # captured parallel branches that are on
    prefetch: frozenset = frozenset()    # captured L2 prefetch points that are on (CUDA C++ lib)
    gemm_bk: int = 0                     # the prefill GEMM's K step (0: no prefill GEMM)
    mhc_decode: bool = False             # fused mHC of decode rows (and the head's hc_head)
    mhc_prefill: bool = False            # the mHC rows kernels of a prefill chunk
    fused_decode: bool = False           # attention, compressor, indexer of a decode row
    moe_decode: bool = False             # routing + routed FP4 experts kernels of decode rows
    moe_prefill: bool = False            # the grouped expert GEMMs of a prefill chunk
    wo_a_gemv: bool = False              # the grouped wo_a of decode rows (FP8 GEMV)
    wo_a_prefill: bool = False           # the grouped wo_a of a prefill chunk (prefill GEMM)
    formats: tuple = ()                  # (linear format, expert format) of the checkpoint

    @property
    def rows(self) -> bool:
        """The prefill chunk takes the multi-row kernels (Triton or its interpreter)."""
        return self.prefill != "torch"

    @property
    def gemv_act(self) -> bool:
        """The GEMV kernels serve decode rows (bf16 activations where the kernels run)."""
        return self.kernels and self.act == torch.bfloat16

    def gemm_fits(self, fmt: str, in_features: int) -> bool:
        """The prefill GEMM serves a weight of this format and input size for a chunk's rows."""
        quantized = fmt in ("fp8", "fp4")
        return (self.rows and fmt in ("bf16", "fp8", "fp4")
                and in_features % (128 if quantized else self.gemm_bk) == 0)

    def table(self) -> dict[str, str]:
        """op -> the implementation that serves it ("cuda", "triton", "interpret", "torch"; "-":
        no such weights): the decode and prefill ops, the speculative journal, and the launch
        switches and CUDA C++ status of the device."""
        off, k = "torch", self.gemv
        lin = self.formats[0] if self.formats else "fp8"
        dec = "triton" if self.fused_decode else off
        return {
            "decode.mhc": "triton" if self.mhc_decode else off,
            "decode.attention": dec,                # q/kv prep, sparse attention, inverse RoPE
            "decode.compressor": dec,
            "decode.indexer": dec,                  # query, scores
            "decode.indexer_topk": ("cuda" if k == "cuda" else off) if self.fused_decode else off,
            "decode.linear_fp8": (k if lin == "fp8" else "-") if self.gemv_act else off,
            "decode.linear_bf16": "triton" if self.gemv_act else off,
            "decode.wo_a": k if self.wo_a_gemv else off,
            "decode.moe_route": k if self.moe_decode else off,
            "decode.moe_experts": k if self.moe_decode else off,
            "decode.moe_shared": (k if lin == "fp8" else off) if self.moe_decode else off,
            # the head's GEMV: the CUDA C++ kernel where the library serves the device and the
            # switch is on (DSV4_HEAD_CUDA; kernels/cuda/bf16.py), else Triton
            "decode.head": (k if self.options.head_cuda else "triton") if self.kernels else off,
            "prefill.mhc": self.prefill if self.mhc_prefill else off,
            "prefill.attention": self.prefill,      # prep rows, sparse attention rows
            "prefill.compressor": self.prefill,
            "prefill.indexer": self.prefill,
            "prefill.linear": self.prefill,         # where a weight fits (gemm_fits)
            "prefill.wo_a": self.prefill if self.wo_a_prefill else off,
            "prefill.moe": self.prefill if self.moe_prefill else off,
            "prefill.moe_route": k if self.rows else off,   # the decode rows' routing kernel
            "speculative.journal": "triton" if self.kernels else off,
            "speculative.accept": "triton" if self.kernels else off,   # greedy: one launch
            "launch.pdl": "on" if self.pdl else "off",
            "launch.branches": ",".join(sorted(self.branches)) or "none",
            "launch.prefetch": ",".join(sorted(self.prefetch)) or "none",
            "cuda_cpp": self.cuda_status,
        }


def _triton_importable() -> bool:
    from ..kernels import triton_importable
    return triton_importable()


def resolve(device, act: torch.dtype = torch.bfloat16, cfg=None,
            options: Options | None = None) -> Backend:
    """The backend of one device: the device and the switches decide which kernels may run; the
    config (shapes, weight formats) and the activation dtype decide which sublayers take them.
    options: None reads the environment (Options.from_env). Loads the CUDA C++ library of the
    device when it may serve (a build on first use: dsv4.kernels.cuda.lib)."""
    device = torch.device(device)
    opts = Options.from_env() if options is None else options
    cuda_dev = device.type == "cuda" and torch.cuda.is_available()
    kernels = opts.kernels != "0" and cuda_dev and _triton_importable()
    bf16 = act == torch.bfloat16
    prefill = "torch"
    if bf16 and opts.prefill_kernels:
        if kernels:
            prefill = "triton"
        elif (device.type == "cpu" and opts.kernels == "interpret" and opts.interpret
              and _triton_importable()):
            prefill = "interpret"
    status = "not a CUDA device" if not cuda_dev else "DSV4_KERNELS=0" if not kernels else \
        "DSV4_CUDA_KERNELS=0" if not opts.cuda_kernels else _cuda_status(device, opts.cuda_lib)
    be = Backend(device=device, act=act, options=opts, kernels=kernels, prefill=prefill,
                 gemv="cuda" if status == "ok" else "triton", cuda_status=status,
                 pdl=opts.pdl and kernels, branches=opts.overlap if cuda_dev else frozenset(),
                 prefetch=opts.prefetch if status == "ok" else frozenset())
    if prefill != "torch":
        from ..kernels.prefill.gemm import BK
        be = replace(be, gemm_bk=BK)
    return be if cfg is None else _model_decisions(be, cfg)


def _cuda_status(device: torch.device, path: str | None) -> str:
    from ..kernels.cuda import lib
    return lib.status(device, path)


def cuda_status(device, options: Options | None = None) -> str:
    """'ok' when the CUDA C++ kernels serve `device`, else why not, as resolve() decides it: the
    library's first load of the device's architecture takes the prebuilt one options.cuda_lib
    names (DSV4_CUDA_LIB; None: the environment's), else builds it. For the entry points that
    load the library before (or without) a backend: a load without the path built it again."""
    opts = Options.from_env() if options is None else options
    return _cuda_status(torch.device(device), opts.cuda_lib)


def _model_decisions(be: Backend, cfg) -> Backend:
    """The sublayers' choices for this config: shapes the kernels need, weight formats."""
    bf16 = be.act == torch.bfloat16
    lin = "fp8" if cfg.quantized else "bf16"
    cd = cfg.hc_mult * cfg.dim
    group_k = cfg.n_heads * cfg.head_dim // cfg.o_groups
    moe_prefill = False
    if be.rows:
        from ..kernels.prefill.gemm import BK, BN
        D, I = cfg.dim, cfg.moe_inter_dim
        moe_prefill = (all(f in ("bf16", "fp8", "fp4") for f in (cfg.expert_format, lin))
                       and D % 128 == 0 and I % BN == 0 and I % BK == 0
                       and (D % 1024 == 0 or D & (D - 1) == 0))
    return replace(
        be, formats=(lin, cfg.expert_format),
        mhc_decode=be.kernels and bf16 and cd % 256 == 0,
        mhc_prefill=be.rows and cd % 64 == 0,
        fused_decode=be.kernels and bf16,
        moe_decode=be.kernels and bf16 and cfg.expert_format == "fp4",
        moe_prefill=moe_prefill,
        wo_a_gemv=be.kernels and bf16 and lin == "fp8",
        wo_a_prefill=(be.rows and lin in ("fp8", "bf16") and cfg.o_lora_rank % 128 == 0
                      and group_k % 128 == 0))
