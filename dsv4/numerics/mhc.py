"""Manifold-constrained hyper-connections: hc_pre (with the Sinkhorn split), hc_post, hc_head.

Legend: s = tokens, c = hc_mult residual copies (4), d = dim. The residual stream [s, c, d] is
kept in the activation dtype between sublayers; mixes and weights are float32 (DSV4_SPEC §3.2).
All functions are capture-safe.
"""
from __future__ import annotations

import torch


def rms_scale(hf: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(hf^2) + eps) over the last dim, keepdim (hf float32)."""
    return torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)


def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                   iters: int, eps: float):
    """mixes [s, (2+c)*c] f32 -> pre [s, c], post [s, c], comb [s, c, c] (official hc_split_sinkhorn)."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[..., 2 * hc:].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = comb.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int):
    """h [s, c, d] -> (x [s, d] in h's dtype, post [s, c] f32, comb [s, c, c] f32)."""
    s, c, d = h.shape
    hf = h.reshape(s, c * d).to(torch.float32)
    mixes = (hf @ fn.t()) * rms_scale(hf, norm_eps)                     # [s, (2+c)*c]
    pre, post, comb = sinkhorn_split(mixes, scale, base, c, iters, hc_eps)
    x = (pre.unsqueeze(-1) * hf.view(s, c, d)).sum(dim=1)
    return x.to(h.dtype), post, comb


def hc_post(x: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
            ) -> torch.Tensor:
    """out[:, j] = post_j * x + sum_i comb[i, j] * res[:, i]; x [s, d], res [s, c, d] -> [s, c, d]."""
    y = post.unsqueeze(-1) * x.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=1)
    return y.to(x.dtype)


def hc_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """h [s, c, d] -> [s, d]: sigmoid-weighted sum of the copies (no Sinkhorn, no post)."""
    s, c, d = h.shape
    hf = h.reshape(s, c * d).to(torch.float32)
    mixes = (hf @ fn.t()) * rms_scale(hf, norm_eps)                     # [s, c]
    pre = torch.sigmoid(mixes * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * hf.view(s, c, d)).sum(dim=1).to(h.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 with a float32 weight, result in x's dtype (official RMSNorm)."""
    xf = x.to(torch.float32)
    return (weight * (xf * rms_scale(xf, eps))).to(x.dtype)
