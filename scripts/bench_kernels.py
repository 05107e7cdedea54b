"""Benchmark the dsv4 decode kernels (FP8 / bf16 GEMV, routed FP4 experts) at the real shapes on CUDA.

  python scripts/bench_kernels.py [--preset flash|pro] [--reps 50] [--only wq_b,experts]
                                  [--sweep] [--no-torch] [--json PATH] [--tp N]
                                  [--contexts 4096,1040000]
Prints copy bandwidth, then per kernel: shape, weight+scale bytes, median us [min-max], TB/s, % of copy
bandwidth and the torch-path time. --sweep also times neighbouring launch configs (tuning aid);
--tp N: a tensor-parallel rank's shard shapes (the split weights' rows / columns over N);
--contexts: the tokens of context the indexer and attention cases take.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash", choices=("flash", "pro"))
    p.add_argument("--reps", type=int, default=50, help="timed graph replays per kernel (>= 50)")
    p.add_argument("--only", default="", help="comma-separated substrings of kernel names")
    p.add_argument("--sweep", action="store_true", help="also time neighbouring configs")
    p.add_argument("--no-torch", action="store_true", help="skip the torch-path timings")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--tp", type=int, default=1,
                   help="a tensor-parallel rank's shapes: the split weights over this many ranks")
    p.add_argument("--contexts", default="4096,1040000",
                   help="comma-separated contexts (tokens) of the index and attention cases")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="both", choices=("cuda", "triton", "both"),
                   help="which implementation to time (both: a row each)")
    args = p.parse_args()
    try:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c)
    except ValueError:
        contexts = ()
    if not contexts or min(contexts) < 128:
        p.error(f"--contexts {args.contexts!r}: expected comma-separated token counts >= 128")
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from dsv4.backend.decision import cuda_status
    from dsv4.bench import kernels as bench
    dev = torch.device(args.device)
    cuda_status(dev)   # the first load: a prebuilt library (DSV4_CUDA_LIB) where one is named
    bw = bench.copy_bandwidth(dev)
    name = torch.cuda.get_device_name(dev)
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}; preset {args.preset}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write)"
          + (f"; a rank's shapes of tp {args.tp}" if args.tp > 1 else ""))
    print(bench.HEADER)
    rows = []
    only = [s for s in args.only.split(",") if s]
    backends = ("triton", "cuda") if args.backend == "both" else (args.backend,)
    for case in bench.build_cases(args.preset, dev, only, tp=args.tp, contexts=contexts):
        for b in backends:
            row = bench.run_case(case, bw, args.reps, args.sweep, not args.no_torch and b == "triton",
                                 impl=b)
            if row is not None:
                rows.append(row)
                print(bench.format_row(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__,
                       "preset": args.preset, "tp": args.tp, "copy_bw": bw, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
