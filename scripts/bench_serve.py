#!/usr/bin/env python
"""What the server adds per streamed token and to the first token, against the in-process Session:
`python scripts/bench_serve.py --ckpt DIR [--device cuda:0] [--json]` (flags: dsv4/cli/bench.py, measurement: dsv4/bench/serve.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.cli.bench import serve_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
