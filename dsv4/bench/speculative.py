"""dsv4 bench --speculative: the mechanism of self-speculative decoding on device-generated weights.

Random weights make the MTP block's real acceptance rate meaningless, so this measures what the
rate is multiplied with (method: BENCHMARKS.md), in graph mode on CUDA (eager on the CPU):
- the verify pass of T = 1..4 rows at context L (the rows through every layer, their logits,
  accept and the journal's rewind: dsv4.runtime.speculative.step.verify_decoder), against the plain decoding
  step of the same run;
- the plain step of a speculative session (the plain step and the MTP block reading its row);
- the whole speculative step (verify + the MTP block's rows and draft + the host reading the
  step's output), from end-to-end runs;
- end to end: decode tokens/s when an oracle drafts the plain run's own token with probability a
  (SpecStep.set_oracle: real drafts, real acceptance; the output must equal plain decoding's),
  with every step speculative (min acceptance 0) and with the default policy (dsv4.runtime.speculative.policy).
Expected tokens/s at a real acceptance rate a (K = 1), every step speculative: (1 + a) / t_step
(t_step: the step at a = 0, one token each).
"""
from __future__ import annotations

import statistics

import torch

from ..runtime.sampling import SamplingParams
from ..runtime.session import Session
from ..runtime.speculative.policy import DEFAULT_MIN_ACCEPTANCE, SpecPolicy
from ..runtime.speculative.step import verify_decoder
from . import timeline
from .common import _sync, count_kernels, fill_state, time_steps

ACCEPTANCE = (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)
PROMPT = 64
REPS = 20               # timed replays of each verify pass and of the plain step + MTP row (at most:
                        # the bench passes min(REPS, --steps))


def run(model, context: int, seed: int, plain_ms: float | None, log, reps: int = REPS,
        n_new: int = 256, kernels: bool = False, granularity: str = "segment") -> dict:
    """kernels (CUDA): also one profiled replay of each verify pass: its timeline (weights
    streaming / not, dsv4.bench.timeline) and its kernels by name, T = 2's beside T = 1's; and
    of the speculative step, what its MTP segment adds and where the device waits for the host.
    granularity: of every graph (that of the plain step plain_ms was measured with; without a
    graph row, the first one --granularity names)."""
    hd, V = model.head_device, model.cfg.vocab_size
    devices = [hd] + sorted({*model.placement} - {hd}, key=str)
    mode = "graph" if hd.type == "cuda" else "eager"
    g = torch.Generator().manual_seed(seed)

    verify_ms, verify_top, verify_tl = {}, {}, {}
    with torch.inference_mode():
        for T in (1, 2, 3, 4):
            dec, bufs = verify_decoder(model, T - 1, mode, granularity)
            if mode == "graph":
                dec.warmup()
                dec.capture()
            fill_state(model, context, seed)      # the drafts (token 0) are rejected: every
            bufs.pos.fill_(context)               # replay leaves the state as it found it
            bufs.pending.fill_(int(torch.randint(1, V, (1,), generator=g)))
            dec.step()
            verify_ms[T] = statistics.median(time_steps(dec.step, reps, devices))
            log(f"verify T={T}: {verify_ms[T]:.3f} ms"
                + (f" ({verify_ms[T] / plain_ms:.2f}x the plain step)" if plain_ms else ""))
            if kernels and hd.type == "cuda":
                top, events = {}, []
                count_kernels(dec.step, devices, top, events=events)
                verify_top[T] = timeline.by_short_name(top)
                verify_tl[T] = timeline.analyze(events, model.cfg.n_layers)
                log(f"verify T={T}: {timeline.format_line(verify_tl[T])}")
            dec.close()
    model.reset()
    if 1 in verify_top and 2 in verify_top:
        log("verify T=2 against T=1, device us a step by kernel (side branches and PDL waits "
            "overlap: the sums exceed the step):")
        names = sorted(verify_top[2], key=lambda k: -verify_top[2][k][1])
        for k in names[:16]:
            n1, us1 = verify_top[1].get(k, [0, 0.0])
            n2, us2 = verify_top[2][k]
            log(f"  {k:<48} T=1 {us1:8.1f} us {n1:4d}x   T=2 {us2:8.1f} us {n2:4d}x   "
                f"+{us2 - us1:7.1f}")

    # end to end: plain decoding, then the speculative loop with the oracle at each rate a
    prompt = torch.randint(0, V, (PROMPT,), generator=g).tolist()
    plain = Session(model, SamplingParams(), mode=mode, granularity=granularity)
    ref = plain.generate(prompt, n_new)
    plain.close()
    s = Session(model, SamplingParams(), mode=mode, granularity=granularity, speculative=1)

    # the plain step of the speculative session: plain decoding's step + the MTP block's row
    fill_state(model, context, seed)
    n = max(1, min(reps, model.rt.max_seq_len - context - 2))
    s.bufs.pos.fill_(context)
    follow = lambda: (s.decoder.step(), s.spec.follow.step())   # noqa: E731
    follow()
    s.bufs.pos.fill_(context)
    follow_ms = statistics.median(time_steps(follow, n, devices))
    log(f"plain step + MTP row: {follow_ms:.3f} ms"
        + (f" ({follow_ms / plain_ms:.3f}x the plain step)" if plain_ms else ""))
    model.reset()

    device_ms, step_top, host_gaps = _split_step(s, model, context, seed, n, devices,
                                                 verify_ms[2], verify_top.get(2), log)
    model.reset()

    e2e, same = {}, True
    for policy, min_acc in (("always", 0.0), ("default", DEFAULT_MIN_ACCEPTANCE)):
        rows = e2e[policy] = []
        for a in ACCEPTANCE:
            s.spec.policy = SpecPolicy(min_acc)
            s.spec.set_oracle(prompt + ref.output_ids, a)
            if mode == "graph":                   # warm (the first prefill of a session)
                s.generate(prompt, n_new)
                _sync(devices)
            r = s.generate(prompt, n_new)
            same &= r.output_ids == ref.output_ids
            t = r.timings
            rows.append({"a": a, "acceptance_rate": t["acceptance_rate"],
                         "tokens_per_step": t["tokens_per_step"], "steps": t["steps"],
                         "speculative_steps": t["speculative_steps"],
                         "step_ms": 1e3 * t["decode_s"] / t["steps"],
                         "ms_per_token": t["ms_per_token"], "tok_per_s": t["decode_tok_per_s"]})
            log(f"{policy} a={a}: {t['decode_tok_per_s']:.1f} tok/s ({t['ms_per_token']:.2f} "
                f"ms/token, acceptance {t['acceptance_rate']:.2f}, {t['tokens_per_step']:.2f} "
                f"tokens/step, {t['speculative_steps']} of {t['steps']} steps drafting)")
    s.close()
    always = e2e["always"]
    step_ms = always[0]["step_ms"]                # a = 0: one token per step
    for r in always:                              # the formula at the measured acceptance
        r["expected_tok_per_s"] = 1e3 * (1 + r["acceptance_rate"]) / step_ms
    plain_tps = ref.timings["decode_tok_per_s"]
    for rows in e2e.values():
        for r in rows:
            r["over_plain"] = r["tok_per_s"] / plain_tps
    log(f"speculative step {step_ms:.3f} ms (verify T=2 {verify_ms[2]:.3f} ms + MTP rows and "
        f"draft {device_ms - verify_ms[2]:.3f} ms + the host's turn-around "
        f"{step_ms - device_ms:.3f} ms); plain {plain_tps:.1f} tok/s; same tokens as plain: {same}")
    return {"spec_mode": mode, "spec_verify_ms": verify_ms, "spec_step_ms": step_ms,
            "spec_draft_ms": step_ms - verify_ms[2], "spec_plain_ms": plain_ms,
            "spec_step_device_ms": device_ms, "spec_host_ms": step_ms - device_ms,
            "spec_host_gaps": host_gaps,
            "spec_step_kernels": sorted(([k, n, round(us, 1)] for k, (n, us) in step_top.items()),
                                        key=lambda r: -r[2])[:30] or None,
            "spec_plain_follow_ms": follow_ms,
            "spec_break_even": step_ms / follow_ms - 1,
            "spec_plain_tok_per_s": plain_tps, "spec_same_tokens": same,
            "spec_e2e": always, "spec_e2e_default": e2e["default"], "spec_new_tokens": n_new,
            "spec_context": context,
            "spec_verify_timeline": verify_tl or None,
            "spec_verify_kernels": {T: sorted(([k, n, round(us, 1)] for k, (n, us) in t.items()),
                                              key=lambda r: -r[2])[:30]
                                    for T, t in verify_top.items()} or None,
            "spec_verify2_over_plain": verify_ms[2] / plain_ms if plain_ms else None}


def _split_step(s, model, context: int, seed: int, n: int, devices, verify2_ms: float,
                verify2_top: dict | None, log) -> tuple[float, dict, list | None]:
    """The speculative session s's step split: its device work alone (the segments replayed back
    to back, no read by the host between steps; drafts of token 0, rejected) against the verify
    pass of T = 2 (verify2_ms); with verify2_top (its kernels by name, CUDA), what the MTP segment
    adds by kernel name, and three steps as decoding takes them (as the Session's loop: each
    step launched before the host reads the one before it) with the longest stretches no kernel
    runs.
    -> (device ms, the step's kernels by name, those stretches)."""
    b = s.spec.bufs
    s.spec.set_oracle((), -1.0)
    fill_state(model, context, seed)
    b.pos.fill_(context)
    s.spec.set_stop(2, None)
    b.drafts.zero_()
    s.spec.decoder.step()
    b.pos.fill_(context)
    device_ms = statistics.median(time_steps(s.spec.decoder.step, n, devices))
    log(f"speculative step on the device (segments back to back, no host read): {device_ms:.3f} "
        f"ms = verify T=2 {verify2_ms:.3f} + MTP block, its head and the draft "
        f"{device_ms - verify2_ms:.3f}")
    if verify2_top is None:
        return device_ms, {}, None
    top = {}
    b.pos.fill_(context)
    count_kernels(s.spec.decoder.step, devices, top)
    step_top = timeline.by_short_name(top)
    log("the speculative step against the verify pass of T=2, device us by kernel (what the "
        "MTP segment adds):")
    extra = {k: v[1] - verify2_top.get(k, [0, 0.0])[1] for k, v in step_top.items()}
    for k in sorted(extra, key=lambda k: -extra[k])[:12]:
        n2 = verify2_top.get(k, [0, 0.0])[0]
        log(f"  {k:<48} +{extra[k]:7.1f} us  ({step_top[k][0] - n2:+d} launches)")
    events, steps = [], 3
    s.spec.policy = SpecPolicy(0.0)             # every step speculative
    b.pos.fill_(context)
    s.spec.step(2, None)                        # (drafts from the MTP block's last row)

    def as_decoding():                          # Session._generate_speculative's order
        run = s.spec.launch(2 * (s.spec.k + 1), None)
        for _ in range(steps - 1):
            nxt = s.spec.launch(2 * (s.spec.k + 1), None)
            s.spec.finish(run)
            run = nxt
        s.spec.finish(run)
    count_kernels(as_decoding, devices, {}, events=events)
    tl = timeline.analyze(events, steps)        # its "per layer" figures: per step here
    gaps = timeline.gaps(events)
    log(f"{steps} speculative steps as decoding takes them (profiled): a step's span "
        f"{tl['span_us_per_layer']:.1f} us, no kernel running {tl['no_kernel_us_per_layer']:.1f}"
        f" us; the longest waits: " + "; ".join(f"{g[0]:.1f} us after {g[1]} before {g[2]}"
                                                for g in gaps[:6]))
    return device_ms, step_top, gaps
