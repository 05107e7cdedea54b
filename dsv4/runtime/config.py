"""Runtime knobs, apart from the model's hyper-parameters: `RuntimeConfig` (capacity, activation
dtype, devices, prefill chunk and graphs, the MTP block, the backend's switches), the activation
dtype table, the resolution of --device / --mode, and the placement of the layers over the
devices (contiguous ranges balanced by the checkpoint's bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from graphs import balanced_placement

from ..backend.decision import Options
from ..errors import ConfigError, DeviceError, InputError
from ..model.sharding import TP_DEGREES
from .defaults import PREFILL_CHUNK   # noqa: F401  (re-exported: the default prefill chunk)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PREFILL_GRAPHS_EXPECTED = "expected 0 (off) or a power of two"


def prefill_graphs_ok(g) -> bool:
    """Whether g is a valid prefill_graphs value: 0 (off) or a power of two (an int)."""
    return not isinstance(g, bool) and isinstance(g, int) and g >= 0 and not g & (g - 1)


@dataclass(frozen=True)
class RuntimeConfig:
    """Runtime knobs, apart from the model hyper-parameters."""
    max_seq_len: int = 4096
    dtype: torch.dtype = torch.bfloat16          # activation dtype: bfloat16 or float32
    devices: tuple = ("cpu",)                    # layer devices in pipeline order; head on [0]
    cache_dense: bool | None = None              # keep dequantized weights (default: CPU only)
    prefill_chunk: int = PREFILL_CHUNK           # prompt tokens per prefill pass (bounds memory)
    mtp: bool = False                            # hold the MTP block (speculative decoding)
    prefill_graphs: int = 0                      # graph mode: largest captured prefill chunk
    # (a power of two; 0 = off): prompts up to it replay chunk graphs (dsv4.runtime.prefill_graphs)
    options: Options | None = None               # the backend's runtime switches
    # (dsv4.backend.Options); None: the DSV4_* environment variables, read once by Transformer
    tp: int = 1                                  # tensor-parallel degree: ranks, one device
    # each, every layer split over them (dsv4.model.sharding); devices then holds this rank's
    # one device and build_model takes the rank's communicator (dsv4.runtime.tp does both)

    def __post_init__(self):
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise ConfigError(f"dtype = {self.dtype}; allowed: bfloat16, float32")
        if not prefill_graphs_ok(self.prefill_graphs):
            raise ConfigError(f"prefill_graphs = {self.prefill_graphs!r}; "
                              f"{PREFILL_GRAPHS_EXPECTED}")
        if self.options is not None and not isinstance(self.options, Options):
            raise ConfigError(f"options = {self.options!r}; expected a dsv4.backend.Options")
        for name in ("max_seq_len", "prefill_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} = {v!r}; expected a positive integer")
        if isinstance(self.tp, bool) or self.tp not in TP_DEGREES:
            raise ConfigError(f"tp = {self.tp!r}; allowed: {', '.join(map(str, TP_DEGREES))} "
                              f"(the tensor-parallel degree: ranks, one device each)")
        object.__setattr__(self, "devices", tuple(torch.device(d) for d in self.devices))
        if self.tp > 1 and len(self.devices) != 1:
            raise ConfigError(f"tp = {self.tp} with devices = {tuple(map(str, self.devices))}: a "
                              f"tensor-parallel rank runs on one device; give this rank's device "
                              f"only (dsv4.runtime.tp sets it from the process group), or tp = 1 "
                              f"for the pipeline over these devices")
        cuda = [d for d in self.devices if d.type == "cuda"]
        if cuda and not torch.cuda.is_available():   # else torch raises a bare AssertionError
            raise DeviceError(f"devices = {tuple(map(str, self.devices))}: this torch build has "
                              f"no CUDA ({torch.__version__}; torch.cuda.is_available() is False); "
                              f"use devices=('cpu',), or install a CUDA build of torch")
        for d in cuda:
            if (d.index or 0) >= torch.cuda.device_count():
                raise DeviceError(f"devices: {d} does not exist; this machine has "
                                  f"{torch.cuda.device_count()} CUDA device(s)")


def check_prefill_graphs(g, mode: str | None = None, speculative: bool = False) -> None:
    """The --prefill-graphs flag: its value, then (mode given) against the resolved mode and
    --speculative; InputError naming the flag and the fix
    (RuntimeConfig checks the value with its field's name)."""
    if not prefill_graphs_ok(g):
        raise InputError(f"--prefill-graphs {g}: {PREFILL_GRAPHS_EXPECTED} (the largest captured "
                         f"chunk, e.g. 256)")
    if not g or mode is None:        # the value alone: the call before the devices resolve
        return
    if mode != "graph":
        raise InputError(f"--prefill-graphs {g} needs graph mode (CUDA, --mode graph or auto); use "
                         f"--prefill-graphs 0")
    if speculative:
        raise InputError(f"--prefill-graphs {g}: a prefill that the MTP block follows "
                         f"(--speculative) does not replay chunk graphs; use --prefill-graphs 0")


def resolve_devices(device: str) -> list[str]:
    """--device auto|cpu|cuda|cuda:0,cuda:1 -> device names; never touches CUDA for 'cpu'."""
    if device == "cpu":
        return ["cpu"]
    if device == "auto":
        return ["cuda:0"] if torch.cuda.is_available() else ["cpu"]
    devs = [d.strip() for d in device.split(",") if d.strip()]
    if not devs:
        raise InputError(f"--device {device!r}: expected auto, cpu, cuda or cuda:0,cuda:1,...")
    for d in devs:
        if d.startswith("cuda"):
            if not torch.cuda.is_available():
                raise DeviceError(f"--device {device}: CUDA is not available on this machine; use "
                                  f"--device cpu (or auto)")
            try:
                idx = torch.device(d).index or 0
            except RuntimeError:
                raise InputError(f"--device {d!r}: not a device name") from None
            if idx >= torch.cuda.device_count():
                raise DeviceError(f"--device {d}: only {torch.cuda.device_count()} CUDA device(s)")
        elif d != "cpu":
            raise InputError(f"--device {d!r}: expected cpu or cuda[:i]")
    if "cpu" in devs and len(devs) > 1:
        raise InputError(f"--device {device}: cannot mix cpu with CUDA devices")
    return ["cuda:0" if d == "cuda" else d for d in devs]


def resolve_tp_devices(device: str) -> list[str]:
    """--device of a tensor-parallel run (--parallel tp): one rank a device, cpu,cpu (gloo) or
    distinct CUDA devices cuda:0,cuda:1[,...] (NCCL); as many as a degree the model takes."""
    devs = [d.strip() for d in device.split(",") if d.strip()]
    if device == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devs = [f"cuda:{i}" for i in range(max(d for d in TP_DEGREES if d <= max(n, 1)))]
    if len(devs) < 2:
        raise InputError(f"--parallel tp --device {device}: give one device per rank, at least "
                         f"two (cuda:0,cuda:1, or cpu,cpu on the CPU)")
    if all(d == "cpu" for d in devs):
        out = devs
    else:
        out = resolve_devices(",".join(devs))          # CUDA only, each present
        idx = [torch.device(d).index or 0 for d in out]
        if len(set(idx)) != len(idx):
            raise InputError(f"--parallel tp --device {device}: a device twice; one rank a GPU")
    if len(out) not in TP_DEGREES:
        raise InputError(f"--parallel tp --device {device}: {len(out)} ranks; allowed "
                         f"{', '.join(str(d) for d in TP_DEGREES if d > 1)}")
    return out


def resolve_mode(mode: str, devices: Sequence[str]) -> str:
    """'auto' -> 'graph' on CUDA, 'eager' on the CPU; 'graph' without CUDA is a DeviceError."""
    on_cuda = str(devices[0]).startswith("cuda")
    if mode == "auto":
        return "graph" if on_cuda else "eager"
    if mode == "graph" and not on_cuda:
        raise DeviceError("mode='graph' needs CUDA (no CUDA device in use); use mode='eager' or "
                          "mode='auto'")
    if mode not in ("graph", "eager"):
        raise InputError(f"mode={mode!r}: allowed 'auto', 'graph', 'eager'")
    return mode


def layer_placement(ckpt, devices: Sequence) -> list | None:
    """The device of each main layer: contiguous ranges over `devices` balanced by the bytes of
    each layer in the checkpoint (the head's globals on devices[0]); None for one device (all
    layers there)."""
    if len(devices) < 2:
        return None
    cfg = ckpt.config
    per_layer = [ckpt.nbytes(ckpt.prefix_names(f"layers.{l}.")) for l in range(cfg.n_layers)]
    head = ckpt.nbytes([n for n in ckpt.global_names() if not n.startswith("mtp.")])
    return balanced_placement(per_layer, list(devices), head)
