"""Linear layers over weights kept in their stored formats: bf16, FP8 (128x128 ue8m0), FP4 (per-32 ue8m0).

Semantics follow the official `linear()`: FP8/FP4 weights get W8A8 — the input is quantized to
e4m3 per 128 with ue8m0 scales, then multiplied with the (exactly) dequantized weight with float32
accumulation, output in the activation dtype. bf16 weights are a plain matmul in the activation
dtype. Dequantization happens per call (weights stay in their stored format in memory). That is
the reference; a backend may bind kernels to a weight (dsv4/backend/binding.py: a decode row on the
GEMV kernels, a prefill chunk's rows on the stored-format GEMM, where they fit the call).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics.quant import fp8_quant_dequant
from ..weights.formats import (
    FP4_BLOCK,
    FP8_BLOCK,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
)
from ..weights.parts import Part, weight_parts

FORMATS = ("bf16", "fp8", "fp4", "f32")


class Linear:
    """One weight matrix `[out, in]` in a stored format; `names` maps tensor role -> attribute.

    fmt "fp8": weight float8_e4m3fn [out, in] + scale float8_e8m0fnu [out/128, in/128]
    fmt "fp4": weight int8 [out, in/2] (packed e2m1) + scale float8_e8m0fnu [out, in/32]
    fmt "bf16"/"f32": weight [out, in] in that dtype, no scale (bf16 checkpoints, gate, compressor)

    Bound ops (the torch reference below until the backend binds kernels): `forward` (what
    a call runs) and `forward_rows` (what `rows` runs).

    split: (dim, start, stop): the weight held is elements [start, stop) of dim 0 (output rows)
    or 1 (input columns) of the checkpoint's (a tensor-parallel shard); out_features /
    in_features are the held sizes. None: the whole weight.
    """

    def __init__(self, out_features: int, in_features: int, fmt: str, device,
                 split: tuple[int, int, int] | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; allowed {FORMATS}")
        self.out_features, self.in_features, self.fmt = out_features, in_features, fmt
        self.weight, self.scale = _alloc(fmt, (), out_features, in_features, device)
        self.split = split
        self.dense_cache: dict | None = None   # dtype -> dense weight; set to {} to enable
        self.forward = self.reference
        self.forward_rows = self.reference_rows

    @property
    def quantized(self) -> bool:
        return self.fmt in ("fp8", "fp4")

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint name -> destination tensor (for loading)."""
        d = {f"{prefix}.weight": self.weight}
        if self.scale is not None:
            d[f"{prefix}.scale"] = self.scale
        return d

    def parts(self, prefix: str) -> dict[str, Part]:
        """Checkpoint name -> the Part of it this weight (and its scale) holds; {} when whole."""
        if self.split is None:
            return {}
        w, s = weight_parts(self.fmt, *self.split)
        return {f"{prefix}.weight": w, **({f"{prefix}.scale": s} if s is not None else {})}

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out, in] in `dtype` (exact for bf16 and float32). Cached when
        `dense_cache` is enabled (small models on the CPU, where op overhead dominates)."""
        if self.dense_cache is None:
            return dequantize(self.fmt, self.weight, self.scale, dtype)
        if dtype not in self.dense_cache:
            self.dense_cache[dtype] = dequantize(self.fmt, self.weight, self.scale, dtype)
        return self.dense_cache[dtype]

    def __call__(self, x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        """y = x @ W^T with official semantics; x [..., in] -> [..., out] in act_dtype. Capture-safe."""
        return self.forward(x, act_dtype)

    def rows(self, x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        """A few decode rows x [T, in] (the speculative verify rows) -> [T, out], row t with the
        bits of self(x[t:t+1]) (bound kernels read the weight once for all rows)."""
        return self.forward_rows(x, act_dtype)

    def reference(self, x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        """The torch math: W8A8 for FP8 / FP4 weights, a plain matmul for bf16 / f32."""
        if self.quantized:
            x = fp8_quant_dequant(x, FP8_BLOCK, out_dtype=act_dtype)
        else:
            x = x.to(act_dtype)
        return F.linear(x, self.dense(act_dtype))

    def reference_rows(self, x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        """rows as one call per row."""
        return torch.cat([self(x[t:t + 1], act_dtype) for t in range(x.shape[0])])


class ExpertBank:
    """The routed experts of one layer, stacked: w1/w3 [E, I, D], w2 [E, D, I] in a stored format.
    split: (start, stop): every expert holds inter rows [start, stop) of its checkpoint weights
    (w1 / w3 rows, w2 columns: a tensor-parallel shard; inter_dim = stop - start); None: whole."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, fmt: str, device,
                 split: tuple[int, int] | None = None):
        self.n_experts, self.fmt, self.split = n_experts, fmt, split
        self.w1, self.w1_scale = _alloc(fmt, (n_experts,), inter_dim, dim, device)
        self.w3, self.w3_scale = _alloc(fmt, (n_experts,), inter_dim, dim, device)
        self.w2, self.w2_scale = _alloc(fmt, (n_experts,), dim, inter_dim, device)
        self.dense_cache: dict | None = None   # (which, dtype) -> dense bank; {} enables

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        d = {}
        for e in range(self.n_experts):
            for w in ("w1", "w2", "w3"):
                d[f"{prefix}.{e}.{w}.weight"] = getattr(self, w)[e]
                s = getattr(self, f"{w}_scale")
                if s is not None:
                    d[f"{prefix}.{e}.{w}.scale"] = s[e]
        return d

    def parts(self, prefix: str) -> dict[str, Part]:
        """Checkpoint name -> the Part of it each expert's weights hold; {} when whole."""
        if self.split is None:
            return {}
        d = {}
        for w, dim in (("w1", 0), ("w2", 1), ("w3", 0)):
            wp, sp = weight_parts(self.fmt, dim, *self.split)
            for e in range(self.n_experts):
                d[f"{prefix}.{e}.{w}.weight"] = wp
                if sp is not None:
                    d[f"{prefix}.{e}.{w}.scale"] = sp
        return d

    def dense(self, which: str, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized weights of experts `idx` ([k] int64, device) -> [k, out, in]. Capture-safe."""
        if self.dense_cache is not None:
            key = (which, dtype)
            if key not in self.dense_cache:
                s = getattr(self, f"{which}_scale")
                self.dense_cache[key] = dequantize(self.fmt, getattr(self, which), s, dtype)
            return self.dense_cache[key].index_select(0, idx)
        w = getattr(self, which).index_select(0, idx)
        s = getattr(self, f"{which}_scale")
        return dequantize(self.fmt, w, None if s is None else s.index_select(0, idx), dtype)


def _alloc(fmt: str, lead: tuple, out_f: int, in_f: int, device):
    if fmt == "fp8":
        return (torch.empty(*lead, out_f, in_f, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(*lead, out_f // FP8_BLOCK, in_f // FP8_BLOCK, dtype=torch.float8_e8m0fnu,
                            device=device))
    if fmt == "fp4":
        return (torch.empty(*lead, out_f, in_f // 2, dtype=torch.int8, device=device),
                torch.empty(*lead, out_f, in_f // FP4_BLOCK, dtype=torch.float8_e8m0fnu, device=device))
    dt = torch.bfloat16 if fmt == "bf16" else torch.float32
    return torch.empty(*lead, out_f, in_f, dtype=dt, device=device), None


def dequantize(fmt: str, w: torch.Tensor, s: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored weight (any leading dims) -> dense values in `dtype`."""
    if fmt == "fp8":
        return dequantize_fp8_weight(w, s, dtype)
    if fmt == "fp4":
        return dequantize_fp4_weight(w, s, dtype)
    return w.to(dtype)
