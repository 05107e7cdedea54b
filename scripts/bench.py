#!/usr/bin/env python
"""Decode benchmark: `python scripts/bench.py --preset flash --layers 8 --mode both --json -`.

Same as `dsv4 bench`. Method and results: BENCHMARKS.md; the flags in dsv4/cli/bench.py, the measurement in dsv4/bench/decode.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.cli.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
