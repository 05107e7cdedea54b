"""The runtime: one sequence at a time over a loaded model. `config` (RuntimeConfig: capacity,
dtype, devices, placement, mode), `session` (Session, load_model: prefill, the decode loop, plain
or speculative), `passes` (the static buffers and segments of a pass through the layers, the plain
decode step), `prefill` (a prompt in chunks, eager or replayed), `prefill_graphs`, `speculative/`
(the MTP self-speculative step), `sampling`, `snapshot` and `prefix_cache` (saved points),
`profiling`. Imports the backend, the model, weights, graphs/ and below; never the commands,
the server or the benchmarks.
"""
from .config import DTYPES, RuntimeConfig

__all__ = ["DTYPES", "RuntimeConfig"]
