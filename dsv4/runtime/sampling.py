"""On-device next-token choice without host syncs: greedy, temperature, top-k, top-p, seeded.

Temperature sampling is the official exponential race, argmax(softmax(l / T) / E) with E ~ Exp(1).
The noise comes from a counter-based hash of (seed, position, vocab index) in integer tensor ops:
the same draws on CPU and GPU, in eager mode and in graph replay, with no generator state.
The parameters are either fixed when a step is captured (`SamplingParams`: Python branches pick
the ops) or device tensors the captured step reads (`SamplingKnobs`: one graph serves every
temperature, top-p, top-k and seed, the same tokens as the fixed parameters give).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..errors import InputError

_MASK31 = 0x7FFFFFFF
_INT64_MAX = 2 ** 63 - 1
_M1, _M2 = 0x2C1B3C6D, 0x297A2D39   # odd 30-bit multipliers: products stay below 2^62


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0           # 1 = off
    top_k: int = 0               # 0 = off
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise InputError(f"temperature = {self.temperature}: must be a finite number >= 0 "
                             f"(0 = greedy)")
        if not (0 < self.top_p <= 1):
            raise InputError(f"top_p = {self.top_p}: must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k = {self.top_k}: must be a non-negative integer (0 = off)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InputError(f"seed = {self.seed}: must be a non-negative integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SamplingKnobs:
    """SamplingParams as device tensors read by a captured step, so that one graph serves every
    request: temperature [1] f32, top_p [1] f32, top_k [1] int64, seed [1] int64 and the host's
    decisions greedy / use_top_p / use_top_k [1] bool, all on one device. `set(params)` writes
    them in place (ordered on the current stream, no host sync). Every op runs for every value
    (greedy still pays for the softmax, the sort of top-p / top-k and the noise), and the token
    equals the one `SamplingParams` gives, bit for bit.
    on_host (an eager step, never captured): the ops branch on the host copy `params` exactly as
    fixed parameters do, so the knobs cost nothing."""

    def __init__(self, device, params: SamplingParams | None = None, on_host: bool = False):
        dev = torch.device(device)
        self.on_host = on_host
        f32, i64, b = (dict(dtype=d, device=dev) for d in (torch.float32, torch.int64, torch.bool))
        self.temperature, self.top_p = torch.zeros(1, **f32), torch.ones(1, **f32)
        self.top_k, self.seed = torch.zeros(1, **i64), torch.zeros(1, **i64)
        self.greedy, self.use_top_p, self.use_top_k = (torch.ones(1, **b), torch.zeros(1, **b),
                                                       torch.zeros(1, **b))
        self.params = SamplingParams()          # the host copy of what the tensors hold
        self.set(params or SamplingParams())

    def set(self, params: SamplingParams) -> None:
        """The next steps sample with `params` (in place; graphs keep reading these tensors)."""
        if params.seed >= 1 << 63:
            raise InputError(f"seed = {params.seed}: must be < 2**63 (a signed 64-bit integer)")
        self.temperature.fill_(params.temperature)
        self.top_p.fill_(params.top_p)
        # a top_k at or above the vocabulary keeps every token: past int64 it keeps them too
        self.top_k.fill_(min(params.top_k, _INT64_MAX))
        self.seed.fill_(params.seed)
        # decided on the host exactly as SamplingParams' branches decide (a temperature or top_p
        # that float32 rounds to 0 or 1 must not change the path)
        self.greedy.fill_(params.greedy)
        self.use_top_p.fill_(params.top_p < 1.0)
        self.use_top_k.fill_(params.top_k > 0)
        self.params = params


def fixed(params: SamplingParams | SamplingKnobs) -> SamplingParams | SamplingKnobs:
    """The parameters the ops branch on: on-host knobs give their SamplingParams."""
    return params.params if isinstance(params, SamplingKnobs) and params.on_host else params


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash round (int64 arithmetic that never overflows)."""
    x = (x ^ (x >> 15)) & _MASK31
    x = (x * _M1) & _MASK31
    x = (x ^ (x >> 13)) & _MASK31
    x = (x * _M2) & _MASK31
    return x ^ (x >> 16)


# the largest float32 below 1: the top 64 of the 2^31 draws round up to 1.0 in float32
_BELOW_ONE = 1.0 - 2.0 ** -24


def uniform_noise(seed, pos: torch.Tensor, n: int) -> torch.Tensor:
    """Uniform (0, 1) float32 [n] from (seed, pos [1] int64 device tensor, index), never 0 or 1
    (race divides by -log u: at u = 1.0 a token of probability 0 came out NaN and won the
    argmax, about one draw in 250 over a 129,280-token vocabulary). Capture-safe. seed: an int,
    or a [1] int64 tensor on pos's device (the same draws)."""
    i = torch.arange(n, device=pos.device, dtype=torch.int64)
    h = _mix(i + (seed & _MASK31) * 0x9E37)
    h = _mix(h ^ ((pos * 0x5BD1E99) & _MASK31))
    h = _mix(h ^ ((seed >> 31) & _MASK31))
    return (h.to(torch.float64) + 0.5).div_(2.0 ** 31).to(torch.float32).clamp_(1e-12,
                                                                                 _BELOW_ONE)


def _mass_above(sp: torch.Tensor) -> torch.Tensor:
    """sp [V] sorted descending -> for each entry the sum of the entries before it, summed in one
    fixed order on every run: torch scans a lone row on CUDA with one device-wide scan whose
    float partial sums depend on the blocks' timing (top_p kept a 1e-12 tail entry in one run and
    dropped it in the next); a row of a two-row tensor is scanned by one block in a fixed order
    (the CPU's sequential scan gives the same bits either way)."""
    return torch.stack((sp, torch.zeros_like(sp))).cumsum(1)[0] - sp


def filtered_probs(logits: torch.Tensor, params: SamplingParams | SamplingKnobs,
                   normalize: bool = True) -> torch.Tensor:
    """logits [V] f32 -> the sampling distribution [V] (softmax at the temperature, top-k / top-p
    applied, renormalised unless `normalize` is off). Not for greedy params (knobs: any values;
    the result is unused where the temperature is 0)."""
    params = fixed(params)
    if isinstance(params, SamplingKnobs):
        return _filtered_probs_knobs(logits, params, normalize)
    # temperature and top_p as float32 tensors on the logits' device, as the knobs hold them: a
    # Python scalar operand would be applied in another precision or form on CUDA (a * (1 / b),
    # a double comparison), and the knobs must give these bits
    probs = torch.softmax(logits / logits.new_full((1,), max(params.temperature, 1e-5)), dim=-1)
    if params.top_k or params.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = torch.ones_like(sp, dtype=torch.bool)
        if params.top_k:
            keep[params.top_k:] = False
        if params.top_p < 1.0:   # keep the smallest prefix whose mass reaches top_p
            keep &= _mass_above(sp) < sp.new_full((1,), params.top_p)
        probs = torch.zeros_like(probs).scatter_(0, si, torch.where(keep, sp, 0.0))
        if normalize:
            probs = probs / probs.sum()
    return probs


def _filtered_probs_knobs(logits: torch.Tensor, k: SamplingKnobs, normalize: bool) -> torch.Tensor:
    """filtered_probs with the parameters in device tensors: every branch of the fixed version
    becomes a torch.where, with the same bits. Capture-safe."""
    probs = torch.softmax(logits / k.temperature.clamp_min(1e-5), dim=-1)
    sp, si = probs.sort(descending=True)
    rank = torch.arange(sp.shape[0], device=sp.device)
    keep = ~k.use_top_k | (rank < k.top_k)
    keep &= ~k.use_top_p | (_mass_above(sp) < k.top_p)
    filtered = torch.zeros_like(probs).scatter_(0, si, torch.where(keep, sp, 0.0))
    if normalize:
        filtered = filtered / filtered.sum()
    # unfiltered, the fixed version neither permutes nor renormalises: the softmax itself
    return torch.where(k.use_top_k | k.use_top_p, filtered, probs)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [..., 1] int64: x.argmax(-1, keepdim=True) (the first largest; a NaN above
    every number). On a CUDA device whose Triton kernels may run, one launch of
    dsv4.kernels.decode.argmax (torch reduces a row to one output on a single block: 27.6 us of
    every Flash decode step on an H100); elsewhere torch's. Capture-safe."""
    if x.is_cuda:
        ops = _kernel_ops(x.device, os.environ.get("DSV4_KERNELS"))
        if ops is not None:
            return ops.argmax_rows(x)
    return x.argmax(dim=-1, keepdim=True)


@functools.lru_cache(maxsize=None)
def _kernel_ops(device: torch.device, switch: str | None):
    """The device's kernel ops where its Triton kernels may run (the backend's decision, read once
    per device and DSV4_KERNELS value), else None."""
    from ..backend.ops import Ops
    ops = Ops.for_device(device)
    return ops if ops.backend.kernels else None


def race(probs: torch.Tensor, seed, pos: torch.Tensor) -> torch.Tensor:
    """One draw from probs [V] (need not sum to 1) by the exponential race, noise keyed by (seed,
    pos) -> token [1] int64. seed: an int, or a [1] int64 device tensor (knobs)."""
    e = -torch.log(uniform_noise(seed, pos, probs.shape[-1]))
    return first_argmax(probs / e)


def sample(logits: torch.Tensor, pos: torch.Tensor, params: SamplingParams | SamplingKnobs
           ) -> torch.Tensor:
    """logits [V] float32, pos [1] int64 (the position being decoded; keys the noise) -> token [1]
    int64. Python branches only on `params` (fixed per capture), never on tensor values."""
    params = fixed(params)
    if isinstance(params, SamplingKnobs):
        drawn = race(filtered_probs(logits, params, normalize=False), params.seed, pos)
        return torch.where(params.greedy, first_argmax(logits), drawn)
    if params.greedy:
        return first_argmax(logits)
    return race(filtered_probs(logits, params, normalize=False), params.seed, pos)
