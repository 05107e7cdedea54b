"""The runtime: one sequence at a time over a loaded model. `config` (RuntimeConfig: capacity,
dtype, devices, placement, mode), `session` (Session, load_model: prefill, the decode loop, plain
or speculative), `passes` (the static buffers and segments of a pass through the layers, the plain
decode step), `prefill` (a prompt in chunks, eager or replayed), `prefill_graphs`, `speculative/`
(the MTP self-speculative step), `sampling`, `snapshot` and `prefix_cache` (saved points),
`profiling`. Imports the backend, the model, weights, graphs/ and below; never the commands,
the server or the benchmarks.

`DTYPES` and `RuntimeConfig` are imported on first use, so that a torch-free submodule
(`defaults`, `speculative.policy`) imports without torch (the command's --help).
"""
from __future__ import annotations

import importlib

__all__ = ["DTYPES", "RuntimeConfig"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module(".config", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
