"""The model's math, as the reference writes it, over weights in their stored formats and the
fixed-shape decode state: `transformer` (Transformer), `block`, `attention`, `indexer`,
`compressor`, `moe`, `linear`, `mtp`, `state`. Each sublayer runs the torch reference unless the
backend bound a fused implementation to it (dsv4.backend.bind); no module here decides which.
Imports the numerics, weights (config, formats) and errors; never the kernels or the backend.
"""
from .transformer import Transformer

__all__ = ["Transformer"]
