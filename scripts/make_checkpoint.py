#!/usr/bin/env python
"""Write a random-weight DeepSeek-V4 checkpoint in the released format (config.json + shards).

python scripts/make_checkpoint.py (--preset tiny|tiny-dspark|flash|pro | --config PATH) --out DIR
       [--layers N] [--weights fp8|bf16] [--seed S] [--shards K]
Same as `dsv4 make-checkpoint`; the logic lives in dsv4/cli/main.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.cli.main import make_checkpoint  # noqa: E402

if __name__ == "__main__":
    sys.exit(make_checkpoint())
