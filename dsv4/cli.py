"""The `scripts/decode.py` command: argument contract, input checks, streaming output, summary, JSON.

Exit status: 0 success; 2 bad usage or input (one line on stderr naming the problem and the fix);
1 runtime failure. Contract: ../shared/docs/USERS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

import torch

from .errors import InputError, exit_code
from .model import PREFILL_CHUNK
from .spec_policy import DEFAULT_MIN_ACCEPTANCE, check_min_acceptance

DEMO_PROMPT = "Write one sentence about the sea."


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # one line, exit 2
        raise InputError(f"{message} (see --help)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--ckpt / --demo (shared with the server, dsv4.serve)."""
    src = p.add_argument_group("model")
    src.add_argument("--ckpt", help="checkpoint directory in the released DSV4 format")
    src.add_argument("--demo", action="store_true",
                     help="build (once, cached) and run a tiny random-weight model (the default "
                          "when no --ckpt is given)")


def add_sampling_args(g) -> None:
    """--temperature / --top-p / --top-k / --seed (the server's defaults for its requests)."""
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None, help="sampling seed (random if omitted)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="decode.py", description="Batch-1 DeepSeek-V4 decoding (CUDA graphs or eager).")
    add_model_args(p)
    pr = p.add_argument_group("prompt").add_mutually_exclusive_group()
    pr.add_argument("--prompt", help="prompt text (chat-encoded unless --raw)")
    pr.add_argument("--prompt-file", help="file with the prompt text")
    pr.add_argument("--prompt-ids", help="comma-separated token ids, used as given")
    pr.add_argument("--messages", help="JSON file: a list of messages or {messages, tools}")
    p.add_argument("--raw", action="store_true", help="encode the text as-is (no chat template)")
    p.add_argument("--thinking", action="store_true", help="thinking mode of the chat encoding")
    p.add_argument("--system", help="system prompt")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=64)
    add_sampling_args(g)
    g.add_argument("--force-ids", help="teacher forcing: feed these ids instead of sampled ones")
    add_runtime_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object on stdout at the end")
    o.add_argument("--dump-logits", help="save float32 logits [n_generated, vocab] to PATH.npy")
    o.add_argument("--profile", default="none", choices=("none", "torch", "nsys"))
    o.add_argument("--profile-steps", default="10-20", help="decode steps A-B to profile")
    return p


def add_runtime_args(p: argparse.ArgumentParser, max_seq_len: int | None = None,
                     max_seq_len_help: str = "cache capacity (default: prompt + max-new-tokens, "
                                             "rounded up to 256)") -> None:
    """The runtime group: --device, --mode, --granularity, --dtype, --max-seq-len,
    --prefill-chunk, --prefill-graphs, --speculative, --speculative-min-acceptance (shared with
    the server; checked by check_runtime_args)."""
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:0,cuda:1 (pipeline)")
    r.add_argument("--mode", default="auto", choices=("auto", "graph", "eager"))
    r.add_argument("--granularity", default="segment", choices=("segment", "device"),
                   help="graph per layer (segment) or per device")
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    r.add_argument("--max-seq-len", type=int, default=max_seq_len, help=max_seq_len_help)
    r.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help=f"prefill the prompt N tokens at a time (same result; activation memory "
                        f"grows with N; default {PREFILL_CHUNK})")
    r.add_argument("--prefill-graphs", type=int, default=0, metavar="N",
                   help="graph mode: capture prefill chunks of 1, 2, 4, ..., N tokens at startup "
                        "(N a power of two; 0 = off) and replay them where that measured faster "
                        "than the eager chunk (N-token pieces, then the rest): a faster first "
                        "token, paid for by the capture (worth it when one process serves "
                        "several prompts)")
    r.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="self-speculative decoding with the checkpoint's MTP block, K drafted "
                        "tokens per step (0 = off; K = 1 is implemented)")
    r.add_argument("--speculative-min-acceptance", type=float, default=DEFAULT_MIN_ACCEPTANCE,
                   metavar="A",
                   help="with --speculative: while fewer than this share of the drafts are "
                        "accepted, decode plain steps (the MTP block following) and try drafting "
                        f"again later (default {DEFAULT_MIN_ACCEPTANCE}, about where drafting "
                        "starts to pay on Flash; 0 = always draft)")


def check_runtime_args(args) -> tuple[list[str], str]:
    """The runtime flags checked before anything loads -> (devices, mode). InputError naming the
    flag, the value and the fix."""
    from .generate import resolve_devices, resolve_mode
    if args.prefill_chunk < 1:
        raise InputError(f"--prefill-chunk {args.prefill_chunk}: must be >= 1 (tokens per "
                         f"prefill pass; default {PREFILL_CHUNK})")
    g = args.prefill_graphs
    if g < 0 or g & (g - 1):
        raise InputError(f"--prefill-graphs {g}: expected 0 (off) or a power of two (the "
                         f"largest captured chunk, e.g. 256)")
    if args.speculative not in (0, 1):
        raise InputError(f"--speculative {args.speculative}: allowed 0 (off) or 1 (one drafted "
                         f"token per step; more is not implemented)")
    check_min_acceptance(args.speculative_min_acceptance)
    devices = resolve_devices(args.device)
    mode = resolve_mode(args.mode, devices)
    if g and mode != "graph":
        raise InputError(f"--prefill-graphs {g} needs graph mode (CUDA, --mode graph or auto); use "
                         f"--prefill-graphs 0")
    if g and args.speculative:
        raise InputError(f"--prefill-graphs {g}: a prefill that the MTP block follows "
                         f"(--speculative) does not replay chunk graphs; use --prefill-graphs 0")
    if args.speculative and devices[0].startswith("cuda"):
        print("[dsv4] note: a --speculative step costs ~1.7x a plain one on Flash (mostly the "
              "verified rows' distinct experts), so drafting pays only when more than ~65-70% "
              "of the drafts are accepted; below --speculative-min-acceptance "
              f"{args.speculative_min_acceptance} the session decodes plain steps and tries "
              "drafting again later", file=sys.stderr)
    return devices, mode


def resolve_checkpoint(args) -> Path:
    """The checkpoint directory of --ckpt / --demo (the demo's built once, cached)."""
    if args.ckpt and args.demo:
        raise InputError("give either --ckpt DIR or --demo, not both")
    demo = args.demo or not args.ckpt
    if demo and not args.demo:
        print("[dsv4] no --ckpt given: running the demo (tiny model, random weights)", file=sys.stderr)
    ckpt = Path(demo_checkpoint() if demo else args.ckpt)
    if not ckpt.is_dir():
        from .errors import MissingFileError
        raise MissingFileError(f"checkpoint directory not found: {ckpt} (--ckpt)")
    return ckpt


def _parse_ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise InputError(f"{flag} is empty: give at least one token id")
    return ids


def demo_checkpoint() -> Path:
    """The cached tiny random-weight checkpoint (built once under the user's cache directory)."""
    from .presets import TINY
    from .synthetic import write_checkpoint
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv4"
    path = root / "demo-tiny-v1"
    if (path / "model.safetensors.index.json").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".demo-tmp-{os.getpid()}"
    print(f"[dsv4] building the demo checkpoint (random weights) in {path} ...", file=sys.stderr)
    write_checkpoint(TINY, tmp, weights="fp8", seed=0, shards=2)
    try:
        tmp.rename(path)
    except OSError:                    # another process won the race
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def run(args) -> int:
    from .config import ModelConfig
    from .generate import Session, load_model
    from .model import DTYPES, RuntimeConfig
    from .sampling import SamplingParams
    from .tokenizer import IncrementalDetokenizer, build_prompt_ids, load_tokenizer

    out = sys.stderr if args.json else sys.stdout
    if args.ckpt and args.demo:
        raise InputError("give either --ckpt DIR or --demo, not both")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    devices, mode = check_runtime_args(args)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k,
                              args.seed if args.seed is not None else secrets.randbelow(2 ** 31))
    force = _parse_ids(args.force_ids, "--force-ids") if args.force_ids is not None else None
    from .profiling import parse_steps
    if args.profile != "none":
        parse_steps(args.profile_steps)
        if args.profile == "nsys" and not devices[0].startswith("cuda"):
            raise InputError("--profile nsys needs CUDA; use --profile torch on the CPU")

    ckpt = resolve_checkpoint(args)
    demo = args.demo or not args.ckpt
    cfg = ModelConfig.from_json(ckpt)
    tok = load_tokenizer(ckpt)

    # ---- the prompt (all checks before any allocation) ------------------------------------
    if args.prompt_ids is not None:
        prompt_ids = _parse_ids(args.prompt_ids, "--prompt-ids")
    else:
        text = args.prompt
        if args.prompt_file is not None:
            try:
                text = Path(args.prompt_file).read_text(encoding="utf-8")
            except OSError as e:
                raise InputError(f"--prompt-file {args.prompt_file}: cannot read ({e.strerror})") \
                    from None
        messages = None
        if args.messages is not None:
            from .tokenizer import load_messages
            messages = load_messages(args.messages)
        if text is None and messages is None:
            if not demo:
                raise InputError("no prompt: give --prompt, --prompt-file, --prompt-ids or --messages")
            text = DEMO_PROMPT
        prompt_ids = build_prompt_ids(tok, prompt=text, messages=messages, system=args.system,
                                      thinking=args.thinking, raw=args.raw)
    n_new = len(force) if force is not None else args.max_new_tokens
    for tid in prompt_ids + (force or []):
        if not 0 <= tid < cfg.vocab_size:
            raise InputError(f"token id {tid} is out of range: vocab size is {cfg.vocab_size} "
                             f"(valid ids 0..{cfg.vocab_size - 1})")
    need = len(prompt_ids) + n_new
    cap = args.max_seq_len if args.max_seq_len is not None else -(-need // 256) * 256
    if cap < 1:
        raise InputError(f"--max-seq-len {cap}: must be >= 1")
    if need > cap:
        raise InputError(f"prompt ({len(prompt_ids)} tokens) + max-new-tokens ({n_new}) = {need} "
                         f"exceeds --max-seq-len {cap}; raise --max-seq-len to at least {need} or "
                         f"lower --max-new-tokens")

    # ---- load, prepare, generate ----------------------------------------------------------
    if args.speculative and cfg.n_mtp_layers < 1:
        raise InputError(f"--speculative {args.speculative}: the checkpoint has no MTP block "
                         f"(num_nextn_predict_layers = 0); use --speculative 0")
    rt = RuntimeConfig(max_seq_len=cap, dtype=DTYPES[args.dtype], devices=tuple(devices),
                       prefill_chunk=args.prefill_chunk, mtp=bool(args.speculative),
                       prefill_graphs=args.prefill_graphs if mode == "graph" else 0)
    t0 = time.perf_counter()
    model, ck = load_model(ckpt, rt)
    ck.close()
    load_s = time.perf_counter() - t0
    session = Session(model, sampling, mode=mode, granularity=args.granularity,
                      speculative=args.speculative,
                      spec_min_acceptance=args.speculative_min_acceptance)
    detok = IncrementalDetokenizer(tok)
    eos = tok.eos_id

    def on_token(tid):
        if tid == eos and force is None:
            return
        piece = detok.push(tid)
        if piece:
            out.write(piece)
            out.flush()

    from .profiling import Profiler
    with Profiler(args.profile, args.profile_steps, session) as prof:
        res = session.generate(prompt_ids, n_new, force_ids=force, eos_id=eos, on_token=on_token,
                               keep_logits=args.dump_logits is not None, progress=not args.json)
    tail = detok.flush()
    if tail:
        out.write(tail)
    out.write("\n")
    out.flush()
    if args.dump_logits:
        import numpy as np
        np.save(args.dump_logits, res.logits.numpy().astype("float32"))
    text_ids = res.output_ids[:-1] if res.finish_reason == "eos" else res.output_ids
    timings = {"load_s": load_s, "capture_s": session.capture_s, **res.timings}
    mem = _memory(session)
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "output_ids": res.output_ids,
                          "text": tok.decode(text_ids), "finish_reason": res.finish_reason,
                          "device": ",".join(devices), "mode": mode, "dtype": args.dtype,
                          "seed": sampling.seed, "timings": timings, "memory": mem,
                          "profile": prof.summary_path,
                          **({k: timings[k] for k in ("speculative", "acceptance_rate",
                                                      "tokens_per_step") if k in timings})}))
    else:
        _summary(res, timings, mem, mode, devices, sampling, prompt_ids, prof)
    session.close()
    return 0


def _memory(session) -> dict:
    decs = [session.decoder] + (session.spec.decoders() if session.spec is not None else [])
    graph = {}
    for dec in decs:
        for k, v in dec.graph_bytes.items():
            graph[k] = graph.get(k, 0) + int(v)
    out = {"graph_bytes": graph}
    if session.model.head_device.type == "cuda":
        out["peak_bytes"] = {str(d): int(torch.cuda.max_memory_allocated(d))
                             for d in session.decoder.devices if torch.device(d).type == "cuda"}
    return out


def _summary(res, t, mem, mode, devices, sampling, prompt_ids, prof) -> None:
    w = sys.stderr.write
    w(f"[dsv4] mode={mode} device={','.join(devices)} seed={sampling.seed} "
      f"prompt={len(prompt_ids)} tokens generated={len(res.output_ids)} ({res.finish_reason})\n")
    w(f"[dsv4] load {t['load_s']:.2f} s | capture {t['capture_s']:.2f} s | prefill "
      f"{t['prefill_tok_per_s']:.1f} tok/s | decode {t['decode_tok_per_s']:.2f} tok/s "
      f"({t['ms_per_token']:.2f} ms/token)\n")
    if "acceptance_rate" in t:
        w(f"[dsv4] speculative K={t['speculative']}: acceptance rate {t['acceptance_rate']:.2f}, "
          f"{t['tokens_per_step']:.2f} tokens per step ({t['steps']} steps, "
          f"{t['speculative_steps']} drafting)\n")
    for d, b in mem["graph_bytes"].items():
        w(f"[dsv4] graph memory {d}: {b / 2**20:.1f} MiB\n")
    for d, b in mem.get("peak_bytes", {}).items():
        w(f"[dsv4] peak memory {d}: {b / 2**30:.2f} GiB\n")
    if prof.summary_path:
        w(f"[dsv4] profile: {prof.summary_path}\n")


def main(argv=None) -> int:
    return exit_code(lambda: run(build_parser().parse_args(argv)))
