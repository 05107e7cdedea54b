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
import importlib

# name -> its module (imported on first use)
_NAMES = {"RuntimeConfig": "config", "DTYPES": "config", "build_model": "build",
          "load_model": "build", "Session": "session"}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
