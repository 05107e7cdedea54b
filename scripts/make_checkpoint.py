#!/usr/bin/env python
"""Write a random-weight DeepSeek-V4 checkpoint in the released format (config.json + shards).

python scripts/make_checkpoint.py (--preset tiny|flash|pro | --config PATH) --out DIR
       [--layers N] [--weights fp8|bf16] [--seed S] [--shards K]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run without installing the package

from dsv4.config import ModelConfig  # noqa: E402
from dsv4.errors import UserInputError  # noqa: E402
from dsv4.presets import PRESETS, get_preset, truncate_layers  # noqa: E402
from dsv4.synthetic import WEIGHT_MODES, write_checkpoint  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"a named config: {', '.join(PRESETS)}")
    src.add_argument("--config", help="a config.json (released or inference style) or its folder")
    p.add_argument("--out", required=True, help="output folder (earlier checkpoint files there "
                   "are replaced)")
    p.add_argument("--layers", type=int, help="keep only the first N main layers")
    p.add_argument("--weights", default="fp8", help=f"{' | '.join(WEIGHT_MODES)}: FP8 linears + "
                   f"FP4 experts (the release format, default) or plain BF16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=2, help="number of shard files; 0 writes a "
                   "single model.safetensors without index (default 2)")
    a = p.parse_args(argv)
    try:
        cfg = get_preset(a.preset) if a.preset is not None else ModelConfig.from_json(a.config)
        if a.layers is not None:
            cfg = truncate_layers(cfg, a.layers)
        out = write_checkpoint(cfg, a.out, weights=a.weights, seed=a.seed, shards=a.shards)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
