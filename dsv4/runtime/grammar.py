"""The token mask of constrained decoding (structured output) on the device: a static additive
bias [V] f32 (0 where the grammar allows a token, -inf where it does not) that the decode step's
sampling adds to the logits, and the host's side of it: before each step a `Constraint` (the
grammar library's matcher, dsv4/server/structured.py) fills a bitmask [W] int32 (W = ceil(V / 32),
bit i of word i // 32 for token i, the layout xgrammar and llguidance write), which `load` copies
to the device and unpacks into the bias.

Capture: the step adds the bias on every step (one elementwise op over V; a cleared bias is 0, and
x + 0 == x bit for bit, so an unconstrained request samples exactly as without it). Eager steps
(the CPU) skip the add while no constraint is loaded.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Constraint(Protocol):
    """What a grammar matcher offers the decode loop (host side)."""

    def fill(self, bitmask: torch.Tensor) -> None:
        """Write the allowed next tokens into bitmask [W] int32 (CPU)."""

    def accept(self, token: int) -> None:
        """The token was chosen (from the allowed ones): advance."""


class TokenMask:
    """The static bias the sampling adds, its host-side bitmask and the unpacking indices.
    graph: the step is captured (it always adds the bias); else it adds it only while active."""

    def __init__(self, device, vocab_size: int, graph: bool):
        dev = torch.device(device)
        self.vocab_size, self.graph, self.active = vocab_size, graph, False
        words = -(-vocab_size // 32)
        ids = torch.arange(vocab_size, dtype=torch.int64, device=dev)
        self.word = ids >> 5                                   # [V] int64: word of token i
        self.shift = (ids & 31).to(torch.int32)                # [V] int32: its bit in the word
        self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=dev)       # [V]
        self.bits = torch.zeros(words, dtype=torch.int32, device=dev)              # [W]
        self.host = torch.zeros(words, dtype=torch.int32, pin_memory=dev.type == "cuda")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] f32 -> the logits the sampling reads (not in place). Capture-safe."""
        if self.graph or self.active:
            return logits + self.bias
        return logits

    def load(self, constraint: Constraint) -> None:
        """The constraint's bitmask for the next token -> the bias, ordered on the current
        stream before the next step (the host buffer is reused after the copy is done: the
        caller syncs on each token of a constrained request anyway)."""
        constraint.fill(self.host)
        self.bits.copy_(self.host, non_blocking=self.host.is_pinned())
        allowed = (self.bits.index_select(0, self.word) >> self.shift) & 1     # [V] int32
        self.bias.zero_().masked_fill_(allowed == 0, float("-inf"))
        self.active = True

    def clear(self) -> None:
        """No constraint: every token allowed (the bias 0)."""
        if self.active:
            self.bias.zero_()
        self.active = False
