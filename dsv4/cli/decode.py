"""`dsv4 decode` (and `scripts/decode.py`): one prompt in, streamed text, a summary or one JSON
object out; Ctrl-C keeps what was generated.

Exit status: 0 success; 2 bad usage or input (one line on stderr naming the problem and the fix);
1 runtime failure; 130 interrupted (the partial result is still printed). Contract: docs/CLI.md.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..errors import InputError, exit_code
from .options import (
    Parser,
    add_model_args,
    add_runtime_args,
    add_sampling_args,
    check_checkpoint_args,
    check_output_dir,
    check_output_path,
    check_runtime_args,
    check_tp_split,
    checkpoint_dir,
    demo_checkpoint,
    load_session,
    sampling_params,
)

DEMO_PROMPT = "Write one sentence about the sea."
__all__ = ["build_parser", "run", "main", "demo_checkpoint"]


def build_parser() -> Parser:
    p = Parser(prog="dsv4 decode", description="Batch-1 DeepSeek-V4 decoding of one prompt "
               "(CUDA graphs or eager). Flags, JSON fields and exit codes: docs/CLI.md.")
    add_model_args(p)
    pr = p.add_argument_group("prompt").add_mutually_exclusive_group()
    pr.add_argument("--prompt", help="prompt text (chat-encoded unless --raw)")
    pr.add_argument("--prompt-file", help="file with the prompt text")
    pr.add_argument("--prompt-ids", help="comma-separated token ids, used as given")
    pr.add_argument("--messages", help="JSON file: a list of messages or {messages, tools}")
    p.add_argument("--raw", action="store_true", help="encode the text as-is (no chat template)")
    p.add_argument("--thinking", action="store_true", help="thinking mode of the chat encoding")
    p.add_argument("--system", help="system prompt")
    add_sampling_args(p, max_new_tokens=64)
    p.add_argument("--force-ids", help="teacher forcing: feed these ids instead of sampled ones")
    add_runtime_args(p, parallel=True)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object on stdout at the end")
    o.add_argument("--dump-logits", help="save float32 logits [n_generated, vocab] to PATH.npy")
    o.add_argument("--profile", default="none", choices=("none", "torch", "nsys"),
                   help="profile decode steps (docs/CLI.md)")
    o.add_argument("--profile-steps", default="10-20", help="decode steps A-B to profile")
    return p


def _parse_ids(text: str, flag: str) -> list[int]:
    items = text.split(",")
    if len(items) > 1 and items[-1].strip() == "":
        items.pop()            # one trailing comma, as scripts write lists
    if all(t.strip() == "" for t in items):
        raise InputError(f"{flag} is empty: give at least one token id")
    for i, t in enumerate(items):
        if t.strip() == "":    # "1,,2": a missing id, not two ids
            raise InputError(f"{flag} {text!r}: item {i + 1} is empty; expected comma-separated "
                             "integers like 1,2,3")
    try:
        # each item stripped, never the spaces inside it: "1 2 3" is not the id 123
        return [int(t) for t in items]
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated integers like 1,2,3") from None


def _prompt_ids(args, tok, demo: bool) -> list[int]:
    from ..text.tokenizer import build_prompt_ids, load_messages
    if args.prompt_ids is not None:
        return _parse_ids(args.prompt_ids, "--prompt-ids")
    text = args.prompt
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise InputError(f"--prompt-file {args.prompt_file}: cannot read ({e.strerror})") \
                from None
        except UnicodeDecodeError as e:
            raise InputError(f"--prompt-file {args.prompt_file} is not UTF-8 text (byte "
                             f"0x{e.object[e.start]:02x} at offset {e.start}); save it as UTF-8") \
                from None
    messages = load_messages(args.messages) if args.messages is not None else None
    if text is None and messages is None:
        if not demo:
            raise InputError("no prompt: give --prompt, --prompt-file, --prompt-ids or --messages")
        text = DEMO_PROMPT
    return build_prompt_ids(tok, prompt=text, messages=messages, system=args.system,
                            thinking=args.thinking, raw=args.raw)


class Stream:
    """Streams generated tokens as text and remembers them (and when they came), so a run cut
    by Ctrl-C still has its tokens and timings."""

    def __init__(self, out, tok, eos: int | None):
        from ..text.tokenizer import IncrementalDetokenizer
        self.out, self.eos, self.detok = out, eos, IncrementalDetokenizer(tok)
        self.ids: list[int] = []
        self.t0 = self.t_first = self.t_last = time.perf_counter()

    def start(self) -> None:
        self.t0 = self.t_first = self.t_last = time.perf_counter()

    def push(self, tid: int) -> None:
        self.t_last = time.perf_counter()
        if not self.ids:
            self.t_first = self.t_last
        self.ids.append(tid)
        if tid == self.eos:
            return
        piece = self.detok.push(tid)
        if piece:
            self.out.write(piece)
            self.out.flush()

    def finish(self) -> None:
        """The rest of the text and the newline that ends it."""
        self.out.write(self.detok.flush() + "\n")
        self.out.flush()

    def timings(self, n_prompt: int) -> dict:
        """generate()'s timings, measured from the tokens as they arrived (for a cut run)."""
        from ..runtime.session import _timings
        return _timings(n_prompt, max(len(self.ids) - 1, 0), self.t0, self.t_first, self.t_last)


def run(args) -> int:
    from ..runtime.profiling import Profiler, parse_steps
    from ..runtime.session import GenerationResult
    from ..text.tokenizer import load_tokenizer
    from ..weights.config import ModelConfig

    out = sys.stderr if args.json else sys.stdout
    devices, mode = check_runtime_args(args)
    sampling, seed = sampling_params(args)
    force = _parse_ids(args.force_ids, "--force-ids") if args.force_ids is not None else None
    tp = args.parallel == "tp"
    if tp and args.profile != "none":
        raise InputError("--profile with --parallel tp: profile a one-process run (--parallel "
                         "pipeline), or each rank under nsys yourself (docs/CLI.md)")
    if args.profile != "none":
        parse_steps(args.profile_steps)
        if args.profile == "nsys" and not devices[0].startswith("cuda"):
            raise InputError("--profile nsys needs CUDA; use --profile torch on the CPU")
    # every output path before anything is downloaded or loaded (a failed write after the
    # whole generation would lose it)
    dump = check_output_path(args.dump_logits, "--dump-logits", ".npy")
    if args.profile == "torch":
        from ..runtime.profiling import PROFILES_DIR
        check_output_dir(PROFILES_DIR, "--profile torch")
    demo = args.demo or not args.ckpt
    ckpt = checkpoint_dir(args)
    cfg = ModelConfig.from_json(ckpt)
    check_checkpoint_args(args, cfg)
    check_tp_split(args, cfg, devices)
    tok = load_tokenizer(ckpt)

    # ---- the prompt (all checks before any allocation) ------------------------------------
    prompt_ids = _prompt_ids(args, tok, demo)
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

    if tp:
        return _run_tp(args, ckpt, cap, devices, mode, sampling, seed, prompt_ids, n_new, force,
                       dump, tok, out)

    # ---- load, generate (Ctrl-C keeps the tokens so far) ----------------------------------
    session, load_s = load_session(args, ckpt, cap, devices, mode, sampling)
    with session:
        stream = Stream(out, tok, None if force is not None else tok.eos_id)
        prof = Profiler(args.profile, args.profile_steps, session)
        interrupted = False
        try:
            with prof:
                stream.start()
                res = session.generate(prompt_ids, n_new, force_ids=force, eos_id=tok.eos_id,
                                       on_token=stream.push, progress=not args.json,
                                       keep_logits=args.dump_logits is not None)
        except KeyboardInterrupt:
            interrupted = True
            res = GenerationResult(prompt_ids, list(stream.ids), "interrupted", None,
                                   stream.timings(len(prompt_ids)))
        stream.finish()
        if dump is not None and res.logits is not None:
            import numpy as np
            np.save(dump, res.logits.numpy().astype("float32"))
        text_ids = res.output_ids[:-1] if res.finish_reason == "eos" else res.output_ids
        timings = {"load_s": load_s, "capture_s": session.capture_s, **res.timings}
        mem = _memory(session)
        if args.json:
            print(json.dumps({"prompt_ids": prompt_ids, "output_ids": res.output_ids,
                              "text": tok.decode(text_ids), "finish_reason": res.finish_reason,
                              "interrupted": interrupted, "device": ",".join(devices),
                              "mode": mode, "granularity": args.granularity if mode == "graph"
                              else None, "dtype": args.dtype, "seed": seed, "timings": timings,
                              "memory": mem, "profile": prof.summary_path,
                              "backend": session.model.binding.table(),
                              **({k: timings[k] for k in ("speculative", "acceptance_rate",
                                                          "tokens_per_step") if k in timings})}))
        else:
            _summary(res, timings, mem, mode, devices, seed, prompt_ids, prof)
        if interrupted and args.dump_logits:
            print(f"[dsv4] interrupted: {args.dump_logits} not written", file=sys.stderr)
    return 130 if interrupted else 0


def _run_tp(args, ckpt, cap, devices, mode, sampling, seed, prompt_ids, n_new, force, dump, tok,
            out) -> int:
    """--parallel tp: one process a device (dsv4.parallel.launch; or, under torchrun, this
    process is the rank torchrun made it, and rank 0 reports), each loading its shard and running
    the same generation; rank 0 streams the text. Ctrl-C ends every rank (the text so far stays on
    the screen; no summary, exit 130)."""
    from ..errors import ParallelError
    from ..parallel import launch
    from ..runtime.config import DTYPES, RuntimeConfig
    rt = RuntimeConfig(max_seq_len=cap, dtype=DTYPES[args.dtype], devices=(devices[0],),
                       prefill_chunk=args.prefill_chunk, mtp=bool(args.speculative),
                       prefill_graphs=args.prefill_graphs if mode == "graph" else 0)
    job = dict(ckpt=str(ckpt), rt=rt, prompt_ids=prompt_ids, n_new=n_new, force=force,
               sampling=sampling, mode=mode, granularity=args.granularity,
               speculative=args.speculative, spec_min=args.speculative_min_acceptance,
               eos=tok.eos_id, keep_logits=dump is not None, json_out=args.json)
    import os
    if "WORLD_SIZE" in os.environ:      # started by torchrun: this process is one of the ranks
        from ..parallel import start_from_env
        world = int(os.environ["WORLD_SIZE"])
        if world != len(devices):
            raise InputError(f"--parallel tp --device {','.join(devices)}: {len(devices)} "
                             f"devices, but torchrun started {world} processes; give one "
                             f"device per process")
        group = start_from_env(devices)
        mine = _tp_rank(group, job)
        small = group.all_gather_object({k: mine[k] for k in ("output_ids", "memory")})
        got = [mine] + small[1:]
        group.close()
        if group.rank != 0:              # rank 0 reports for every rank
            return 0
    else:
        try:
            got = launch(_tp_rank, devices, job)
        except KeyboardInterrupt:
            print("\n[dsv4] interrupted: every rank ended", file=sys.stderr)
            return 130
    ids = [r["output_ids"] for r in got]
    if any(i != ids[0] for i in ids):
        raise ParallelError(f"the ranks generated different tokens ({ids}): their logits must be "
                            f"the same bits on every rank; report this as a bug")
    r0 = got[0]
    res_ids, finish = r0["output_ids"], r0["finish_reason"]
    if dump is not None and r0["logits"] is not None:
        import numpy as np
        np.save(dump, r0["logits"].numpy().astype("float32"))
    text_ids = res_ids[:-1] if finish == "eos" else res_ids
    timings = r0["timings"]
    mem = {"graph_bytes": {k: v for r in got for k, v in r["memory"]["graph_bytes"].items()},
           "peak_bytes": {k: v for r in got for k, v in r["memory"].get("peak_bytes", {}).items()}}
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "output_ids": res_ids,
                          "text": tok.decode(text_ids), "finish_reason": finish,
                          "interrupted": False, "device": ",".join(devices), "parallel": "tp",
                          "mode": mode, "granularity": args.granularity if mode == "graph"
                          else None, "dtype": args.dtype, "seed": seed, "timings": timings,
                          "memory": mem, "profile": None, "backend": r0["backend"],
                          **({k: timings[k] for k in ("speculative", "acceptance_rate",
                                                      "tokens_per_step") if k in timings})}))
    else:
        from types import SimpleNamespace
        _summary(SimpleNamespace(output_ids=res_ids, finish_reason=finish), timings, mem, mode,
                 devices, seed, prompt_ids, SimpleNamespace(summary_path=None))
    return 0


def _tp_rank(group, job: dict) -> dict:
    """One rank of `dsv4 decode --parallel tp` (a module-level function: the launcher runs it in
    each rank's process): its shard loaded, the generation run as one process would; rank 0
    streams the text. -> the rank's output ids, timings, memory (rank 0: logits when asked, the
    backend table)."""
    import torch

    from ..runtime.session import Session
    from ..runtime.tp import cpu_share, load_rank
    from ..text.tokenizer import load_tokenizer
    first = group.rank == 0
    if group.device.type == "cpu":   # CPU ranks share the host's cores: each takes its share
        torch.set_num_threads(cpu_share(group.world_size))
    t0 = time.perf_counter()
    model, ck = load_rank(group, job["ckpt"], job["rt"], progress=first and not job["json_out"])
    ck.close()
    if first and ck.notice:
        print(f"[dsv4] notice: {ck.notice}", file=sys.stderr)
    load_s = time.perf_counter() - t0
    session = Session(model, job["sampling"], mode=job["mode"], granularity=job["granularity"],
                      speculative=job["speculative"], spec_min_acceptance=job["spec_min"])
    with session:
        force = job["force"]
        stream = None
        if first:
            tok = load_tokenizer(job["ckpt"])
            stream = Stream(sys.stderr if job["json_out"] else sys.stdout, tok,
                            None if force is not None else job["eos"])
            stream.start()
        res = session.generate(job["prompt_ids"], job["n_new"], force_ids=force, eos_id=job["eos"],
                               on_token=stream.push if stream else None,
                               progress=first and not job["json_out"],
                               keep_logits=job["keep_logits"])
        if stream is not None:
            stream.finish()
        model.tp.comm.check()
        got = {"rank": group.rank, "output_ids": list(res.output_ids),
               "finish_reason": res.finish_reason,
               "timings": {"load_s": load_s, "capture_s": session.capture_s, **res.timings},
               "memory": _memory(session),
               "logits": res.logits if first else None,
               "backend": model.binding.table() if first else None}
    model.tp.comm.close()
    return got


def _memory(session) -> dict:
    import torch
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


def _summary(res, t, mem, mode, devices, seed, prompt_ids, prof) -> None:
    w = sys.stderr.write
    how = "greedy" if seed is None else f"seed={seed}"
    w(f"[dsv4] mode={mode} device={','.join(devices)} {how} prompt={len(prompt_ids)} tokens "
      f"generated={len(res.output_ids)} ({res.finish_reason})\n")
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
