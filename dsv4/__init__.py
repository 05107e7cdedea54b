"""dsv4: batch-1 DeepSeek-V4 decoding with CUDA graphs (README.md). The packages are the layers of
docs/ARCHITECTURE.md, top to bottom: cli, bench, server, runtime, backend, model, kernels,
numerics, weights, text (errors: every layer's typed exceptions).

The names an embedding program needs are here, imported on first use (`import dsv4` loads no
torch): `from dsv4 import Session, load_model, RuntimeConfig, SamplingParams, build_prompt_ids`.
The module paths of earlier releases (`dsv4.session`, `dsv4.tokenizer`, ...) still import, as
the modules of their new homes (ALIASES).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# public name -> the module that defines it
PUBLIC = {
    "Session": "dsv4.runtime.session", "load_model": "dsv4.runtime.session",
    "GenerationResult": "dsv4.runtime.session",
    "RuntimeConfig": "dsv4.runtime.config",
    "SamplingParams": "dsv4.runtime.sampling",
    "StateSnapshot": "dsv4.runtime.snapshot", "PrefixCache": "dsv4.runtime.prefix_cache",
    "Transformer": "dsv4.model.transformer",
    "ModelConfig": "dsv4.weights.config", "open_checkpoint": "dsv4.weights.checkpoint",
    "Options": "dsv4.backend.options",
    "load_tokenizer": "dsv4.text.tokenizer", "build_prompt_ids": "dsv4.text.tokenizer",
    "build_followup_ids": "dsv4.text.tokenizer",
    "IncrementalDetokenizer": "dsv4.text.tokenizer",
    "encode_messages": "dsv4.text.chat", "parse_completion": "dsv4.text.chat",
}
# module path of an earlier release -> where it lives now (the same module object)
ALIASES = {
    "dsv4.session": "dsv4.runtime.session", "dsv4.sampling": "dsv4.runtime.sampling",
    "dsv4.snapshot": "dsv4.runtime.snapshot", "dsv4.prefix_cache": "dsv4.runtime.prefix_cache",
    "dsv4.prefill_graphs": "dsv4.runtime.prefill_graphs",
    "dsv4.spec_policy": "dsv4.runtime.speculative.policy",
    "dsv4.tokenizer": "dsv4.text.tokenizer", "dsv4.chat": "dsv4.text.chat",
    "dsv4.config": "dsv4.weights.config", "dsv4.presets": "dsv4.weights.presets",
    "dsv4.checkpoint": "dsv4.weights.checkpoint", "dsv4.synthetic": "dsv4.weights.synthetic",
    "dsv4.device_weights": "dsv4.weights.device_weights",
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name in PUBLIC:
        value = getattr(importlib.import_module(PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(PUBLIC))


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec      # the import machinery set the alias's spec on it


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Imports an old module path (ALIASES) as the module of its new home."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in ALIASES:
            return importlib.util.spec_from_loader(fullname, _AliasLoader(ALIASES[fullname]))
        return None


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.append(_AliasFinder())
