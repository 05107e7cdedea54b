#!/usr/bin/env python
"""A soak of the server: `python scripts/bench_soak.py [--ckpt DIR] [--requests 10000]
[--concurrency 8] [--json]` (mixed requests on loopback; errors, memory over time, the latency
of a short request; flags: dsv4/cli/bench.py, logic: dsv4/bench/soak.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.cli.bench import soak_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
