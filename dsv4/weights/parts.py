"""Parts of stored tensors: which slice of a checkpoint tensor a destination holds (a tensor-parallel
rank's shard of a weight), in stored elements, and the parts of a weight and its scale in each
stored format. A loader reads only the part (safetensors `get_slice`); a part that runs past the
tensor's end (the last rank's rows of a vocabulary that does not divide) reads as zeros there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import FP4_BLOCK, FP8_BLOCK


@dataclass(frozen=True)
class Part:
    """Elements [start, stop) along `dim` of a stored tensor, the other dims whole."""
    dim: int
    start: int
    stop: int

    def __post_init__(self):
        if self.dim < 0 or not 0 <= self.start < self.stop:
            raise ValueError(f"Part(dim={self.dim}, start={self.start}, stop={self.stop}): "
                             f"expected dim >= 0 and 0 <= start < stop")

    def shape(self, full: tuple) -> tuple:
        """The destination's shape for a stored tensor of shape `full`."""
        if self.dim >= len(full) or self.start >= full[self.dim]:
            raise ValueError(f"{self} does not fit a stored tensor of shape {list(full)}")
        out = list(full)
        out[self.dim] = self.stop - self.start
        return tuple(out)

    def index(self, size: int) -> tuple:
        """The basic index of the stored elements this part holds (of `size` along dim): the
        rows past the end are not stored (zeros)."""
        return (slice(None),) * self.dim + (slice(self.start, min(self.stop, size)),)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This part of `full` (a new tensor; zeros past full's end along dim)."""
        got = full[self.index(full.shape[self.dim])]
        if self.stop <= full.shape[self.dim]:
            return got.clone()
        out = torch.zeros(self.shape(tuple(full.shape)), dtype=full.dtype, device=full.device)
        out.narrow(self.dim, 0, got.shape[self.dim]).copy_(got)
        return out


def weight_parts(fmt: str, dim: int, start: int, stop: int) -> tuple[Part, Part | None]:
    """(weight part, scale part or None) of a weight in stored format `fmt` ("bf16", "f32",
    "fp8": 128x128 scale blocks, "fp4": two codes a byte along the input dim, a scale per 32)
    holding logical elements [start, stop) of dim 0 (output rows) or 1 (input columns).
    Quantized parts must fall on the format's block boundaries (a rank holds whole blocks)."""
    block = {"fp8": FP8_BLOCK, "fp4": FP4_BLOCK if dim == 1 else 1}.get(fmt, 1)
    if start % block or stop % block:
        raise ValueError(f"{fmt} weight: elements [{start}, {stop}) of dim {dim} split its "
                         f"blocks of {block}; a part must hold whole blocks")
    if fmt == "fp8":
        return Part(dim, start, stop), Part(dim, start // FP8_BLOCK, stop // FP8_BLOCK)
    if fmt == "fp4":
        if dim == 0:
            return Part(0, start, stop), Part(0, start, stop)
        return Part(1, start // 2, stop // 2), Part(1, start // FP4_BLOCK, stop // FP4_BLOCK)
    return Part(dim, start, stop), None
