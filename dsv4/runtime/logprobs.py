"""Log-probabilities of tokens, as the OpenAI API returns them: for each chosen token its
log-probability and the TOP_MAX most likely alternatives, from the logits the step sampled from
(log-softmax of the raw logits: before temperature, top-p / top-k and a grammar mask, as vLLM's
default `raw_logprobs`), and for each prompt token the same from the prompt's own pass.

Generated tokens: `LogprobStep` is a one-segment pass after the decode step (its own small graph
in graph mode, replayed only for a request that asks, so the plain step computes nothing more)
that reads the step's static logits and chosen token and writes static buffers the host copies
with the token. Prompt tokens: `prompt_logprobs` feeds the prompt through the layers a chunk at a
time and reads every row's logits (the teacher-forced logits of the prompt).

Legend: V = vocabulary, K = TOP_MAX, s = rows of a chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from graphs import BufferSpec, CUDAGraphDecoder, Segment

TOP_MAX = 20          # the most alternatives a request may ask for (OpenAI's top_logprobs limit)
HEAD_ROWS = 16        # prompt rows whose logits [rows, V] f32 exist at once


@dataclass
class TokenLogprobs:
    """One token's entry: its id, its log-probability and the top alternatives [(id, logprob)]
    in descending order (TOP_MAX of them; a request keeps its first k)."""
    token: int
    logprob: float
    top: list = field(default_factory=list)


@dataclass
class LogprobBuffers:
    """Static outputs of LogprobStep (fill 0): values [1 + K] f32 (the chosen token's log-prob,
    then the top K descending) and ids [K] int64 (the top K's ids), on the head device."""
    values: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def allocate(cls, device) -> "LogprobBuffers":
        return cls(BufferSpec("lp_values", (1 + TOP_MAX,), torch.float32, device).allocate(),
                   BufferSpec("lp_ids", (TOP_MAX,), torch.int64, device).allocate())


def write_logprobs(logits: torch.Tensor, token: torch.Tensor, out: LogprobBuffers) -> None:
    """logits [V] f32, token [1] int64 (the chosen one) -> out.values, out.ids in place.
    Capture-safe (fixed shapes, no host sync)."""
    lp = torch.log_softmax(logits, dim=-1)                         # [V]
    top = torch.topk(lp, TOP_MAX)                                  # [K] sorted descending
    out.values[:1].copy_(lp.gather(0, token))
    out.values[1:].copy_(top.values)
    out.ids.copy_(top.indices)


class LogprobStep:
    """The log-probabilities of the token a decode step chose, from that step's logits: run()
    right after the step (graph replay in graph mode), then read() or copy_to() the buffers."""

    def __init__(self, logits: torch.Tensor, token: torch.Tensor, mode: str):
        self.bufs = LogprobBuffers.allocate(logits.device)
        bufs = self.bufs

        def fn():
            write_logprobs(logits, token, bufs)
        # reads the decode step's logits and token (written by the other decoder: not hand-offs)
        seg = Segment("logprobs", logits.device, fn, reads={},
                      writes={"lp_values": bufs.values, "lp_ids": bufs.ids})
        self.decoder = CUDAGraphDecoder([seg], inputs={},
                                        outputs={"lp_values": bufs.values, "lp_ids": bufs.ids},
                                        mode=mode, nvtx_domain="dsv4-logprobs")
        self.decoder.allocate()
        if mode == "graph":
            self.decoder.warmup()
            self.decoder.capture()

    def run(self) -> None:
        self.decoder.step()

    def of(self, logits: torch.Tensor, token: torch.Tensor) -> None:
        """The same for logits and a token outside the step (the first token, from the prompt's
        logits), eagerly, into the same buffers."""
        write_logprobs(logits, token.reshape(1), self.bufs)

    def host_slots(self, n: int, pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers for n tokens' entries: ([n, 1 + K] f32, [n, K] int64)."""
        return (torch.empty(n, 1 + TOP_MAX, dtype=torch.float32, pin_memory=pinned),
                torch.empty(n, TOP_MAX, dtype=torch.int64, pin_memory=pinned))

    def copy_to(self, slots, i: int, non_blocking: bool) -> None:
        values, ids = slots
        values[i].copy_(self.bufs.values, non_blocking=non_blocking)
        ids[i].copy_(self.bufs.ids, non_blocking=non_blocking)

    def close(self) -> None:
        self.decoder.close()


def entry(token: int, values: torch.Tensor, ids: torch.Tensor) -> TokenLogprobs:
    """values [1 + K] f32, ids [K] int64 on the host -> the token's TokenLogprobs."""
    vals = values.tolist()
    return TokenLogprobs(token, vals[0], list(zip(ids.tolist(), vals[1:])))


@torch.inference_mode()
def prompt_logprobs(model, ids: Sequence[int], chunk: int) -> tuple[list, torch.Tensor]:
    """Feed ids [n] from position 0 (the model state is reset and then holds them, as a prefill
    leaves it) -> ([None] + [TokenLogprobs of ids[i] given ids[:i] for i in 1..n-1], the logits
    [V] f32 after the last id). Every row's logits come from the rows' pass through the layers
    (`chunk` rows at a time), the same numbers up to float summation order as feeding the ids
    one decode step at a time (teacher forcing). May sync with the host."""
    hd = model.head_device
    ids_t = torch.tensor(list(ids), dtype=torch.int64, device=hd)
    n = ids_t.shape[0]
    out: list = [None]
    last = None
    for c0 in range(0, n, chunk):
        h = model.hidden(ids_t[c0:c0 + chunk], c0).to(hd)                # [s, c, D]
        for r0 in range(0, h.shape[0], HEAD_ROWS):
            logits = model.logits_rows(h[r0:r0 + HEAD_ROWS])             # [rows, V] f32
            p0 = c0 + r0                                                 # row r: position p0 + r
            nxt = ids_t[p0 + 1:p0 + 1 + logits.shape[0]]                 # the ids they predict
            if nxt.shape[0]:
                lp = torch.log_softmax(logits[:nxt.shape[0]], dim=-1)
                chosen = lp.gather(1, nxt[:, None])[:, 0].tolist()
                top = torch.topk(lp, TOP_MAX, dim=-1)
                for t, c, tv, ti in zip(nxt.tolist(), chosen, top.values.tolist(),
                                        top.indices.tolist()):
                    out.append(TokenLogprobs(t, c, list(zip(ti, tv))))
            last = logits[-1]
    return out, last.clone()
