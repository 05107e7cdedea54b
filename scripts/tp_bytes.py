#!/usr/bin/env python
"""Bytes each rank of a tensor-parallel run reads per decode token, and its byte floor, from a
preset's tensor shapes (no GPU, no weights): `python scripts/tp_bytes.py [--preset flash]
[--tp 1,2,4,8] [--context 4096] [--copy-tbps 4.25]`. The logic: dsv4/bench/memory.py
(tp_floor_table); the numbers and what they assume: BENCHMARKS.md.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.bench.memory import tp_floor_table  # noqa: E402
from dsv4.weights.presets import get_preset  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--tp", default="1,2,4,8", help="tensor-parallel degrees, comma-separated")
    ap.add_argument("--context", type=int, default=4096, help="the token's position")
    ap.add_argument("--copy-tbps", type=float, default=4.25,
                    help="a GPU's copy bandwidth in TB/s (default: the H200's measured 4.25)")
    args = ap.parse_args(argv)
    rows = tp_floor_table(get_preset(args.preset), [int(t) for t in args.tp.split(",")],
                          args.context, args.copy_tbps)
    print(f"{args.preset}, context {args.context}, copy {args.copy_tbps} TB/s")
    print("tp  GB/rank/token  replicated GB  floor ms")
    for r in rows:
        print(f"{r['tp']:<3} {r['bytes_per_rank'] / 1e9:>13.3f}  {r['replicated'] / 1e9:>13.3f}"
              f"  {r['floor_ms']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
