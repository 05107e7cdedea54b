"""Triton kernels for batch-1 decode (FP8 / bf16 GEMV, routed FP4 experts); each file holds its
kernel, a plain-torch `*_reference` and how to test/bench it. Triton is imported lazily, so
`import dsv4` works without it; `available(device)` says whether the kernel path may be used.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

ENV_SWITCH = "DSV4_KERNELS"   # "0" turns the kernel path off (the torch path is the escape hatch)


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
