"""The kernels, by phase and family; each file holds its kernels, a plain-torch `*_reference` (or
names the torch code it replaces) and how to test it:

  decode/   the decode step's Triton kernels: mHC, attention prep and sparse attention, the
            compressor and indexer steps, FP8 / bf16 GEMVs, routed FP4 experts, routing, the
            greedy pick (argmax), the speculative journal (FP8 GEMV, experts, routing and top-k launch the CUDA C++ kernels
            where they serve)
  prefill/  a prefill chunk's: stored-format GEMMs (gemm, gemm_kernels), grouped experts (moe),
            sparse attention rows, compressor entries, indexer scores, mHC rows
  cuda/     the CUDA C++ kernels of csrc/: the library build and loader (lib) and the launch
            configs of the FP8 GEMVs (fp8) and the routed experts (experts)
  common    what the Triton kernels share: exact act_quant, e4m3 / e2m1 decodes, bf16 rounding,
            in-kernel RoPE / fake-quant / Hadamard, launch configs, PDL
  aot       the sm_90 compile of every decode launch config without a GPU

Kernel modules never import the model's modules (dsv4.model.attention, dsv4.model.block, ...): only the
numerics they reference (dsv4.weights.formats, quant, rope, sparse, mhc). Which kernel serves which op is
decided once per device by dsv4.backend, and called through dsv4.backend.ops (the one importer of these
modules on the model's path), so `import dsv4` and the torch path work without Triton.
"""
from __future__ import annotations

import importlib.util
import sys


def triton_importable() -> bool:
    """Whether triton can be imported here (the backend's first question)."""
    if "triton" in sys.modules:             # None there means an import of it is blocked
        return sys.modules["triton"] is not None
    return importlib.util.find_spec("triton") is not None

