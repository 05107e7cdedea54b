#!/usr/bin/env python
"""OpenAI-compatible server: `python scripts/serve.py --ckpt DIR [--host 127.0.0.1] [--port 8000]`.

Flags: --help; endpoints and fields: docs/SERVING.md; the logic lives in dsv4/serve.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4.cli.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
