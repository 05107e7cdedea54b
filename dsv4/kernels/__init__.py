"""Kernels of the decode step (FP8 / bf16 GEMV, routed FP4 experts, mHC, attention, compressor,
indexer) and of a prefill chunk (stored-format GEMMs, grouped experts, sparse attention rows, mHC
rows); each file holds its kernels, a plain-torch `*_reference` and how to test/bench it. Triton
is imported lazily, so `import dsv4` works without it; `available(device)` / `prefill_ok(t)` say
whether the kernel paths may be used.
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
