"""Time per decoded token of one transformers model on one GPU, four ways, printed as one JSON line:
its own generate() (dynamic cache; static cache eager), its own forward stepped over a StaticCache,
its static-cache torch.compile path (generate(cache_implementation="static"), compiled by the
library), and graphs/ (examples/hf_decoder.py) eager and captured. Random weights, no download.

Run:   python -m examples.hf_bench --shape 0.5b               # Qwen2.5-0.5B-shaped, bf16, cuda:0
       python -m examples.hf_bench --shape moe                # a ~0.7B Mixtral-shaped MoE
       python -m examples.hf_bench --shape tiny --device cpu  # smoke run (no compile, no graphs)
Per-token time = (time of a run with N new tokens - one with 1) / (N - 1): prefill cancels out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from transformers import StaticCache

from examples.hf_decoder import FAMILIES, HFGraphDecoder, build_model

SHAPES = {   # family, config overrides (real shapes of the named models; rope scaling left out)
    "0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                           num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           tie_word_embeddings=True, initializer_range=0.02)),   # Qwen2.5-0.5B
    "1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=True, initializer_range=0.02)),     # Llama-3.2-1B
    "moe": ("mixtral", dict(vocab_size=32000, hidden_size=1024, intermediate_size=1408,
                            num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                            num_local_experts=8, num_experts_per_tok=2,
                            initializer_range=0.02)),                            # 8 experts, top 2
    "tiny": ("llama", {}),
}
assert all(f in FAMILIES for f, _ in SHAPES.values())
CHECK_TOKENS = 32   # greedy tokens of each graphs/ path compared with generate() (informative)


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs, each synchronised on both ends."""
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def per_token_ms(run: Callable[[int], object], n: int, device, repeats: int) -> float:
    """(t(run(n)) - t(run(1))) / (n - 1) in ms, after one warm-up run(n)."""
    run(n)
    return 1e3 * (_seconds(lambda: run(n), device, repeats)
                  - _seconds(lambda: run(1), device, repeats)) / (n - 1)


def hf_generate(model, prompt: torch.Tensor, **kw) -> Callable[[int], torch.Tensor]:
    return lambda n: model.generate(prompt, do_sample=False, max_new_tokens=n, **kw)


def hf_forward(model, prompt: torch.Tensor, max_seq_len: int) -> Callable[[int], torch.Tensor]:
    """The library's forward stepped by hand over a StaticCache, greedy on the device (no host
    sync per token): what an engine gets from the model without generate() or graphs."""
    @torch.no_grad()
    def run(n: int) -> torch.Tensor:
        cache = StaticCache(config=model.config, max_cache_len=max_seq_len)
        pos = torch.arange(prompt.shape[1], device=prompt.device)[None]            # [1, n]
        logits = model(input_ids=prompt, cache=cache, position_ids=pos).logits
        tok, pos = logits[:, -1:].argmax(-1), pos[:, -1:] + 1                       # [1, 1]
        for _ in range(n - 1):
            logits = model(input_ids=tok, cache=cache, position_ids=pos).logits
            tok, pos = logits[:, -1:].argmax(-1), pos + 1
        return tok
    return run


def graphs_run(dec: HFGraphDecoder, prompt: list[int], sync_each: bool) -> Callable[[int], None]:
    """Prefill, then n - 1 steps; `sync_each` reads every token on the host (an engine checking
    for EOS), otherwise the steps are queued back to back."""
    def run(n: int) -> None:
        dec.prefill(prompt)
        for _ in range(n - 1):
            out = dec.decoder.step()
            if sync_each:
                int(out["token"][0])
    return run


def bench(shape: str, device: str = "cuda:0", dtype: str = "bfloat16", prompt_len: int = 32,
          new_tokens: int = 128, repeats: int = 3, compile: bool = True) -> dict:
    """Build the model, time every path on `device`, return the JSON-able result row."""
    dev, dt = torch.device(device), getattr(torch, dtype)
    family, overrides = SHAPES[shape]
    model = build_model(family, device=dev, dtype=dt, **overrides)
    # cache capacity rounded up to 64 rows: SDPA's memory-efficient kernel wants the mask's last
    # dimension 16-aligned (it would pad a copy each call otherwise)
    cap = -(-(prompt_len + max(new_tokens, CHECK_TOKENS) + 1) // 64) * 64
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    prompt = torch.tensor([ids], device=dev)
    ms, notes = {}, {}
    n = new_tokens
    ms["hf_generate_dynamic"] = per_token_ms(hf_generate(model, prompt), n, dev, repeats)
    ms["hf_generate_static_eager"] = per_token_ms(
        hf_generate(model, prompt, cache_implementation="static", disable_compile=True), n, dev,
        repeats)
    ms["hf_forward_static_eager"] = per_token_ms(hf_forward(model, prompt, cap), n, dev, repeats)
    for mode in ("eager", "graph") if dev.type == "cuda" else ("eager",):
        with HFGraphDecoder(model, max_seq_len=cap, devices=[dev], mode=mode) as dec:
            key = "graphs" if mode == "graph" else "graphs_eager"
            ms[key] = per_token_ms(graphs_run(dec, ids, False), n, dev, repeats)
            if mode == "graph":
                ms["graphs_sync_each_token"] = per_token_ms(graphs_run(dec, ids, True), n, dev,
                                                            repeats)
                notes.update(capture_s=round(sum(dec.decoder.capture_seconds.values()), 3),
                             n_graphs=dec.decoder.n_graphs)
            ref = hf_generate(model, prompt)(CHECK_TOKENS)[0, prompt_len:].tolist()
            notes[f"{key}_first_{CHECK_TOKENS}_tokens_equal_generate"] = (
                dec.generate(ids, CHECK_TOKENS)[0] == ref)
    # last: the compiled path leaves inductor's CUDA-graph pools behind
    ms["hf_compile_static"] = None
    if not compile:
        notes["hf_compile_static"] = "skipped (--no-compile)"
    elif dev.type != "cuda":
        notes["hf_compile_static"] = "transformers compiles generate() only on accelerators"
    else:
        try:
            from torch._dynamo.utils import counters
            before = counters["stats"]["unique_graphs"]
            run = hf_generate(model, prompt, cache_implementation="static")
            run(n)                                                   # compiles (minutes)
            ms["hf_compile_static"] = per_token_ms(run, n, dev, repeats)
            notes["hf_compile_graphs"] = counters["stats"]["unique_graphs"] - before
            if notes["hf_compile_graphs"] == 0:
                notes["hf_compile_static"] = "generate() ran but compiled nothing (eager timing)"
        except Exception as e:  # report and go on: the other paths do not depend on it
            notes["hf_compile_static"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    return {
        "bench": "hf_decode", "shape": shape, "family": family,
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": dtype, "prompt": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "ms_per_token": {k: (round(v, 4) if v is not None else None) for k, v in ms.items()},
        "tok_per_s": {k: (round(1e3 / v, 1) if v else None) for k, v in ms.items()},
        "notes": notes,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile path")
    a = ap.parse_args(argv)
    print(json.dumps(bench(a.shape, a.device, a.dtype, a.prompt, a.new_tokens, a.repeats,
                           not a.no_compile)))


if __name__ == "__main__":
    main()
