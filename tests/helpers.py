"""Shared test helpers: small synthetic checkpoints written once per session."""
from __future__ import annotations

from pathlib import Path

from dsv4.presets import TINY

# TINY's architecture (hash layer, window-only, ratio 4 + indexer, ratio 16, MTP) at vocab 2048
SMALL = TINY.replace(vocab_size=2048)


def small_checkpoint(root: Path, weights: str = "fp8", cfg=SMALL, seed: int = 0) -> Path:
    from dsv4.synthetic import write_checkpoint
    out = root / f"small-{weights}-{seed}"
    if not (out / "config.json").exists():
        write_checkpoint(cfg, out, weights=weights, seed=seed, shards=2)
    return out
