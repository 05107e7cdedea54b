"""Sparse attention over selected KV rows with an attention sink, and the lightning indexer's scores
and top-k that select those rows: the plain-torch math that the model (attention.py, indexer.py) and the
kernels' references (kernels/decode/attention.py, kernels/decode/indexer.py) share.

Legend: s = queries, h = heads, d = head_dim, k = selected entries, t = index-cache entries.
"""
from __future__ import annotations

import torch


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of q [s, h, d] over rows idx [s, k] of kv [n, d] (-1 = masked), with a per-head
    sink logit in the denominator (official sparse_attn). Logits and sums in float32; in bf16 the
    probabilities are rounded to bf16 for P.V as the kernel does. Returns [s, h, d] in q's dtype.
    Every query needs at least one valid index (its own position always is)."""
    valid = idx >= 0                                                          # [s, k]
    g = kv[idx.clamp_min(0)].to(torch.float32)                                # [s, k, d]
    logits = torch.einsum("shd,skd->shk", q.to(torch.float32), g) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)                                     # finite: slot p valid
    p = torch.exp(logits - m)
    denom = p.sum(dim=-1) + torch.exp(sink - m.squeeze(-1))                   # [s, h]
    if q.dtype != torch.float32:
        p = p.to(q.dtype).to(torch.float32)
    o = torch.einsum("shk,skd->shd", p, g) / denom.unsqueeze(-1)
    return o.to(q.dtype)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The indexer's score of every key for every query: sum_h relu(q_h . k_t) * w_h, in the
    activation dtype (the reference computes it in bf16). q [s, h, di], w [s, h], keys [t, di]
    -> [s, t]."""
    sc = torch.einsum("shd,td->sht", q, keys)
    return (sc.relu() * w.unsqueeze(-1)).sum(dim=1)


def topk_lowest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the k best scores per row [.., t] -> [.., k] int64, best first; among equal
    scores the lower column wins, as the CUDA radix select of the decode does. Exact ties are
    common (a relu'd score of 0 with few index heads): a fixed rule keeps prefill in any chunking
    and token-by-token decode choosing the same entries. One topk over int64 keys (the score's
    order-preserving float32 bits, then the reversed column), no sort. Capture-safe."""
    f = scores.to(torch.float32) + 0.0                   # -0.0 -> +0.0: equal scores, equal keys
    b = f.view(torch.int32).to(torch.int64)
    b = torch.where(b < 0, b ^ 0x7FFFFFFF, b)            # float order == integer order
    t = scores.shape[-1]
    col = torch.arange(t - 1, -1, -1, device=scores.device)
    return ((b << 32) | col).topk(k, dim=-1).indices


def visible_bound(start, s: int, ratio: int, n: int) -> int:
    """Compressed entries a chunk of s queries at `start` may attend (the first (start+s)//ratio
    of the cache's n); a device start (capture) gives the whole cache."""
    return n if isinstance(start, torch.Tensor) else min(n, (start + s) // ratio)
