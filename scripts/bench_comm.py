#!/usr/bin/env python
"""All-reduce latencies per implementation, eager and in a CUDA graph, on two or more GPUs:
`python scripts/bench_comm.py --device cuda:0,cuda:1 [--sizes 4,8,16,64] [--impls oneshot,nccl]`;
large messages: `--sizes 1024,8192,32768 --impls twoshot,nccl,nccl_f32`.

The logic lives in dsv4/bench/comm.py; method and results: BENCHMARKS.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.bench.comm import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
