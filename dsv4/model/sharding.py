"""Tensor-parallel sharding of the model: which slice of each weight a rank holds, the degrees a
config allows, and the collectives the math needs (bound once at build, none in one process).

What is split (world = the tensor-parallel degree, each rank one slice, in rank order):
  attention  heads: wq_b's rows and attn_sink of the local heads, wo_a's rows of the local
             output groups, wo_b's columns of them -> a float32 all-reduce after wo_b
  MoE        every routed expert and the shared expert along moe_inter_dim: w1 / w3 rows, w2
             columns (every rank routes the token alike and runs the same k experts on its
             slice) -> one float32 all-reduce of the layer's output
  head       vocabulary rows (padded to world x ceil(V / world); the pad rows are zeros and are
             cut off) -> an all-gather of the logits, so every rank holds all of them
  prefill    a chunk's rows for the blocks' mHC (sequence parallel, where the rows split evenly
             and the backend's switch is on: Transformer.prefill_chunk): each rank mixes and
             posts its rows only, an all-gather gives every rank the sublayer's input rows, a
             reduce-scatter each rank its rows of the sublayer's sum (the bytes of the all-reduce
             it replaces); the indexer's queries of such a chunk too: each rank selects its
             rows' compressed entries, an all-gather gives every rank all of them
Replicated: the embedding, wq_a / wkv / norms, the compressors, the indexer's weights (in decode
its scores are computed whole on every rank: no all-reduce of them, unlike the reference), the
gate, mHC (in decode) and the decode state (MQA shares one KV). Legend: T = rows, V =
vocabulary, Vs = a rank's vocab rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..weights.config import ModelConfig
from ..weights.formats import FP8_BLOCK

TP_DEGREES = (1, 2, 4, 8)


def same(y: torch.Tensor) -> torch.Tensor:
    """The collective of one process: nothing to sum."""
    return y


def split_problems(cfg: ModelConfig, world: int) -> list[str]:
    """Why `world` ranks cannot split cfg's weights ([] when they can)."""
    H, G, I, R, Dh = cfg.n_heads, cfg.o_groups, cfg.moe_inter_dim, cfg.o_lora_rank, cfg.head_dim
    out = [f"{k} = {n} is not a multiple of {world}"
           for k, n in (("n_heads", H), ("o_groups", G), ("moe_inter_dim", I)) if n % world]
    if out:
        return out
    # a quantized weight's 128-blocks (and the activation's quantization blocks of 128 in front
    # of wo_b and w2) must not straddle two ranks: a rank would scale its half by the other's
    # values, and the one-process numerics would be lost
    blocks = []
    if cfg.quantized:
        blocks += [("wq_b rows (n_heads / world x head_dim)", H // world * Dh),
                   ("wo_a rows, wo_b columns (o_groups / world x o_lora_rank)", G // world * R),
                   ("shared expert rows (moe_inter_dim / world)", I // world)]
    if cfg.expert_format in ("fp8", "fp4"):
        blocks.append(("routed expert rows (moe_inter_dim / world)", I // world))
    return [f"{what} = {n} is not a multiple of {FP8_BLOCK} (the quantization block)"
            for what, n in dict(blocks).items() if n % FP8_BLOCK]


def check_degree(cfg: ModelConfig, world: int) -> None:
    """ConfigError unless `world` ranks can split cfg (TP_DEGREES; see split_problems)."""
    if isinstance(world, bool) or world not in TP_DEGREES:
        raise ConfigError(f"tp = {world!r}; allowed: {', '.join(map(str, TP_DEGREES))} (the "
                          f"tensor-parallel degree: ranks, one device each)")
    problems = split_problems(cfg, world)
    if problems:
        ok = [d for d in TP_DEGREES if not split_problems(cfg, d)]
        raise ConfigError(f"tp = {world}: this model cannot be split over {world} ranks: "
                          f"{'; '.join(problems)}. Use tp = {' or '.join(map(str, ok))} (or "
                          f"the pipeline mode: layers over devices)")


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel model: its slices and its collectives.

    comm: the rank's communicator (dsv4.parallel.Communicator: rank, world, all_reduce,
    all_gather); None builds the rank's shapes only (the meta device: sizes, bytes)."""
    rank: int
    world: int
    comm: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"tensor-parallel rank {self.rank} of {self.world}: expected "
                              f"0 <= rank < world")

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of n elements split evenly (n a multiple of world)."""
        assert n % self.world == 0, f"{n} elements over {self.world} ranks"
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """This rank's [start, stop) of the head's rows: ceil(V / world) a rank, the last rank's
        past V padded with zero rows (their logits are cut off after the gather)."""
        k = -(-vocab // self.world)
        return self.rank * k, (self.rank + 1) * k

    def shapes(self, cfg: ModelConfig) -> ModelConfig:
        """cfg with the sizes one rank holds (n_heads, o_groups, moe_inter_dim / world): what the
        backend's shape checks read (the model's math reads its modules' own sizes)."""
        w = self.world
        return cfg.replace(n_heads=cfg.n_heads // w, o_groups=cfg.o_groups // w,
                           moe_inter_dim=cfg.moe_inter_dim // w)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """y [..., D], this rank's partial sum (any float dtype; contiguous) -> the sum over the
        ranks in float32, cast back to y's dtype (as the reference's row-parallel linears; a
        float32 y is summed in place). Where the all-reduce that serves y itself sums in float32
        and rounds once (our one-shot kernel: Communicator.sums_in_float32), y is summed in place
        in its own dtype: the same bits, without the two casts (two launches a reduce) and with
        half the bytes. Capture-safe where the communicator is."""
        if y.dtype == torch.float32 or (y.is_contiguous() and self.comm.sums_in_float32(y)):
            return self.comm.all_reduce(y)
        y32 = y.float()
        self.comm.all_reduce(y32)
        return y32.to(y.dtype)

    def reduce_scatter(self, y: torch.Tensor) -> torch.Tensor:
        """y [T, D], this rank's partial sum (T a multiple of world) -> rows split(T) of the sum
        over the ranks, in float32 cast back to y's dtype (as reduce; where the reduce-scatter
        itself sums in float32 and rounds once, in y's own dtype: the same bits)."""
        y = y.contiguous()
        if y.dtype == torch.float32 or self.comm.scatter_sums_in_float32(y.dtype):
            return self.comm.reduce_scatter(y)
        return self.comm.reduce_scatter(y.float()).to(y.dtype)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, ...], this rank's rows split(world * n) -> [world * n, ...]: every rank's rows
        in rank order (the same bits on every rank)."""
        return self.comm.all_gather(x.contiguous())

    def reduce_post(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor,
                    comb: torch.Tensor, post_fn, out: torch.Tensor | None = None) -> torch.Tensor:
        """post_fn(reduce(y), res, post, comb, out=out): a sublayer's partial output y [T, D]
        summed over the ranks and put into the block's mHC streams (res [T, c, D], post [T, c],
        comb [T, c, c]; post_fn: hc_post's signature). In one launch where the all-reduce serving
        y adds the post itself (Communicator.all_reduce_post: our one-shot kernel; its sum the
        bits of reduce's, the post in a float order of its own); otherwise reduce, then post_fn.
        Which of the two goes by sizes and dtypes: the same on every rank and every run.
        Capture-safe where the communicator is."""
        if out is None:
            out = torch.empty_like(res)
        if y.is_contiguous() and self.comm.all_reduce_post(y, res, post, comb, out):
            return out
        return post_fn(self.reduce(y), res, post, comb, out=out)

    def gather(self, local: torch.Tensor, vocab: int, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """local [T, Vs] float32, this rank's logits -> [T, V] (into out if given): every rank's
        rows in rank order, the padding cut off; the same bits on every rank."""
        T, Vs = local.shape
        g = self.comm.all_gather(local.contiguous())                  # [world * T, Vs]
        full = g.view(self.world, T, Vs).permute(1, 0, 2).reshape(T, self.world * Vs)
        if out is None:
            return full[:, :vocab].contiguous()
        return out.copy_(full[:, :vocab])


def rank_place(cfg: ModelConfig, world: int, comm, devices) -> TensorParallel | None:
    """The TensorParallel of a model built for `world` ranks (RuntimeConfig.tp) with this rank's
    communicator `comm` on `devices` (the rank's one device); None in one process. Without a
    communicator only the meta device is allowed (rank 0's shapes: sizes and bytes)."""
    if world == 1:
        if comm is not None and comm.world != 1:
            raise ConfigError(f"a communicator of {comm.world} ranks was given, but "
                              f"RuntimeConfig.tp = 1; set tp = {comm.world}")
        return None
    check_degree(cfg, world)
    if comm is None:
        if all(torch.device(d).type == "meta" for d in devices):
            return TensorParallel(0, world)
        raise ConfigError(f"RuntimeConfig.tp = {world} needs this rank's communicator: build "
                          f"the model with build_model(cfg, rt, comm=...) in each rank's process "
                          f"(dsv4.runtime.tp loads and runs the ranks)")
    if comm.world != world:
        raise ConfigError(f"RuntimeConfig.tp = {world}, but the communicator joins {comm.world} "
                          f"ranks; start {world} ranks or set tp = {comm.world}")
    if torch.device(devices[0]) != comm.device:
        raise ConfigError(f"rank {comm.rank}'s model is on {devices[0]} but its communicator on "
                          f"{comm.device}; build each rank's model on its group's device")
    return TensorParallel(comm.rank, world, comm)
