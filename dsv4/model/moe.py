"""MoE of one layer: the gate (score / hash routing), routed experts (clamped SwiGLU) and the shared
expert (DSV4_SPEC §3.6). Legend: t = tokens, e = routed experts, k = activated per token,
D = dim, I = moe_inter_dim. `decode` never syncs with the host; `prefill` may (it is not captured),
though its kernel path does not. The routing, routed experts and shared expert run on the kernels
where the device's backend says so (self.ops), else as the torch loop over the experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import branches
from ..weights.config import ModelConfig
from .linear import ExpertBank, Linear
from ..backend.ops import Ops
from ..numerics.quant import fp8_quant_dequant


class MoE:
    def __init__(self, cfg: ModelConfig, layer_id: int, fmt: str, expert_fmt: str, device,
                 ops: Ops | None = None):
        self.cfg = cfg
        self.ops = ops = ops or Ops.for_device(device, cfg=cfg)
        self.hash = layer_id < cfg.n_hash_layers
        E, D, I = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
        self.gate = Linear(E, D, "bf16", device, ops)
        # the file stores tid2eid as int64; the gate only gathers from it
        self.tid2eid = (torch.empty(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.int64,
                                    device=device) if self.hash else None)
        self.bias = None if self.hash else torch.empty(E, dtype=torch.float32, device=device)
        self.experts = ExpertBank(E, D, I, expert_fmt, device)
        self._down_ws = None      # the CUDA down kernel's workspace, lazily; (): none needed
        self.hits: torch.Tensor | None = None   # [e] bool: set, prefill marks experts routed to
        self.shared = {w: Linear(*((D, I) if w == "w2" else (I, D)), fmt, device, ops)
                       for w in ("w1", "w2", "w3")}

    def set_ops(self, ops: Ops) -> None:
        self.ops = self.gate.ops = ops
        for lin in self.shared.values():
            lin.ops = ops

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

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        act = x.dtype
        return self._ffn(x, *(self.shared[w].dense(act) for w in ("w1", "w3", "w2")), None,
                         self.shared["w1"].quantized)

    def decode(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One token: x [1, D], ids [1] -> [1, D]. Fixed shapes, no host sync (capture-safe)."""
        if self.ops.backend.moe_decode:
            return self._decode_kernels(x, ids)
        w, idx = self.route(x, ids)
        idx, order = idx[0].sort()              # the reference adds experts in ascending id order
        w = w[0].index_select(0, order)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for j in range(idx.shape[0]):
            y = y + self._routed(x, idx[j:j + 1], w[j:j + 1])
        return (y + self._shared(x)).to(x.dtype)

    def route_decode(self, x: torch.Tensor, ids: torch.Tensor):
        """decode's routing of rows x [T, D] (T = 1, or the speculative verify rows) as two
        launches (gate GEMV, the CUDA or Triton routing kernel: dsv4.kernels.decode.route): ->
        (weights [T * k] f32, experts [T * k] int64, ascending per row), as route + sort."""
        cfg = self.cfg
        return self.ops.route_decode(self.gate.rows(x, torch.float32), cfg.n_activated_experts,
                                     cfg.score_func, cfg.route_scale, bias=self.bias,
                                     tid2eid=self.tid2eid, ids=ids if self.hash else None)

    def decode_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """T decode rows (the speculative verify rows): x [T, D], ids [T] -> [T, D], row t with
        the bits of decode(x[t:t+1], ids[t:t+1]): the kernels' path for all rows at once, else
        decode row by row. Capture-safe."""
        if self.ops.backend.moe_decode:
            return self._decode_kernels(x, ids)
        return torch.cat([self.decode(x[t:t + 1], ids[t:t + 1]) for t in range(x.shape[0])])

    def _decode_kernels(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """decode of rows x [T, D] as kernel launches, each taking every row: the gate GEMV and
        the routing (route_decode), routed FP4 up + down with the shared expert's output added in
        down's epilogue; the FP8 shared expert (fused w1/w3 SwiGLU, w2) is a parallel branch when
        captured (dsv4.backend.branches), forked after the routing (so the routing's small kernels find
        free SMs; the shared expert then streams beside up). Same math as the loop: bf16(routed
        sum in f32 + bf16 shared); row t has the bits of a one-row call. Capture-safe."""
        ops, bank, lim, sh = self.ops, self.experts, self.cfg.swiglu_limit, self.shared
        T, fp8 = x.shape[0], sh["w1"].fmt == "fp8"
        w, idx = self.route_decode(x, ids)                  # [T * k]: row t's experts, sorted
        br = branches.Branch(x, "moe", ops.backend.branches, when=fp8)
        with br.side():
            if fp8:
                a_sh = ops.fp8_swiglu(x, sh["w1"].weight, sh["w1"].scale, sh["w3"].weight,
                                      sh["w3"].scale, lim)
                y_sh = ops.fp8_linear(a_sh, sh["w2"].weight, sh["w2"].scale, out_dtype=x.dtype)
            else:
                y_sh = (self._shared(x) if T == 1 else
                        torch.cat([self._shared(x[t:t + 1]) for t in range(T)]))   # [T, D] act
        a = ops.fp4_experts_up(x, idx, w, bank.w1, bank.w1_scale, bank.w3, bank.w3_scale, lim)
        br.join()
        if self._down_ws is None:   # decided once: this layer's own (no two layers share one);
            # the launches of one layer run in order on one stream, so its rows share it
            self._down_ws = ops.down_workspace(idx.numel() // T, a.shape[-1], x)
        return ops.fp4_experts_down(a, idx, bank.w2, bank.w2_scale, add=y_sh, out_dtype=x.dtype,
                                    workspace=self._down_ws or None, rows=T)

    def prefill(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [t, D], ids [t] -> [t, D]. bf16 rows where the kernels serve: the (token, expert)
        pairs grouped by expert through the stored-format GEMMs (no host sync, no dense weight
        copy); otherwise a loop over the experts that got tokens (a host sync: prefill only)."""
        w, idx = self.route(x, ids)
        if self.hits is not None:                    # the prefill benchmark's byte count
            self.hits.index_fill_(0, idx.reshape(-1), True)
        if self.ops.backend.moe_prefill:
            return self._prefill_grouped(x, w, idx)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            e_t = torch.tensor([e], device=x.device)
            y[rows] += self._routed(x[rows], e_t, w[rows, slot]).float()
        return (y + self._shared(x)).to(x.dtype)

    def _prefill_grouped(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor
                         ) -> torch.Tensor:
        """prefill over dsv4.kernels.prefill.moe: x act-quantized (once where routed and shared
        use one tensor-core path), routed up (w1, w3, SwiGLU, route weight, act quant) and down
        per expert tile,
        the shared expert, then each token's sum in ascending expert order plus the shared
        output, as the reference's loop."""
        G, tn = self.ops.prefill_moe, self.ops.tuning
        bank, sh, lim = self.experts, self.shared, self.cfg.swiglu_limit
        idx, order = idx.sort(dim=1)              # the reference adds experts in ascending id
        plan = G.expert_plan(idx, w.gather(1, order), bank.n_experts, bank.fmt, tuning=tn)
        xr = G.Rows.of(x, bank.fmt, tn)
        n = x.shape[0]
        same = G.Rows.kind(sh["w1"].fmt, n, tn) == G.Rows.kind(bank.fmt, n, tn)
        xs = xr if same else G.Rows.of(x, sh["w1"].fmt, tn)
        a = G.moe_up(xr, plan, bank.w1, bank.w1_scale, bank.w3, bank.w3_scale, bank.fmt, lim)
        o = G.moe_down(a, plan, bank.w2, bank.w2_scale, bank.fmt)
        y_sh = G.shared_expert(xs, sh["w1"].weight, sh["w1"].scale, sh["w3"].weight,
                               sh["w3"].scale, sh["w2"].weight, sh["w2"].scale, sh["w1"].fmt, lim,
                               tuning=tn)
        return G.moe_combine(o, plan, y_sh)
