"""The kernels, by phase and family; each file holds its kernels, a plain-torch `*_reference` (or
names the torch code it replaces) and how to test it:

  decode/   the decode step's Triton kernels: mHC, attention prep and sparse attention, the
            compressor and indexer steps, FP8 / bf16 GEMVs, routed FP4 experts, routing, the
            speculative journal (FP8 GEMV, experts, routing and top-k launch the CUDA C++ kernels
            where they serve)
  prefill/  a prefill chunk's: stored-format GEMMs (gemm, gemm_kernels), grouped experts (moe),
            sparse attention rows, compressor entries, indexer scores, mHC rows
  cuda/     the CUDA C++ kernels of csrc/: the library build and loader (lib) and the launch
            configs of the FP8 GEMVs (fp8) and the routed experts (experts)
  common    what the Triton kernels share: exact act_quant, e4m3 / e2m1 decodes, bf16 rounding,
            in-kernel RoPE / fake-quant / Hadamard, launch configs, PDL
  aot       the sm_90 compile of every decode launch config without a GPU

Kernel modules never import the model's modules (dsv4.attention, dsv4.block, ...): only the
numerics they reference (dsv4.formats, quant, rope, sparse, mhc). Triton is imported lazily, so
`import dsv4` works without it; `available(device)` / `prefill_ok(t)` say whether the kernel
paths may be used.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

ENV_SWITCH = "DSV4_KERNELS"   # "0" turns the kernel path off (the torch path is the escape hatch);
#                               "interpret": the prefill kernels on the CPU under TRITON_INTERPRET=1
PREFILL_SWITCH = "DSV4_PREFILL_KERNELS"   # "0": a prefill chunk on the torch path (decode unchanged)


def triton_importable() -> bool:
    if "triton" in sys.modules:             # None there means an import of it is blocked
        return sys.modules["triton"] is not None
    return importlib.util.find_spec("triton") is not None


def available(device) -> bool:
    """True when the kernels may run on `device`: CUDA, triton importable, DSV4_KERNELS != "0"."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    return (torch.device(device).type == "cuda" and torch.cuda.is_available()
            and triton_importable())


def prefill_ok(t: torch.Tensor) -> bool:
    """Use the multi-row kernels of a prefill chunk for t: bf16 activations on a device where the
    kernels are available, or on the CPU under the Triton interpreter (TRITON_INTERPRET=1) when
    DSV4_KERNELS=interpret (how the tests run them without a GPU). DSV4_PREFILL_KERNELS=0: never."""
    if t.dtype != torch.bfloat16 or os.environ.get(PREFILL_SWITCH, "1") == "0":
        return False
    if t.device.type == "cpu":
        return (os.environ.get(ENV_SWITCH) == "interpret" and triton_importable()
                and os.environ.get("TRITON_INTERPRET") == "1")
    return available(t.device)
