"""What the server adds to decoding: time to first token and time per streamed token through
scripts/serve.py (HTTP, server-sent events, the worker thread, detokenizing and parsing, the prefix
snapshot) against the in-process Session on the same checkpoint and flags.

    python scripts/bench_serve.py --ckpt DIR [--device cuda:0] [--prompt-tokens 128]
        [--new-tokens 256] [--repeats 5] [--json]

In-process first (a Session with fixed greedy parameters, as decode.py builds it, then one with
per-request sampling, as the server builds it), each on fresh random prompts, EOS ignored; the
model is then freed and the server started on the same flags, and the same prompts are streamed
from it (completions with token ids, temperature 0, ignore_eos, use_cache false). Medians over the
repeats. "added" compares the server with the per-request-sampling Session (the same captured
steps); "sampling knobs" is what per-request sampling costs against fixed greedy parameters.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..errors import InputError

REPO = Path(__file__).resolve().parents[2]


def _prompts(n_prompt: int, repeats: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # ids from the ordinary text range of the vocabulary (no special tokens), BOS first
    return [[0] + torch.randint(1000, min(vocab, 100000), (n_prompt - 1,), generator=g).tolist()
            for _ in range(repeats + 1)]


def _in_process(args, devices, mode, prompts) -> dict:
    from ..runtime.config import DTYPES, RuntimeConfig
    from ..runtime.sampling import SamplingParams
    from ..runtime.session import Session, load_model
    rt = RuntimeConfig(max_seq_len=args.max_seq_len, dtype=DTYPES[args.dtype],
                       devices=tuple(devices), prefill_chunk=args.prefill_chunk,
                       prefill_graphs=args.prefill_graphs if mode == "graph" else 0)
    model, ck = load_model(args.ckpt, rt)
    ck.close()
    out = {}
    for per_request in (False, True):
        s = Session(model, SamplingParams(), mode=mode, granularity=args.granularity,
                    per_request_sampling=per_request)
        s.generate(prompts[0], 8)                                   # warm-up
        ttft, tpot = [], []
        for ids in prompts[1:]:
            times = []
            t0 = time.perf_counter()
            s.generate(ids, args.new_tokens, eos_id=None,
                       on_token=lambda _: times.append(time.perf_counter()))
            ttft.append(times[0] - t0)
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
        out["session_per_request_sampling" if per_request else "session_fixed_greedy"] = {
            "ttft_ms": 1e3 * statistics.median(ttft), "tpot_ms": 1e3 * statistics.median(tpot)}
        s.close()
    del model
    if devices[0].startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def _server(args, prompts) -> dict:
    import httpx
    cmd = [sys.executable, str(REPO / "scripts" / "serve.py"), "--ckpt", args.ckpt,
           "--port", str(args.port), "--log-level", "warning", "--device", args.device,
           "--mode", args.mode, "--dtype", args.dtype, "--max-seq-len", str(args.max_seq_len),
           "--prefill-chunk", str(args.prefill_chunk), "--prefill-graphs",
           str(args.prefill_graphs), "--granularity", args.granularity]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])))
    url = f"http://127.0.0.1:{args.port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
            if time.monotonic() - t0 > 900:
                raise RuntimeError("the server did not start in 900 s")
        ttft, tpot = [], []
        with httpx.Client(timeout=600) as http:
            for i, ids in enumerate(prompts):
                t, n = _stream_one(http, url, ids, args.new_tokens)
                if i:                                                # prompts[0]: warm-up
                    ttft.append(t[0])
                    tpot.append((t[1] - t[0]) / (n - 1))
        return {"ttft_ms": 1e3 * statistics.median(ttft), "tpot_ms": 1e3 * statistics.median(tpot)}
    finally:
        proc.terminate()
        proc.wait(120)


def _stream_one(http, url, ids, n_new) -> tuple[tuple[float, float], int]:
    """-> ((first token, last token) seconds after the request was sent, tokens generated)."""
    body = {"prompt": ids, "max_tokens": n_new, "temperature": 0, "ignore_eos": True,
            "use_cache": False, "stream": True, "skip_special_tokens": False,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.read()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            now = time.perf_counter() - t0
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
            elif ev["choices"] and ev["choices"][0]["finish_reason"] is None:
                first = now if first is None else first
                last = now
    if n < 2 or first is None:
        raise RuntimeError(f"a stream delivered {n} tokens; expected {n_new}")
    return (first, last), n


def run(args, devices: list[str], mode: str) -> int:
    """The comparison for the flags of `scripts/bench_serve.py` (dsv4.cli.bench.serve_parser) on
    the resolved devices and mode; prints the table or the JSON."""
    if args.new_tokens < 2 or args.prompt_tokens < 2 or args.repeats < 1:
        raise InputError("--new-tokens and --prompt-tokens must be >= 2, --repeats >= 1")
    if args.prompt_tokens + args.new_tokens > args.max_seq_len:
        raise InputError(f"--prompt-tokens + --new-tokens = "
                         f"{args.prompt_tokens + args.new_tokens} exceeds --max-seq-len "
                         f"{args.max_seq_len}")
    from ..weights.config import ModelConfig
    cfg = ModelConfig.from_json(args.ckpt)
    prompts = _prompts(args.prompt_tokens, args.repeats, cfg.vocab_size)
    res = {"device": torch.cuda.get_device_name(0) if devices[0].startswith("cuda") else "cpu",
           "mode": mode, "ckpt": str(args.ckpt), "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens, "repeats": args.repeats,
           **_in_process(args, devices, mode, prompts), "server": _server(args, prompts)}
    ref, fixed, srv = (res["session_per_request_sampling"], res["session_fixed_greedy"],
                       res["server"])
    res["added"] = {"ttft_ms": srv["ttft_ms"] - ref["ttft_ms"],
                    "tpot_ms": srv["tpot_ms"] - ref["tpot_ms"],
                    "tpot_pct_of_step": 100 * (srv["tpot_ms"] - ref["tpot_ms"]) / ref["tpot_ms"]}
    res["sampling_knobs"] = {"tpot_ms": ref["tpot_ms"] - fixed["tpot_ms"],
                             "tpot_pct_of_step": 100 * (ref["tpot_ms"] - fixed["tpot_ms"]) /
                             fixed["tpot_ms"]}
    if args.json:
        print(json.dumps(res))
    else:
        for k in ("session_fixed_greedy", "session_per_request_sampling", "server"):
            print(f"{k:30s} TTFT {res[k]['ttft_ms']:8.2f} ms   per token "
                  f"{res[k]['tpot_ms']:7.3f} ms")
        a, kn = res["added"], res["sampling_knobs"]
        print(f"{'server adds':30s} TTFT {a['ttft_ms']:8.2f} ms   per token "
              f"{a['tpot_ms']:7.3f} ms ({a['tpot_pct_of_step']:.1f}% of a step)")
        print(f"{'per-request sampling costs':30s} {'':18s}per token {kn['tpot_ms']:7.3f} ms "
              f"({kn['tpot_pct_of_step']:.1f}% of a step)")
    return 0
