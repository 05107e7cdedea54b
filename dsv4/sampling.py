"""On-device next-token choice without host syncs: greedy, temperature, top-k, top-p, seeded.

Temperature sampling is the official exponential race, argmax(softmax(l / T) / E) with E ~ Exp(1).
The noise comes from a counter-based hash of (seed, position, vocab index) in integer tensor ops:
the same draws on CPU and GPU, in eager mode and in graph replay, with no generator state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError

_MASK31 = 0x7FFFFFFF
_M1, _M2 = 0x2C1B3C6D, 0x297A2D39   # odd 30-bit multipliers: products stay below 2^62


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0           # 1 = off
    top_k: int = 0               # 0 = off
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0) or self.temperature != self.temperature:
            raise InputError(f"temperature = {self.temperature}: must be >= 0 (0 = greedy)")
        if not (0 < self.top_p <= 1):
            raise InputError(f"top_p = {self.top_p}: must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k = {self.top_k}: must be a non-negative integer (0 = off)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InputError(f"seed = {self.seed}: must be a non-negative integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash round (int64 arithmetic that never overflows)."""
    x = (x ^ (x >> 15)) & _MASK31
    x = (x * _M1) & _MASK31
    x = (x ^ (x >> 13)) & _MASK31
    x = (x * _M2) & _MASK31
    return x ^ (x >> 16)


def uniform_noise(seed: int, pos: torch.Tensor, n: int) -> torch.Tensor:
    """Uniform (0, 1) float32 [n] from (seed, pos [1] int64 device tensor, index). Capture-safe."""
    i = torch.arange(n, device=pos.device, dtype=torch.int64)
    h = _mix(i + (seed & _MASK31) * 0x9E37)
    h = _mix(h ^ ((pos * 0x5BD1E99) & _MASK31))
    h = _mix(h ^ ((seed >> 31) & _MASK31))
    return (h.to(torch.float64) + 0.5).div_(2.0 ** 31).to(torch.float32).clamp_(1e-12, 1.0)


def filtered_probs(logits: torch.Tensor, params: SamplingParams, normalize: bool = True
                   ) -> torch.Tensor:
    """logits [V] f32 -> the sampling distribution [V] (softmax at the temperature, top-k / top-p
    applied, renormalised unless `normalize` is off). Not for greedy params."""
    probs = torch.softmax(logits / max(params.temperature, 1e-5), dim=-1)
    if params.top_k or params.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = torch.ones_like(sp, dtype=torch.bool)
        if params.top_k:
            keep[params.top_k:] = False
        if params.top_p < 1.0:   # keep the smallest prefix whose mass reaches top_p
            keep &= (sp.cumsum(0) - sp) < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, si, torch.where(keep, sp, 0.0))
        if normalize:
            probs = probs / probs.sum()
    return probs


def race(probs: torch.Tensor, seed: int, pos: torch.Tensor) -> torch.Tensor:
    """One draw from probs [V] (need not sum to 1) by the exponential race, noise keyed by (seed,
    pos) -> token [1] int64."""
    e = -torch.log(uniform_noise(seed, pos, probs.shape[-1]))
    return (probs / e).argmax(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, pos: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] float32, pos [1] int64 (the position being decoded; keys the noise) -> token [1]
    int64. Python branches only on `params` (fixed per capture), never on tensor values."""
    if params.greedy:
        return logits.argmax(dim=-1, keepdim=True)
    return race(filtered_probs(logits, params, normalize=False), params.seed, pos)
