#!/usr/bin/env python
"""The host cost per token of a structured-output mask, xgrammar against llguidance, over the real
DeepSeek-V4 vocabulary: `python scripts/bench_grammar.py [--tokens N] [--json]` (logic:
dsv4/bench/grammar.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.bench.grammar import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
