"""The runtime's default knobs as plain numbers, importable without torch: the command's --help
shows them before anything heavy is imported (dsv4.cli.options), and RuntimeConfig uses them.
"""
from __future__ import annotations

PREFILL_CHUNK = 4096  # default prompt tokens per prefill pass: activations scale with it
