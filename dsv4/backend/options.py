"""The backend's runtime switches: `Options`, read from the DSV4_* environment variables in one
place (`Options.from_env`), or given by a program (RuntimeConfig.options). ENV lists each variable
and what it switches (docs/ARCHITECTURE.md's table).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

BRANCHES = ("attn", "mhc", "moe")      # the captured parallel branches (dsv4.backend.branches)
# the L2 prefetch points of a captured decode step (dsv4.backend.fused.prefetch): the layer's first
# linears during its first mHC, wo_a during attention, the shared expert during the FFN's mHC and
# routing
PREFETCH = ("layer", "attn", "ffn")
PREFETCH_CFG = (0, 16, 32, 16384)      # (mode, CTAs, threads, piece bytes) of dsv4_l2_prefetch
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
    "DSV4_PREFETCH": "1: the L2 prefetch of weights in captured steps (off by default: measured "
                     "no faster, BENCHMARKS.md); or the points to take (layer, attn, ffn)",
    "DSV4_TWO_SHOT": "1: a TP2 prefill chunk's all-reduces through our two-shot kernel (off by "
                     "default: slower than NCCL inside a prefill, BENCHMARKS.md)",
    "DSV4_FUSE_POST": "0: the block's mHC post as a launch of its own, not in the launch before "
                      "it (the routed experts' down on one GPU, each sublayer's all-reduce in "
                      "tensor parallel)",
    "DSV4_SEQ_PARALLEL": "0: a tensor-parallel prefill chunk's mHC on every rank for all rows, "
                         "not split by rows over the ranks (sequence parallel)",
    "DSV4_PREFETCH_CFG": "mode,ctas,threads,piece: the L2 prefetch launch (mode 0 bulk, 1 per "
                         "line; default " + ",".join(map(str, PREFETCH_CFG)) + ")",
    "DSV4_PREFILL_MMA": "fp8=bf16,fp4=fp8: the prefill GEMMs' tensor-core path per weight format",
    "DSV4_PREFILL_CUBLAS": "0: the FP8 prefill linears stay on the Triton GEMM",
    "DSV4_SPLIT_PROGRAMS": f"the prefill GEMMs' split-K target in programs (default "
                           f"{SPLIT_PROGRAMS})",
    "DSV4_DRAFT_FP8": "0: the MTP block drafts from the bf16 head, not from its e4m3 copy (half "
                      "the bytes; drafts are proposals, the verify pass keeps the output exact)",
    "DSV4_HEAD_CUDA": "0: the LM head's GEMV on the Triton kernel, not the CUDA C++ one "
                      "(kernels/cuda/bf16.py)",
    "DSV4_FUSE_MIX": "0: the attention's mHC post (where it is a launch of its own: one process, "
                     "or tensor parallel with DSV4_FUSE_POST=0) and the FFN's partial mixes as "
                     "two launches, not one (hc_post_mix)",
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
    prefetch: frozenset = frozenset()    # DSV4_PREFETCH: the prefetch points that are on
    prefetch_cfg: tuple = PREFETCH_CFG   # DSV4_PREFETCH_CFG
    two_shot: bool = False               # DSV4_TWO_SHOT (off unless "1")
    fuse_post: bool = True               # DSV4_FUSE_POST
    seq_parallel: bool = True            # DSV4_SEQ_PARALLEL
    prefill_mma: tuple = ()              # DSV4_PREFILL_MMA: ((format, "fp8" | "bf16"), ...)
    prefill_cublas: bool = True          # DSV4_PREFILL_CUBLAS
    split_programs: int = SPLIT_PROGRAMS  # DSV4_SPLIT_PROGRAMS
    draft_fp8: bool = True               # DSV4_DRAFT_FP8
    head_cuda: bool = True               # DSV4_HEAD_CUDA
    fuse_mix: bool = True                # DSV4_FUSE_MIX
    interpret: bool = False              # TRITON_INTERPRET == "1"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        """The switches from the environment (default os.environ), each as the runtime has
        always read it: "0" turns a switch off, anything else (or unset) leaves it on."""
        env = os.environ if env is None else env
        off = lambda name: env.get(name, "1") == "0"          # noqa: E731
        def names(var: str, every: tuple, default: str = "1") -> frozenset:
            v = env.get(var, default).strip()
            return frozenset(every) if v == "1" else frozenset() if v == "0" else \
                frozenset(n.strip() for n in v.split(",")) & frozenset(every)
        pcfg = env.get("DSV4_PREFETCH_CFG", "").split(",")
        pcfg = tuple(int(v) for v in pcfg) if len(pcfg) == 4 else PREFETCH_CFG
        mma = []
        for item in env.get("DSV4_PREFILL_MMA", "").split(","):
            fmt, _, path = item.partition("=")
            if path.strip() in ("fp8", "bf16"):
                mma.append((fmt.strip(), path.strip()))
        return cls(kernels=env.get("DSV4_KERNELS", "1"),
                   prefill_kernels=not off("DSV4_PREFILL_KERNELS"),
                   cuda_kernels=not off("DSV4_CUDA_KERNELS"),
                   cuda_lib=env.get("DSV4_CUDA_LIB") or None, pdl=not off("DSV4_PDL"),
                   overlap=names("DSV4_OVERLAP", BRANCHES),
                   prefetch=names("DSV4_PREFETCH", PREFETCH, "0"), prefetch_cfg=pcfg,
                   two_shot=env.get("DSV4_TWO_SHOT", "0") == "1",
                   fuse_post=not off("DSV4_FUSE_POST"),
                   seq_parallel=not off("DSV4_SEQ_PARALLEL"),
                   prefill_mma=tuple(mma),
                   prefill_cublas=not off("DSV4_PREFILL_CUBLAS"),
                   split_programs=int(env.get("DSV4_SPLIT_PROGRAMS", SPLIT_PROGRAMS)),
                   draft_fp8=not off("DSV4_DRAFT_FP8"),
                   head_cuda=not off("DSV4_HEAD_CUDA"),
                   fuse_mix=not off("DSV4_FUSE_MIX"),
                   interpret=env.get("TRITON_INTERPRET", "0") == "1")

    def replace(self, **changes) -> "Options":
        return replace(self, **changes)
