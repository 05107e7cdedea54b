"""The backend: which implementation serves each sublayer of the model on each device, decided
once when the model is built, and those implementations. `options` (the DSV4_* switches, read in
one place), `decision` (Backend, resolve: the per-device, per-model choice and its table), `ops`
(the named kernel ops: the one importer of dsv4.kernels), `fused/` (the sublayers' fused-kernel
implementations), `binding` (bind: each sublayer of a model to its implementation), `branches` (the
captured parallel branches). Imports the model, the kernels and below; the model never imports it.
"""
import importlib

# name -> its module (imported on first use: `dsv4.backend.options` needs no torch)
_NAMES = {"Binding": "binding", "bind": "binding", "Backend": "decision", "resolve": "decision",
          "Ops": "ops", "Options": "options"}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
