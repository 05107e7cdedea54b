"""MoE of one layer: the gate (score / hash routing), routed experts (clamped SwiGLU) and the shared
expert (DSV4_SPEC §3.6). Legend: t = tokens, e = routed experts, k = activated per token,
D = dim, I = moe_inter_dim. Decode never syncs with the host; prefill may (it is not captured).
This is the torch math (a loop over the experts); a backend may bind the kernels to `decode_rows`
and `prefill_experts` (bound by dsv4/backend/binding.py: dsv4/backend/fused/moe.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics.quant import fp8_quant_dequant
from ..weights.config import ModelConfig
from ..weights.parts import Part
from .linear import ExpertBank, Linear
from .sharding import TensorParallel, same


class MoE:
    """Weights of one layer's MoE.

    Bound ops (the torch reference below until the backend binds kernels): `decode_rows`
    (decode_rows_reference), ending with `reduce`: the sum of the output over the
    tensor-parallel ranks (none in one process); and `prefill_experts`
    (prefill_experts_reference), whose output is this rank's partial (the block sums it).
    tp: this rank's place (dsv4.model.sharding): every routed expert and the shared one hold
    inter rows [start, stop) of moe_inter_dim (w1 / w3 rows, w2 columns); the gate is whole, so
    every rank routes a token to the same experts. None: all of them."""

    def __init__(self, cfg: ModelConfig, layer_id: int, fmt: str, expert_fmt: str, device,
                 tp: TensorParallel | None = None):
        self.cfg = cfg
        self.hash = layer_id < cfg.n_hash_layers
        E, D = cfg.n_routed_experts, cfg.dim
        cut = tp is not None and tp.world > 1
        i0, i1 = tp.split(cfg.moe_inter_dim) if cut else (0, cfg.moe_inter_dim)
        I, split = i1 - i0, ((i0, i1) if cut else None)
        self.gate = Linear(E, D, "bf16", device)
        # the file stores tid2eid as int64; the gate only gathers from it
        self.tid2eid = (torch.empty(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.int64,
                                    device=device) if self.hash else None)
        self.bias = None if self.hash else torch.empty(E, dtype=torch.float32, device=device)
        self.experts = ExpertBank(E, D, I, expert_fmt, device, split)
        self.hits: torch.Tensor | None = None   # [e] bool: set, prefill marks experts routed to
        self.shared = {w: Linear(*((D, I) if w == "w2" else (I, D)), fmt, device,
                                 split=split and ((1 if w == "w2" else 0), *split))
                       for w in ("w1", "w2", "w3")}
        self.reduce = tp.reduce if cut else same
        self.decode_rows = self.decode_rows_reference
        self.route_rows = self.route
        self.prefill_experts = self.prefill_experts_reference

    def linears(self) -> list:
        return [self.gate, *self.shared.values()]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        d = dict(self.gate.tensors(f"{prefix}.gate"))
        if self.hash:
            d[f"{prefix}.gate.tid2eid"] = self.tid2eid
        else:
            d[f"{prefix}.gate.bias"] = self.bias
        d.update(self.experts.tensors(f"{prefix}.experts"))
        for w, lin in self.shared.items():
            d.update(lin.tensors(f"{prefix}.shared_experts.{w}"))
        return d

    def parts(self, prefix: str) -> dict[str, Part]:
        """Checkpoint name -> the Part of it this rank holds (the experts' inter rows)."""
        d = self.experts.parts(f"{prefix}.experts")
        for w, lin in self.shared.items():
            d.update(lin.parts(f"{prefix}.shared_experts.{w}"))
        return d

    def route(self, x: torch.Tensor, ids: torch.Tensor):
        """x [t, D] act, ids [t] int64 -> weights [t, k] f32, indices [t, k] int64. Capture-safe."""
        cfg = self.cfg
        logits = self.gate(x, torch.float32)                                 # [t, e] f32
        if cfg.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif cfg.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hash:
            idx = self.tid2eid.index_select(0, ids)
        else:  # the bias only steers selection; weights use the raw scores
            idx = (scores + self.bias).topk(cfg.n_activated_experts, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        if cfg.score_func != "softmax":
            w = w / w.sum(dim=-1, keepdim=True)
        return w * cfg.route_scale, idx

    def _ffn(self, x: torch.Tensor, w1, w3, w2, route_w: torch.Tensor | None, quant: bool
             ) -> torch.Tensor:
        """Clamped SwiGLU over dense weights [I, D], [I, D], [D, I]; x [t, D] act -> [t, D] act.
        `quant`: W8A8 (inputs of w1/w3 and of w2 quantized to e4m3 per 128, as fp8/fp4_gemm)."""
        act, lim = x.dtype, self.cfg.swiglu_limit
        xq = fp8_quant_dequant(x, 128) if quant else x
        g = F.linear(xq, w1).float()
        u = F.linear(xq, w3).float()
        if lim > 0:
            u = u.clamp(-lim, lim)
            g = g.clamp(max=lim)
        a = F.silu(g) * u
        if route_w is not None:
            a = route_w.unsqueeze(-1) * a
        a = a.to(act)
        return F.linear(fp8_quant_dequant(a, 128) if quant else a, w2)

    def _routed(self, x: torch.Tensor, e: torch.Tensor, route_w: torch.Tensor) -> torch.Tensor:
        """Expert `e` ([1] int64 device tensor) applied to rows x [t, D] -> [t, D] act."""
        act, bank = x.dtype, self.experts
        return self._ffn(x, bank.dense("w1", e, act)[0], bank.dense("w3", e, act)[0],
                         bank.dense("w2", e, act)[0], route_w, bank.fmt in ("fp8", "fp4"))

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert of rows x [t, D] (torch) -> [t, D] act."""
        act = x.dtype
        return self._ffn(x, *(self.shared[w].dense(act) for w in ("w1", "w3", "w2")), None,
                         self.shared["w1"].quantized)

    def decode(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One token: x [1, D], ids [1] -> [1, D]. Fixed shapes, no host sync (capture-safe)."""
        return self.decode_rows(x, ids)

    def decode_rows_reference(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """T decode rows: x [T, D], ids [T] -> [T, D], one decode_one per row. Capture-safe."""
        return torch.cat([self.decode_one(x[t:t + 1], ids[t:t + 1]) for t in range(x.shape[0])])

    def decode_one(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The torch math of one token: the routed experts in ascending id order, then the
        shared one, summed in float32 (over the ranks too). Capture-safe."""
        w, idx = self.route(x, ids)
        idx, order = idx[0].sort()              # the reference adds experts in ascending id order
        w = w[0].index_select(0, order)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for j in range(idx.shape[0]):
            y = y + self._routed(x, idx[j:j + 1], w[j:j + 1])
        return self.reduce(y + self.shared_expert(x)).to(x.dtype)

    def prefill(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [t, D], ids [t] -> [t, D]: the routing (route_rows: `route` until the backend binds
        its kernel), then prefill_experts (in tensor parallel this rank's partial sum, float32
        or x's dtype: Block.prefill sums it)."""
        w, idx = self.route_rows(x, ids)
        if self.hits is not None:                    # the prefill benchmark's byte count
            self.hits.index_fill_(0, idx.reshape(-1), True)
        return self.prefill_experts(x, w, idx)

    def prefill_experts_reference(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor
                                  ) -> torch.Tensor:
        """Rows x [t, D] routed to idx [t, k] with weights w -> [t, D] float32: a loop over the
        experts that got rows (a host sync: prefill only), then the shared expert, summed in
        float32 (in tensor parallel this rank's partial; the block sums over the ranks)."""
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            e_t = torch.tensor([e], device=x.device)
            y[rows] += self._routed(x[rows], e_t, w[rows, slot]).float()
        return y + self.shared_expert(x)
