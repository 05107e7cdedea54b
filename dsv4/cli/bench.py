"""`dsv4 bench` (scripts/bench.py) and scripts/bench_serve.py: their flags and their output; the
measurements are dsv4.bench.decode and dsv4.bench.serve (method and results: BENCHMARKS.md)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from ..bench import MIN_STEPS
from ..errors import exit_code
from ..weights.presets import PRESETS
from .options import Parser, add_runtime_args, check_runtime_args, demo_checkpoint

# the measurements import torch: each command imports its own when it runs (--help needs none)
DTYPES = ("bfloat16", "float32")     # dsv4.runtime.config.DTYPES' names (a test keeps them equal)


def build_parser() -> argparse.ArgumentParser:
    """`dsv4 bench`'s flags (defaults in --help, a usage error is one line)."""
    p = Parser(prog="dsv4 bench", description="Batch-1 decode benchmark on device-generated weights "
                "(method: BENCHMARKS.md).")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the model's shapes")
    p.add_argument("--layers", type=int, default=None, help="first N layers (default: all)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda:0 | cuda:0,cuda:1 (the "
                   "layers split over several, as in dsv4 decode)")
    # the spelling of earlier releases (every other command says --device): still read, not shown
    p.add_argument("--devices", dest="device", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--parallel", default="pipeline", choices=("pipeline", "tp"),
                   help="several devices: the layers split over them (pipeline), or every layer "
                        "split over them, one process a device (tp: dsv4.bench.tp)")
    p.add_argument("--context", type=int, default=4096, help="decode position L (state filled)")
    p.add_argument("--steps", type=int, default=100, help=f"timed steps (>= {MIN_STEPS} to report)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--mode", default="both", choices=("both", "eager", "graph"),
                   help="eager steps, CUDA graph replays, or both")
    p.add_argument("--granularity", default="staged",
                   choices=("staged", "segment", "device", "both", "all"),
                   help="graph mode: each device run as graphs of 2, 4, 8, ... segments "
                        "(staged: what decode, chat and serve replay), one graph per layer "
                        "(segment), per device run, segment and device (both), or all three")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="activation dtype")
    p.add_argument("--seed", type=int, default=0, help="weight / state seed")
    p.add_argument("--json", default=None, metavar="PATH|-", help="write the report as JSON "
                   "(- : stdout, the table then goes to stderr)")
    p.add_argument("--reserve-gib", type=float, default=2.0, help="per-device workspace assumed "
                   "by the memory check (besides weights, state, generation temporaries)")
    p.add_argument("--no-kernels", action="store_true", help="skip the profiled kernel count")
    p.add_argument("--prefill", default=None, metavar="N[,N...]",
                   help="also time prefill of prompts of these lengths (TTFT, tok/s, floors)")
    p.add_argument("--prefill-reps", type=int, default=3, help="timed prefills per length")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill chunk (default: "
                   "the runtime's)")
    p.add_argument("--prefill-kernels", default="on", choices=("on", "off"),
                   help="off: the torch prefill path (the state before the prefill kernels)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode measurement")
    p.add_argument("--speculative", action="store_true",
                   help="also measure the speculative mechanism (MTP block loaded): verify pass "
                        "T = 1..4, the speculative step, end-to-end tok/s with an oracle drafting right at "
                        "rates a")
    p.add_argument("--spec-tokens", type=int, default=256, metavar="N",
                   help="with --speculative: tokens per end-to-end run (default 256)")
    p.add_argument("--prefill-graphs", type=int, default=0, metavar="N",
                   help="CUDA: capture prefill chunk graphs of 1..N tokens (a power of two) and "
                        "time prompts up to N through them (capture time, each chunk's replay and eager time in the JSON)")
    p.add_argument("--prefill-profile", action="store_true",
                   help="CUDA: one profiled prefill per length (kernel count, top kernels)")
    p.add_argument("--trace", metavar="PREFIX", default=None,
                   help="write the Chrome trace of the profiled step to PREFIX-<mode>[-<granularity>]"
                        ".json (needs the kernel count)")
    p.add_argument("--layer-kernels", action="store_true",
                   help="CUDA: for the first layer of each kind, each kernel op replayed alone (PDL "
                        "off, L2 flushed) with the bytes it reads, against the layer replayed "
                        "whole: what the kernel boundaries cost")
    p.add_argument("--layer-rows", type=int, default=1, metavar="T",
                   help="--layer-kernels of a verify step of T rows (speculative decoding's "
                        "verify; default 1: the plain step)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return exit_code(lambda: _main(argv))


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.parallel == "tp":
        from ..bench import tp as bench_run
    else:
        from ..bench import decode as bench_run
    rep = bench_run.run(args, command="python scripts/bench.py " + shlex.join(argv))
    table = bench_run.format_table(rep)
    if args.json == "-":
        print(table, file=sys.stderr)
        print(json.dumps(rep))
    else:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rep, fh, indent=1)
        print(table)
    return 0


def serve_parser() -> argparse.ArgumentParser:
    """scripts/bench_serve.py's flags."""
    p = Parser(prog="bench_serve.py",
               description="What the server adds to decoding: time to first token and time per "
                           "streamed token through scripts/serve.py, against the in-process "
                           "Session on the same checkpoint and flags.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_runtime_args(p, 4096, "cache capacity (default 4096)")
    return p


def serve_main(argv=None) -> int:
    """scripts/bench_serve.py."""
    def run():
        args = serve_parser().parse_args(argv)
        from ..bench import serve as bench_serve
        devices, mode = check_runtime_args(args)
        return bench_serve.run(args, devices, mode)
    return exit_code(run)


def soak_parser() -> argparse.ArgumentParser:
    """scripts/bench_soak.py's flags."""
    p = Parser(prog="bench_soak.py",
               description="A soak of the server: mixed requests from concurrent clients on "
                           "loopback; errors, memory over time, short-request latency.")
    p.add_argument("--ckpt", help="checkpoint directory (default: the demo checkpoint)")
    p.add_argument("--requests", type=int, default=10000, metavar="N")
    p.add_argument("--duration", type=float, metavar="S",
                   help="send no new request after S seconds (default: until --requests)")
    p.add_argument("--concurrency", type=int, default=8, metavar="C",
                   help="clients sending at once")
    p.add_argument("--warmup", type=int, default=500, metavar="W",
                   help="requests before the memory baseline")
    p.add_argument("--solo", type=int, default=20, metavar="K",
                   help="short chats sent one at a time first (the latency alone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--read-timeout", type=float, default=2.0,
                   help="the server's --read-timeout (each slow client waits this long)")
    p.add_argument("--max-request-bytes", type=int, default=65536,
                   help="the server's --max-request-bytes (the oversized bodies go one past it)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p


def soak_main(argv=None) -> int:
    """scripts/bench_soak.py."""
    def run():
        args = soak_parser().parse_args(argv)
        from ..bench import soak as bench_soak
        return bench_soak.run(args, args.ckpt or demo_checkpoint())
    return exit_code(run)
