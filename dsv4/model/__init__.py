"""The model's math, as the reference writes it, over weights in their stored formats and the
fixed-shape decode state: `transformer` (Transformer), `block`, `attention`, `indexer`,
`compressor`, `moe`, `linear`, `mtp`, `state`. Each sublayer runs the torch reference unless the
backend bound a fused implementation to it (dsv4/backend/binding.py); no module here decides
which.
Imports the numerics, weights (config, formats) and errors; never the kernels or the backend
(tests/dsv4/test_layers.py).
"""


def __getattr__(name: str):
    if name == "Transformer":
        from .transformer import Transformer
        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
