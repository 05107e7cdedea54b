#!/usr/bin/env python
"""One-shot DeepSeek-V4 inference: `python scripts/decode.py --ckpt DIR --prompt "..."` (or --demo).

Same as `dsv4 decode`. Flags, outputs and exit codes: docs/CLI.md; the logic lives in dsv4/cli.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.cli.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
