"""Toy decoder for the graphs tests: embed -> tanh layers with running-sum state -> greedy head
(plus a fake `nvtx` module that records ranges).

Legend: d = hidden width, v = vocab, p = positions. Each layer computes
h = tanh(h @ W_l + b_l[pos] + 0.1 * acc_l) and then acc_l += h (in-place state); the head writes
logits, argmax into the "token" input and pos + 1 into the "pos" input for the next step.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from graphs import BufferSpec, Segment

D, VOCAB, MAX_POS = 16, 32, 256
START_TOKEN, START_POS = 3, 1  # realistic dummies: a valid token and a position >= 1


class ToyModel:
    """Layer l runs on layer_devices[l]; embed on layer_devices[0]; head on `head_device` (primary).

    `head_reads_copy` gives the head its own "h" buffer even on the layers' device (a same-device
    hand-off copy instead of a shared buffer).
    """

    def __init__(self, layer_devices: Sequence[torch.device | str], head_device: torch.device | str,
                 *, seed: int = 0, head_reads_copy: bool = False, dtype=torch.float32):
        self.layer_devices = [torch.device(d) for d in layer_devices]
        self.head_device = torch.device(head_device)
        self.n_layers = len(self.layer_devices)
        g = torch.Generator().manual_seed(seed)
        # weights drawn on CPU then moved, so every placement computes with the same numbers
        self.emb = torch.randn(VOCAB, D, generator=g, dtype=dtype)                      # [v, d]
        self.W = [torch.randn(D, D, generator=g, dtype=dtype) * 0.5 for _ in self.layer_devices]
        self.b = [torch.randn(MAX_POS, D, generator=g, dtype=dtype) * 0.1 for _ in self.layer_devices]
        self.Wout = torch.randn(D, VOCAB, generator=g, dtype=dtype)                     # [d, v]
        dev0 = self.layer_devices[0]
        self.emb = self.emb.to(dev0)
        self.W = [w.to(d) for w, d in zip(self.W, self.layer_devices)]
        self.b = [b.to(d) for b, d in zip(self.b, self.layer_devices)]
        self.Wout = self.Wout.to(self.head_device)
        hd = self.head_device
        self.token = BufferSpec("token", (1,), torch.int64, hd, START_TOKEN).allocate()  # [1]
        self.pos = BufferSpec("pos", (1,), torch.int64, hd, START_POS).allocate()        # [1]
        self.logits = BufferSpec("logits", (1, VOCAB), dtype, hd).allocate()              # [1, v]
        # one "h" [1, d] and one "pos"/"token" copy per device (shared by its layers)
        self.h = {d: BufferSpec("h", (1, D), dtype, d).allocate() for d in self._devices()}
        self.pos_on = {d: (self.pos if d == hd else BufferSpec("pos", (1,), torch.int64, d, 1).allocate())
                       for d in self._devices()}
        self.token_in = (self.token if dev0 == hd
                         else BufferSpec("token", (1,), torch.int64, dev0, 0).allocate())
        self.h_head = (BufferSpec("h", (1, D), dtype, hd).allocate()
                       if head_reads_copy or hd not in self.h else self.h[hd])
        self.acc = [BufferSpec(f"acc{l}", (1, D), dtype, d).allocate()
                    for l, d in enumerate(self.layer_devices)]

    def _devices(self) -> list[torch.device]:
        return list(dict.fromkeys([*self.layer_devices, self.head_device]))

    def reset(self) -> None:
        """Undo what warm-up steps did to the state."""
        for a in self.acc:
            a.zero_()

    def inputs(self) -> dict[str, torch.Tensor]:
        return {"token": self.token, "pos": self.pos}

    def outputs(self) -> dict[str, torch.Tensor]:
        return {"logits": self.logits, "token": self.token}

    def segments(self) -> list[Segment]:
        dev0 = self.layer_devices[0]
        h0 = self.h[dev0]

        def embed():  # capture-safe: index_select with a device index tensor
            torch.index_select(self.emb, 0, self.token_in, out=h0)

        segs = [Segment("embed", dev0, embed, reads={"token": self.token_in}, writes={"h": h0})]
        for l, d in enumerate(self.layer_devices):
            segs.append(Segment(f"layer{l}", d, self._layer_fn(l),
                                reads={"h": self.h[d], "pos": self.pos_on[d], f"acc{l}": self.acc[l]},
                                writes={"h": self.h[d], f"acc{l}": self.acc[l]}, group=str(d)))

        def head():
            torch.matmul(self.h_head, self.Wout, out=self.logits)     # [1, v]
            self.token.copy_(self.logits.argmax(-1))                  # [1]
            self.pos.add_(1)

        segs.append(Segment("head", self.head_device, head,
                            reads={"h": self.h_head, "pos": self.pos},
                            writes={"logits": self.logits, "token": self.token, "pos": self.pos}))
        return segs

    def _layer_fn(self, l: int):
        d = self.layer_devices[l]
        h, pos, acc, W, b = self.h[d], self.pos_on[d], self.acc[l], self.W[l], self.b[l]

        def layer():
            y = torch.tanh(h @ W + b.index_select(0, pos) + 0.1 * acc)  # [1, d]
            acc.add_(y)
            h.copy_(y)
        return layer


def reference(model: ToyModel, n_steps: int, forced: Sequence[int] | None = None,
              token: int = START_TOKEN, pos: int = START_POS):
    """Plain python loop on CPU copies of the weights: (tokens chosen, logits per step).

    With `forced`, step t feeds forced[t] instead of the previous step's argmax.
    """
    emb, Wout = model.emb.cpu(), model.Wout.cpu()
    W, b = [w.cpu() for w in model.W], [x.cpu() for x in model.b]
    acc = [torch.zeros(1, D, dtype=emb.dtype) for _ in W]
    tokens, logits = [], []
    for t in range(n_steps):
        if forced is not None:
            token = forced[t]
        h = emb[token].reshape(1, D)
        for l in range(len(W)):
            y = torch.tanh(h @ W[l] + b[l][pos].reshape(1, D) + 0.1 * acc[l])
            acc[l] += y
            h = y
        lg = h @ Wout
        token = int(lg.argmax(-1))
        pos += 1
        tokens.append(token)
        logits.append(lg)
    return tokens, torch.cat(logits)


class FakeNvtx:
    """Stands in for the `nvtx` package: records pushes per domain."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def get_domain(self, name):
        fake = self

        class Domain:
            def get_event_attributes(self, message=None):
                return message

            def push_range(self, attrs):
                fake.events.append((name, attrs))

            def pop_range(self):
                fake.events.append((name, ")"))
        return Domain()


def run(dec, n: int, forced=None, eager_every: int = 0):
    """n steps of a decoder (optionally teacher-forced, or eager every k-th step) -> tokens, logits."""
    tokens, logits = [], []
    for t in range(n):
        kw = {"token": forced[t]} if forced is not None else {}
        out = dec.eager_step(**kw) if eager_every and t % eager_every == 0 else dec.step(**kw)
        tokens.append(out["token"].clone())
        logits.append(out["logits"].clone())  # a view: copy before the next step overwrites it
    return torch.cat(tokens).cpu(), torch.cat(logits).cpu()


def assert_graph_equals_eager(eager, graph, n: int) -> None:
    """Graph replay gives the eager decoder's tokens and logits bit for bit; then close both."""
    e_tok, e_log = run(eager, n)
    g_tok, g_log = run(graph, n)
    assert torch.equal(g_tok, e_tok)
    assert torch.equal(g_log, e_log)
    assert len(set(g_tok.tolist())) > 3
    eager.close(), graph.close()
