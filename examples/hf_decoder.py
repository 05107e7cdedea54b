"""Embedding a Hugging Face `transformers` decoder-only model (Llama, Qwen2, Mixtral, Qwen2-MoE) in
graphs.CUDAGraphDecoder without changing the model's code: one segment per decoder layer over the
model's own StaticCache, plus an embed and a greedy head segment, optionally split over GPUs.

Run:   python -m examples.hf_decoder            # a tiny random Llama: eager on CPU, graphs on GPU
       python -m examples.hf_decoder --family mixtral --devices cuda:0,cuda:1
Needs: transformers >= 5.24 (`pip install -e ".[dev]"`). Legend: d = hidden size, v = vocab,
L = cache capacity (max_seq_len), e = head_dim (the rotary width), n = prompt length.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import transformers
from transformers import StaticCache
from transformers.cache_utils import StaticLayer
from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function,
                                        create_causal_mask)

from graphs import BufferSpec, CUDAGraphDecoder, LiveBuffers, Segment, balanced_placement

# a tiny shape (random weights, no download); the wider-than-default init makes the greedy choice
# decisive (top-1/top-2 logit margins ~1e-3, float32 noise ~1e-7)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.05)
FAMILIES = {                         # config class, extra config fields
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64,
                                         shared_expert_intermediate_size=128)),
}
MASKS = ("sdpa", "eager")            # attention implementations whose decode mask we build
GRAPH_SAFE_EXPERTS = ("batched_mm",)  # "eager" loops over nonzero() experts; grouped_mm: untested


def build_model(family: str = "llama", *, seed: int = 0, dtype=torch.float32, device="cpu",
                **overrides) -> torch.nn.Module:
    """A random-weight `*ForCausalLM` of `family`, built from its config class on `device` (no
    download). No bos/eos/pad ids (generate() runs every requested token); MoE families use the
    library's "batched_mm" experts (fixed shapes, capture-safe). `overrides` replace config fields.
    """
    cfg_name, extra = FAMILIES[family]
    kw = {**TINY, **extra, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
          "tie_word_embeddings": False, **overrides}
    if family in ("mixtral", "qwen2_moe"):
        kw.setdefault("experts_implementation", "batched_mm")
    config = getattr(transformers, cfg_name)(**kw)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:                                     # initialised where it will run
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


SUPPORTED = ((5, 24), (6, 0))    # transformers [5.24, 6): the layer call and cache API used below


def transformers_supported(version: str | None = None) -> bool:
    """Whether this transformers version has the decoder-layer and StaticCache API the segments
    call (the `cache=` argument, StaticLayer's device-side cumulative_length); older ones take the
    cache under another name and silently attend to the current token only."""
    parts = (version or transformers.__version__).split(".")
    try:
        v = (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0))
    except (IndexError, ValueError):
        return False
    return SUPPORTED[0] <= v < SUPPORTED[1]


def check_supported(model, graph: bool) -> None:
    """Raise ValueError unless this model's decode step can be cut into the segments below (and,
    with `graph`, captured): a supported transformers, an sdpa/eager mask, a static RoPE,
    capture-safe experts. (Sliding-window caches are refused where the cache is built.)"""
    if not transformers_supported():
        raise ValueError(f"transformers {transformers.__version__}: the segments call the layer "
                         "and StaticCache API of transformers >= 5.24, < 6. Fix: pip install "
                         "'transformers>=5.24,<6' (the 'dev' extra); escape hatch: the model's "
                         "own generate().")
    cfg = model.config
    if cfg._attn_implementation not in MASKS:
        raise ValueError(f"attn_implementation={cfg._attn_implementation!r}: the decode mask is "
                         f"built for {MASKS}. Fix: model.set_attn_implementation('sdpa'); escape "
                         "hatch: the model's own generate().")
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope or rope == "longrope":
        raise ValueError(f"rope_type={rope!r} recomputes its frequencies from max(position) on the "
                         "host at every step (not capture-safe). Fix: a static rope_type (default, "
                         "linear, llama3, yarn); escape hatch: the model's own generate().")
    experts = getattr(cfg, "_experts_implementation", None)
    moe = any(hasattr(m, "gate_up_proj") for m in model.modules())
    if graph and moe and experts not in GRAPH_SAFE_EXPERTS:
        raise ValueError(f"experts_implementation={experts!r} is not known to be capture-safe "
                         "('eager' loops over nonzero() experts on the host). Fix: "
                         "model.set_experts_implementation('batched_mm'); escape hatch: "
                         "mode='eager'.")


class HFGraphDecoder:
    """Greedy batch-1 decoding of a transformers `*ForCausalLM` through graphs.CUDAGraphDecoder.

    Segments: `embed` (token, pos -> h, rotary cos/sin, attention mask) on the primary device,
    `layer{l}` (the layer's own forward over the model's StaticCache) on its device, `head`
    (final norm, lm_head, argmax -> token, pos + 1) on the primary device. The step's inputs are
    `token` [1] and `pos` [1] (int64, primary device). The cache row a step writes is its `pos`:
    each layer segment first sets its cache layer's length counter (where the library's update()
    writes) to pos, so a step at any position is valid. Building allocates, warms up, captures.

    `devices`: the primary first; layers split over them by weight bytes (graphs'
    balanced_placement), or pass `placement` (one device per layer). Modules are moved there.
    `capture=False` leaves `self.decoder.allocate()`, `warmup()`, `capture()` to the caller.
    """

    def __init__(self, model, max_seq_len: int, *, devices: Sequence | None = None,
                 placement: Sequence | None = None, mode: str = "auto",
                 granularity: str = "segment", debug: bool = False, capture: bool = True):
        self.model, self.max_seq_len = model, max_seq_len
        inner = model.model                              # embed_tokens, layers, norm, rotary_emb
        self.layers = list(inner.layers)
        primary = torch.device(devices[0]) if devices else next(model.parameters()).device
        self.primary = primary
        if placement is not None:
            self.placement = [torch.device(d) for d in placement]
            if len(self.placement) != len(self.layers):
                raise ValueError(f"placement has {len(self.placement)} devices for "
                                 f"{len(self.layers)} layers; pass one per layer")
        elif devices and len(devices) > 1:               # contiguous layer ranges, head on primary
            sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in self.layers]
            head = sum(p.numel() * p.element_size() for m in (inner.embed_tokens, inner.norm,
                                                             model.lm_head) for p in m.parameters())
            self.placement = balanced_placement(sizes, devices, head)
        else:
            self.placement = [primary] * len(self.layers)
        check_supported(model, graph=mode == "graph" or (mode == "auto" and primary.type == "cuda"))
        for blk, dev in zip(self.layers, self.placement):   # each module moved once, to its device
            blk.to(dev)
        for m in (inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head):
            m.to(primary)
        self.cache = self._static_cache()
        self._allocate_buffers()
        self.decoder = CUDAGraphDecoder(
            self.segments(), inputs={"token": self.token, "pos": self.pos},
            outputs={"token": self.token, "logits": self.logits}, mode=mode,
            granularity=granularity, reset_fn=self.cache.reset, debug=debug, nvtx_domain="hf",
            fix_hints=(f"a smaller max_seq_len (now {max_seq_len})", "mode='eager'"))
        if capture:
            self.decoder.allocate()
            self.decoder.warmup()
            self.decoder.capture()

    # ------------------------------------------------------------------ build
    def _static_cache(self) -> StaticCache:
        """The model's StaticCache of capacity L, every layer allocated now on its layer's device
        (lazily allocated tensors would land after capture)."""
        cfg = self.model.config
        cache = StaticCache(config=cfg, max_cache_len=self.max_seq_len)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        for cl, dev in zip(cache.layers, self.placement):
            if type(cl) is not StaticLayer:
                raise ValueError(
                    f"cache layer {type(cl).__name__} (sliding window / chunked / linear attention "
                    "keeps host-side lengths): only full-attention StaticLayer caches are stepped "
                    "here. Fix: a full-attention config (sliding_window=None); escape hatch: the "
                    "model's own generate().")
            if not isinstance(getattr(cl, "cumulative_length", None), torch.Tensor):
                raise ValueError(f"transformers {transformers.__version__}: StaticLayer keeps no "
                                 "device-side length counter (cumulative_length), which the steps "
                                 "set from `pos`. Fix: transformers >= 5.24.")
            empty = torch.zeros(1, kv_heads, 0, head_dim, dtype=self.model.dtype, device=dev)
            cl.lazy_initialization(empty, empty)         # keys/values [1, kvh, L, e], counter []
        return cache

    def _allocate_buffers(self) -> None:
        """Static buffers: inputs/outputs on the primary device, h/pos/cos/sin/mask per device."""
        cfg, p = self.model.config, self.primary
        dtype = self.model.dtype
        self.token = BufferSpec("token", (1,), torch.int64, p, fill=0).allocate()   # a valid id
        self.pos = BufferSpec("pos", (1,), torch.int64, p, fill=1).allocate()       # pos >= 1
        self.logits = BufferSpec("logits", (1, cfg.vocab_size), torch.float32, p).allocate()
        with torch.no_grad():                            # shapes/dtypes of cos, sin and the mask
            x = torch.zeros(1, 1, cfg.hidden_size, dtype=dtype, device=p)
            cos, sin = self.model.model.rotary_emb(x, self.pos.view(1, 1))
            mask = self._decode_mask(self.pos, x)
        self.h, self.pos_on, self.cos, self.sin, self.mask = {}, {}, {}, {}, {}
        for dev in dict.fromkeys([p, *self.placement]):
            self.h[dev] = BufferSpec("h", (1, 1, cfg.hidden_size), dtype, dev).allocate()
            self.pos_on[dev] = self.pos if dev == p else BufferSpec("pos", (1,), torch.int64, dev,
                                                                   fill=1).allocate()
            self.cos[dev] = torch.zeros_like(cos, device=dev)          # [1, 1, e]
            self.sin[dev] = torch.zeros_like(sin, device=dev)          # [1, 1, e]
            self.mask[dev] = torch.zeros_like(mask, device=dev)        # [1, 1, 1, L]

    def _decode_mask(self, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The library's own mask for one query at `pos` over all L cache rows (row <= pos seen):
        bool for sdpa, additive float for eager. Capture-safe: `pos` is a device tensor."""
        cfg = self.model.config
        return ALL_MASK_ATTENTION_FUNCTIONS[cfg._attn_implementation](
            batch_size=1, q_length=1, kv_length=self.max_seq_len, q_offset=pos, kv_offset=0,
            mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip=False,
            dtype=x.dtype, config=cfg, use_vmap=False, device=x.device)

    def segments(self) -> list[Segment]:
        """embed -> layer0 .. layer{N-1} -> head; every fn is capture-safe (no host sync)."""
        p = self.primary
        segs = [Segment("embed", p, self._embed_fn(), reads={"token": self.token, "pos": self.pos},
                        writes={"h": self.h[p], "cos": self.cos[p], "sin": self.sin[p],
                                "mask": self.mask[p]})]
        for l, dev in enumerate(self.placement):
            cl = self.cache.layers[l]
            state = {f"k{l}": (cl, "keys"), f"v{l}": (cl, "values"),
                     f"len{l}": (cl, "cumulative_length")}   # looked up on the cache layer itself
            step = {"h": self.h[dev], "pos": self.pos_on[dev], "cos": self.cos[dev],
                    "sin": self.sin[dev], "mask": self.mask[dev]}
            segs.append(Segment(f"layer{l}", dev, self._layer_fn(l, dev),
                                reads=LiveBuffers({**step, **state}),
                                writes=LiveBuffers({"h": self.h[dev], **state}), group=str(dev)))
        segs.append(Segment("head", p, self._head_fn(), reads={"h": self.h[p], "pos": self.pos},
                            writes={"logits": self.logits, "token": self.token, "pos": self.pos}))
        return segs

    def _embed_fn(self):
        inner, p = self.model.model, self.primary
        h, cos, sin, mask = self.h[p], self.cos[p], self.sin[p], self.mask[p]

        @torch.no_grad()
        def embed():
            x = inner.embed_tokens(self.token.view(1, 1))               # [1, 1, d]
            h.copy_(x)
            c, s = inner.rotary_emb(x, self.pos.view(1, 1))             # [1, 1, e] each
            cos.copy_(c), sin.copy_(s)
            mask.copy_(self._decode_mask(self.pos, x))                  # [1, 1, 1, L]
        return embed

    def _layer_fn(self, l: int, dev: torch.device):
        blk, cl, cache = self.layers[l], self.cache.layers[l], self.cache
        h, pos, cos, sin, mask = (self.h[dev], self.pos_on[dev], self.cos[dev], self.sin[dev],
                                  self.mask[dev])

        @torch.no_grad()
        def layer():
            # StaticLayer.update writes K/V at row `cumulative_length` (then adds 1): make it pos
            cl.cumulative_length.copy_(pos[0])
            out = blk(h, attention_mask=mask, position_ids=pos.view(1, 1), cache=cache,
                      position_embeddings=(cos, sin))
            h.copy_(out[0] if isinstance(out, tuple) else out)          # [1, 1, d]
        return layer

    def _head_fn(self):
        inner, lm_head, p = self.model.model, self.model.lm_head, self.primary
        h = self.h[p]

        @torch.no_grad()
        def head():
            self.logits.copy_(lm_head(inner.norm(h))[:, -1])           # [1, v] f32
            self.token.copy_(self.logits.argmax(-1))                    # greedy, on the device
            self.pos.add_(1)
        return head

    # ------------------------------------------------------------------ run
    @torch.no_grad()
    def prefill(self, ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Feed `ids` at positions start .. start+n-1 through the model's own layers (eager, one
        forward over the prompt); returns the logits after the last one [v] f32 and leaves the
        greedy next token and its position in the step inputs (device writes, no host sync)."""
        n = len(ids)
        if n < 1 or start < 0 or start + n >= self.max_seq_len:
            raise ValueError(f"prefill of {n} ids at {start}: positions must lie in [0, "
                             f"max_seq_len - 1 = {self.max_seq_len - 1}), one left to decode")
        inner, cfg, p = self.model.model, self.model.config, self.primary
        for cl in self.cache.layers:
            cl.cumulative_length.fill_(start)              # rows >= start are rewritten
        x = inner.embed_tokens(torch.tensor([list(ids)], device=p))                # [1, n, d]
        pid = torch.arange(start, start + n, device=p)[None]                       # [1, n]
        rope = inner.rotary_emb(x, pid)
        per_dev = {}
        for l, (blk, dev) in enumerate(zip(self.layers, self.placement)):
            if dev not in per_dev:                         # mask, rope, positions moved once
                xd = x.to(dev)
                per_dev[dev] = (create_causal_mask(
                    config=cfg, inputs_embeds=xd, attention_mask=None, cache=self.cache,
                    position_ids=pid.to(dev), layer_idx=l), tuple(r.to(dev) for r in rope),
                    pid.to(dev))
            mask, rope_d, pid_d = per_dev[dev]
            x = blk(x.to(dev), attention_mask=mask, position_ids=pid_d, cache=self.cache,
                    position_embeddings=rope_d)
            x = x[0] if isinstance(x, tuple) else x
        logits = self.model.lm_head(inner.norm(x[:, -1:].to(p)))[0, -1].float()     # [v]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.pos.fill_(start + n)
        return logits

    def generate(self, prompt: Sequence[int], max_new_tokens: int):
        """Greedy: prefill, then max_new_tokens - 1 steps -> (new ids, their logits [t, v] f32)."""
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed "
                             f"max_seq_len={self.max_seq_len}; build with a larger one")
        logits = [self.prefill(prompt)[None]]
        tokens = [self.token.clone()]
        for _ in range(max_new_tokens - 1):
            out = self.decoder.step()                  # feeds token at pos; head writes the next
            tokens.append(out["token"].clone())        # views: copy before the next step
            logits.append(out["logits"].clone())
        return torch.cat(tokens).tolist(), torch.cat(logits).cpu()   # the only host sync

    def close(self) -> None:
        self.decoder.close()

    def __enter__(self) -> "HFGraphDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    ap.add_argument("--devices", default=None, help="e.g. cuda:0,cuda:1 (default: cuda:0 or cpu)")
    ap.add_argument("--mode", choices=("auto", "graph", "eager"), default="auto")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    devices = (args.devices.split(",") if args.devices
               else ["cuda:0" if torch.cuda.is_available() else "cpu"])
    model = build_model(args.family).to(devices[0])   # CPU init: the weights the tests check
    prompt = [7, 21, 300, 42, 5]
    ref = model.generate(torch.tensor([prompt], device=devices[0]), do_sample=False,
                         max_new_tokens=args.new_tokens)[0, len(prompt):].tolist()
    with HFGraphDecoder(model, max_seq_len=256, devices=devices, mode=args.mode) as dec:
        ids, _ = dec.generate(prompt, args.new_tokens)
        print(f"{args.family}: mode={dec.decoder.mode} devices={dec.decoder.devices} "
              f"graphs={dec.decoder.n_graphs}")
    print("graphs/ :", ids)
    print("generate:", ref)
    print("equal" if ids == ref else "DIFFERENT")


if __name__ == "__main__":
    main()
