"""The backend: which implementation serves each op of the model on one device -- the CUDA C++
kernels (csrc/, dsv4.kernels.cuda), the Triton kernels (dsv4.kernels.decode / .prefill), Triton's
interpreter (the prefill kernels on the CPU, for tests) or plain torch -- decided once, when a
model is built, from the device, the activation dtype, the checkpoint's formats and shapes and
the runtime switches. `Options.from_env` is the one place that reads the DSV4_* environment
variables; `Backend.table()` reports the choice per op (`dsv4 decode --json`: `backend`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch

BRANCHES = ("attn", "mhc", "moe")      # the captured parallel branches (dsv4.backend.branches)
SPLIT_PROGRAMS = 264                   # the prefill GEMMs' split-K target (~2 waves of 132 SMs)
# variable -> what it switches (read by Options.from_env only)
ENV = {
    "DSV4_KERNELS": "0: every op on torch; interpret: the prefill kernels on the CPU in Triton's "
                    "interpreter (with TRITON_INTERPRET=1)",
    "DSV4_PREFILL_KERNELS": "0: a prefill chunk on torch (decode unchanged)",
    "DSV4_CUDA_KERNELS": "0: the Triton kernels instead of the CUDA C++ ones",
    "DSV4_CUDA_LIB": "a prebuilt CUDA C++ library (no nvcc build)",
    "DSV4_PDL": "0: no programmatic dependent launch",
    "DSV4_OVERLAP": "0: no parallel branches in captured steps; or the names to keep "
                    "(attn, mhc, moe)",
    "DSV4_PREFILL_MMA": "fp8=bf16,fp4=fp8: the prefill GEMMs' tensor-core path per weight format",
    "DSV4_PREFILL_CUBLAS": "0: the FP8 prefill linears stay on the Triton GEMM",
    "DSV4_SPLIT_PROGRAMS": f"the prefill GEMMs' split-K target in programs (default "
                           f"{SPLIT_PROGRAMS})",
    "TRITON_INTERPRET": "1: Triton's interpreter (Triton's own switch)",
}


@dataclass(frozen=True)
class Options:
    """The runtime switches of the backend, defaults = every switch unset (RuntimeConfig.options;
    None there: Options.from_env() when the model is built)."""
    kernels: str = "1"                   # DSV4_KERNELS: "0" off, "interpret" (CPU prefill)
    prefill_kernels: bool = True         # DSV4_PREFILL_KERNELS
    cuda_kernels: bool = True            # DSV4_CUDA_KERNELS
    cuda_lib: str | None = None          # DSV4_CUDA_LIB
    pdl: bool = True                     # DSV4_PDL
    overlap: frozenset = frozenset(BRANCHES)   # DSV4_OVERLAP: the branch names that are on
    prefill_mma: tuple = ()              # DSV4_PREFILL_MMA: ((format, "fp8" | "bf16"), ...)
    prefill_cublas: bool = True          # DSV4_PREFILL_CUBLAS
    split_programs: int = SPLIT_PROGRAMS  # DSV4_SPLIT_PROGRAMS
    interpret: bool = False              # TRITON_INTERPRET == "1"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        """The switches from the environment (default os.environ), each as the runtime has
        always read it: "0" turns a switch off, anything else (or unset) leaves it on."""
        env = os.environ if env is None else env
        off = lambda name: env.get(name, "1") == "0"          # noqa: E731
        ov = env.get("DSV4_OVERLAP", "1").strip()
        overlap = frozenset(BRANCHES) if ov == "1" else frozenset() if ov == "0" else \
            frozenset(n.strip() for n in ov.split(",")) & frozenset(BRANCHES)
        mma = []
        for item in env.get("DSV4_PREFILL_MMA", "").split(","):
            fmt, _, path = item.partition("=")
            if path.strip() in ("fp8", "bf16"):
                mma.append((fmt.strip(), path.strip()))
        return cls(kernels=env.get("DSV4_KERNELS", "1"),
                   prefill_kernels=not off("DSV4_PREFILL_KERNELS"),
                   cuda_kernels=not off("DSV4_CUDA_KERNELS"),
                   cuda_lib=env.get("DSV4_CUDA_LIB") or None, pdl=not off("DSV4_PDL"),
                   overlap=overlap, prefill_mma=tuple(mma),
                   prefill_cublas=not off("DSV4_PREFILL_CUBLAS"),
                   split_programs=int(env.get("DSV4_SPLIT_PROGRAMS", SPLIT_PROGRAMS)),
                   interpret=env.get("TRITON_INTERPRET", "0") == "1")

    def replace(self, **changes) -> "Options":
        return replace(self, **changes)


@dataclass(frozen=True)
class Backend:
    """The implementation of every op on one device for one model, resolved once (`resolve`).

    Device facts: `kernels` (the Triton kernels may run here: CUDA, triton importable,
    DSV4_KERNELS != 0), `prefill` (the multi-row kernels of a prefill chunk: "triton",
    "interpret" or "torch"), `cuda` ("ok" when the CUDA C++ kernels serve this device, else why
    not), the launch switches. Model decisions (from the config; False without one): which
    sublayer runs its fused kernels. Per-call conditions (a decode call's row count, a GEMM's
    dtypes, a launch a CUDA kernel does not fit) stay with the op."""
    device: torch.device
    act: torch.dtype
    options: Options = field(default_factory=Options)
    kernels: bool = False
    prefill: str = "torch"
    cuda: str = "not a CUDA device"
    pdl: bool = False                    # launches with PDL (each also needs sm_90)
    branches: frozenset = frozenset()    # captured parallel branches that are on
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
    def gemv(self) -> str:
        """Who runs the FP8 GEMVs (and the CUDA-capable decode kernels): "cuda" or "triton"."""
        return "cuda" if self.cuda == "ok" else "triton"

    @property
    def rows(self) -> bool:
        """The prefill chunk takes the multi-row kernels (Triton or its interpreter)."""
        return self.prefill != "torch"

    def gemm_fits(self, fmt: str, in_features: int) -> bool:
        """The prefill GEMM serves a weight of this format and input size for a chunk's rows."""
        quantized = fmt in ("fp8", "fp4")
        return (self.rows and fmt in ("bf16", "fp8", "fp4")
                and in_features % (128 if quantized else self.gemm_bk) == 0)

    def table(self) -> dict[str, str]:
        """op -> the implementation that serves it ("cuda", "triton", "interpret", "torch"; "-":
        no such weights): the decode and prefill ops, the speculative journal, and the launch
        switches and CUDA C++ status of the device."""
        off, k = "torch", self.gemv                 # k: CUDA C++ where it serves, else Triton
        lin = self.formats[0] if self.formats else "fp8"
        dec = "triton" if self.fused_decode else off
        gemv = self.kernels and self.act == torch.bfloat16
        return {
            "decode.mhc": "triton" if self.mhc_decode else off,
            "decode.attention": dec,                # q/kv prep, sparse attention, inverse RoPE
            "decode.compressor": dec,
            "decode.indexer": dec,                  # query, scores
            "decode.indexer_topk": ("cuda" if self.cuda == "ok" else off) if self.fused_decode
            else off,
            "decode.linear_fp8": (k if lin == "fp8" else "-") if gemv else off,
            "decode.linear_bf16": "triton" if gemv else off,
            "decode.wo_a": k if self.wo_a_gemv else off,
            "decode.moe_route": k if self.moe_decode else off,
            "decode.moe_experts": k if self.moe_decode else off,
            "decode.moe_shared": (k if lin == "fp8" else off) if self.moe_decode else off,
            "decode.head": "triton" if self.kernels else off,
            "prefill.mhc": self.prefill if self.mhc_prefill else off,
            "prefill.attention": self.prefill,      # prep rows, sparse attention rows
            "prefill.compressor": self.prefill,
            "prefill.indexer": self.prefill,
            "prefill.linear": self.prefill,         # where a weight fits (gemm_fits)
            "prefill.wo_a": self.prefill if self.wo_a_prefill else off,
            "prefill.moe": self.prefill if self.moe_prefill else off,
            "speculative.journal": "triton" if self.kernels else off,
            "launch.pdl": "on" if self.pdl else "off",
            "launch.branches": ",".join(sorted(self.branches)) or "none",
            "cuda_cpp": self.cuda,
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
    cuda = "not a CUDA device" if not cuda_dev else "DSV4_KERNELS=0" if not kernels else \
        "DSV4_CUDA_KERNELS=0" if not opts.cuda_kernels else _cuda_status(device, opts.cuda_lib)
    be = Backend(device=device, act=act, options=opts, kernels=kernels, prefill=prefill,
                 cuda=cuda, pdl=opts.pdl and kernels,
                 branches=opts.overlap if cuda_dev else frozenset())
    if prefill != "torch":
        from ..kernels.prefill.gemm import BK
        be = replace(be, gemm_bk=BK)
    return be if cfg is None else _model_decisions(be, cfg)


def _cuda_status(device: torch.device, path: str | None) -> str:
    from ..kernels.cuda import lib
    return lib.status(device, path)


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
