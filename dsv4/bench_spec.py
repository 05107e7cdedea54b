"""bench.py --speculative: the mechanism of self-speculative decoding on device-generated weights.

Random weights make the MTP block's real acceptance rate meaningless, so this measures what the
rate is multiplied with (method: BENCHMARKS.md):
- the verify pass of T = 1..4 rows at context L (main model rows + their logits), against the
  plain decode step of the same run;
- the draft (one MTP row + its logits through the shared head);
- end to end: decode tokens/s of the speculative loop when an acceptance hook treats each draft
  as right with probability a (Speculator.accept_hook: the same passes and state updates as a
  real acceptance; the tokens are then the drafts, not the model's choice).
Expected tokens/s at acceptance a (K = 1): (1 + a) / (t_verify(2) + t_draft).
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

ACCEPTANCE = (0.0, 0.5, 0.7, 0.9, 1.0)


def _time(fn, devices, reps: int, warmup: int = 2) -> float:
    """Median ms of fn() (synchronized: eager work, host time included)."""
    from .bench import _sync
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        _sync(devices)
        t = time.perf_counter()
        fn()
        _sync(devices)
        out.append(1e3 * (time.perf_counter() - t))
    return statistics.median(out)


def run(model, context: int, seed: int, plain_ms: float | None, log, reps: int = 10,
        n_new: int = 48) -> dict:
    from .bench import fill_state
    from .generate import Session
    from .sampling import SamplingParams
    devices = sorted({model.head_device, *model.placement}, key=str)
    hd, V, W = model.head_device, model.cfg.vocab_size, model.cfg.window_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (4,), generator=g).to(hd)
    P = context
    fill_state(model, context, seed)
    model.mtp.state.kv_cache[:W].normal_()

    def verify(T):
        def fn():
            h = model.hidden(ids[:T], P).to(hd)
            return [model.logits(h[i:i + 1]) for i in range(T)]
        return fn

    verify_ms = {}
    with torch.inference_mode():
        for T in (1, 2, 3, 4):
            verify_ms[T] = _time(verify(T), devices, reps)
            log(f"verify T={T}: {verify_ms[T]:.2f} ms")
        h1 = model.hidden(ids[:1], P).to(hd)

        def draft():
            model.mtp_commit(P)
            hm = model.mtp_rows(h1, ids[1:2], P)
            return model.logits(hm, head=model.mtp.head())
        draft_ms = _time(draft, devices, reps)
        tok, pos = ids[:1], torch.tensor([P], device=hd)
        eager_ms = _time(lambda: model.decode_step(tok, pos), devices, reps)
    log(f"draft: {draft_ms:.2f} ms; eager decode step {eager_ms:.2f} ms")

    # end to end: plain decoding (graph mode on CUDA), then the speculative loop
    mode = "graph" if hd.type == "cuda" else "eager"
    prompt = torch.randint(0, V, (64,), generator=g).tolist()
    plain = Session(model, SamplingParams(), mode=mode)
    ref = plain.generate(prompt, n_new)
    plain.close()
    e2e = []
    for a in ACCEPTANCE:
        s = Session(model, SamplingParams(), speculative=1)
        rng = np.random.default_rng(seed)
        s.spec.accept_hook = lambda n, T, a=a, rng=rng: (T - 1) if rng.random() < a else 0
        r = s.generate(prompt, n_new)
        t = r.timings
        e2e.append({"a": a, "acceptance_rate": t["acceptance_rate"],
                    "tokens_per_step": t["tokens_per_step"], "ms_per_token": t["ms_per_token"],
                    "tok_per_s": t["decode_tok_per_s"],
                    "expected_tok_per_s": 1e3 * (1 + a) / (verify_ms[2] + draft_ms)})
        s.close()
        log(f"a={a}: {t['decode_tok_per_s']:.1f} tok/s ({t['ms_per_token']:.2f} ms/token, "
            f"acceptance {t['acceptance_rate']:.2f}, {t['tokens_per_step']:.2f} tokens/step)")
    return {"spec_verify_ms": verify_ms, "spec_draft_ms": draft_ms,
            "spec_plain_ms": plain_ms, "spec_eager_step_ms": eager_ms,
            "spec_plain_tok_per_s": ref.timings["decode_tok_per_s"], "spec_mode_plain": mode,
            "spec_e2e": e2e, "spec_new_tokens": n_new,
            "spec_verify2_over_plain": verify_ms[2] / plain_ms if plain_ms else None}
