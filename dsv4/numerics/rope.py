"""Rotary embeddings: YaRN frequency tables and interleaved (GPT-J) rotation of the last rope dims.

Angles are float32 products of the position and the frequency, as the reference's
`torch.outer(arange(seqlen), freqs)`; cos/sin are computed from device position tensors, so the
same code serves prefill (positions [s]) and the capture-safe decode step (position [1]).
"""
from __future__ import annotations

import math

import torch

from ..weights.config import ModelConfig


def rope_frequencies(cfg: ModelConfig, ratio: int, device=None) -> torch.Tensor:
    """Per-pair frequencies [rope_head_dim/2] float32 for a layer with compress ratio `ratio`.

    ratio > 0: compress_rope_theta with YaRN (when original_seq_len > 0); ratio == 0: rope_theta,
    no YaRN. No mscale is ever applied (DSV4_SPEC §3.3).
    """
    dim = cfg.rope_head_dim
    if ratio:
        base, orig = cfg.compress_rope_theta, cfg.original_seq_len
    else:
        base, orig = cfg.rope_theta, 0
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if orig > 0:
        def corr_dim(n_rot):
            return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(corr_dim(cfg.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs.to(device)


def cos_sin(pos: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [...] int64 (device) -> cos, sin [..., dr/2] float32. Capture-safe."""
    ang = pos.to(torch.float32)[..., None] * freqs
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor], inverse: bool = False
               ) -> torch.Tensor:
    """Rotate the last 2*len(freqs) dims of x in interleaved pairs; returns a new tensor (x's dtype).

    x [s, ..., d]; cos/sin [s, dr/2] broadcast over the middle dims. Computed in float32.
    `inverse` multiplies by the conjugate (de-rotation of the attention output).
    """
    cos, sin = cs
    dr = cos.shape[-1] * 2
    mid = x.dim() - cos.dim()
    cos = cos.reshape(cos.shape[:-1] + (1,) * mid + cos.shape[-1:])
    sin = sin.reshape(cos.shape)
    if inverse:
        sin = -sin
    rot = x[..., -dr:].to(torch.float32).unflatten(-1, (dr // 2, 2))
    a, b = rot[..., 0], rot[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-dr], out.to(x.dtype)), dim=-1)
