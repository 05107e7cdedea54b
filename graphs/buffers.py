"""Static buffers: specs with their fill values, the decoder-owned inputs with pinned host staging,
and the checks (device, overlap, moved pointers) the planner and debug mode rely on.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from graphs.errors import BufferError

STAGING_SLOTS = 2  # pinned host buffers per input: the host may run one step ahead without waiting


@dataclass(frozen=True)
class BufferSpec:
    """One static buffer: shape, dtype, device and the value it holds before anything writes it.

    The fill value is the single place padding lives (a benign index such as 0 or -1 that kernels
    skip, a length of 1, a position >= 1), so capture never sees degenerate dummies.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    fill: float | int | bool = 0

    def __post_init__(self):
        shape = tuple(self.shape)
        if not all(isinstance(n, int) and n >= 0 for n in shape):
            raise BufferError(f"BufferSpec {self.name!r}: shape {shape} must be non-negative ints")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "device", torch.device(self.device))

    def allocate(self) -> torch.Tensor:
        """A new tensor of this spec, filled with `fill` (call before capture; never reallocate)."""
        return torch.full(self.shape, self.fill, dtype=self.dtype, device=self.device)


def allocate_all(specs: Iterable[BufferSpec]) -> dict[str, torch.Tensor]:
    """{spec.name: spec.allocate()}, rejecting duplicate names."""
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name in out:
            raise BufferError(f"two BufferSpecs are named {spec.name!r}; names must be unique")
        out[spec.name] = spec.allocate()
    return out


def check_buffers(owner: str, kind: str, buffers: Mapping[str, object], device: torch.device) -> None:
    """Raise BufferError unless every value of `buffers` is a tensor on `device`."""
    for name, t in buffers.items():
        if t is None:
            raise BufferError(
                f"{owner}.{kind}[{name!r}] is None: state its owner allocates lazily (on first use) "
                "does not exist yet. Fix: have the owner allocate it before allocate() (its own "
                "init call); a buffer allocated after capture would alias graph memory.")
        if not isinstance(t, torch.Tensor):
            raise BufferError(f"{owner}.{kind}[{name!r}] is a {type(t).__name__}, not a tensor. "
                              "Fix: pass the static tensor itself (allocated once, before capture).")
        if t.device != device:
            raise BufferError(
                f"{owner}.{kind}[{name!r}] is on {t.device} but {owner} runs on {device}. Fix: "
                f"allocate it on {device} (a hand-off copy from another device is planned for you "
                "when the producer's buffer lives elsewhere); escape hatch: move the segment.")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `a` and `b` are the same memory with the same layout (a copy would be a no-op)."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `a` and `b` share any byte of memory on the same device."""
    if a.device != b.device:
        return False
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < b1 and b0 < a1


class LiveBuffers(Mapping):
    """A segment's `reads`/`writes` whose entries may live on another object: name -> tensor, or
    name -> (obj, "attr"), looked up as getattr(obj, "attr") at every access.

    State owned by a library object (a KV cache layer's `keys`) stays where it lives; the plan
    takes the tensors once at allocate() time, and debug mode re-reads them before each step, so
    `obj.attr = new_tensor` (a reallocation the graph would never see) raises DebugPointerError
    instead of replaying on freed memory, which a dict snapshot would hide.
    """

    def __init__(self, entries: Mapping[str, object]):
        self._entries = dict(entries)
        for name, v in self._entries.items():
            if not (isinstance(v, torch.Tensor) or (isinstance(v, tuple) and len(v) == 2
                                                    and isinstance(v[1], str))):
                raise BufferError(f"LiveBuffers[{name!r}] is a {type(v).__name__}; expected a "
                                  "tensor or an (object, 'attribute') pair")

    def __getitem__(self, name: str):
        v = self._entries[name]
        return v if isinstance(v, torch.Tensor) else getattr(v[0], v[1], None)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class PointerTable:
    """data_ptr() of every static buffer, re-read from the caller's mappings on `moved()`.

    Entries are (label, mapping, key): a model that rebinds a buffer in its mapping, or calls
    `.set_()` on it, shows up as moved; the captured graph would keep reading the old address.
    """

    def __init__(self, entries: Sequence[tuple[str, Mapping[str, torch.Tensor], str]]):
        self._entries = list(entries)
        self._ptrs = [m[k].data_ptr() for _, m, k in self._entries]

    def __len__(self) -> int:
        return len(self._entries)

    def moved(self) -> list[tuple[str, int, int]]:
        """[(label, old_ptr, new_ptr)] for every buffer whose address changed (0 = gone)."""
        out = []
        for (label, m, k), old in zip(self._entries, self._ptrs):
            t = m.get(k)
            new = t.data_ptr() if isinstance(t, torch.Tensor) else 0
            if new != old:
                out.append((label, old, new))
        return out


class StaticInputs:
    """Named input tensors on one (primary) device, owned by the decoder; callers copy values in.

    On CUDA each write goes host -> pinned staging slot -> device (non_blocking) on the current
    stream, so no host sync happens; a slot is reused only after the copy out of it finished.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise BufferError(f"inputs[{name!r}] is a {type(t).__name__}, not a tensor")
        devices = {t.device for t in tensors.values()}
        if len(devices) > 1:
            listing = ", ".join(f"{n}: {t.device}" for n, t in tensors.items())
            raise BufferError(f"static inputs must live on one (primary) device; got {listing}. "
                              "Fix: allocate them all on the device of the first segment.")
        self.tensors = dict(tensors)
        self.device = devices.pop() if devices else None
        self._staging: dict[str, list[tuple[torch.Tensor, object]]] = {}
        self._slot: dict[str, int] = {}
        self._used: dict[str, list[bool]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def allocate_staging(self) -> None:
        """Pinned host buffers + events (CUDA primary only; call once, at allocate time)."""
        if self.device is None or self.device.type != "cuda" or self._staging:
            return
        for name, t in self.tensors.items():
            self._staging[name] = [(torch.empty(t.shape, dtype=t.dtype, pin_memory=True),
                                    torch.cuda.Event()) for _ in range(STAGING_SLOTS)]
            self._slot[name], self._used[name] = 0, [False] * STAGING_SLOTS

    def release_staging(self) -> None:
        self._staging.clear()

    def write(self, name: str, value) -> None:
        """Copy a host value (int, float, list, numpy array, CPU/CUDA tensor) into input `name`.

        Ordered on the current stream of the input's device; capture-safe it is not (host work).
        """
        dst = self.tensors[name]
        src = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if src.numel() != dst.numel():
            raise BufferError(
                f"input {name!r} takes {dst.numel()} value(s) shaped {tuple(dst.shape)}; got "
                f"{src.numel()} shaped {tuple(src.shape)}. Fix: pass exactly that many values.")
        src = src.reshape(dst.shape)
        if dst.device.type != "cuda":
            dst.copy_(src)
        elif src.device.type == "cuda":
            dst.copy_(src, non_blocking=True)
            src.record_stream(torch.cuda.current_stream(dst.device))  # caller may free it now
        else:
            self._write_staged(name, dst, src)

    def _write_staged(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        i = self._slot[name]
        self._slot[name] = (i + 1) % STAGING_SLOTS
        host, done = self._staging[name][i]
        if self._used[name][i] and not done.query():
            done.synchronize()  # only when the host runs STAGING_SLOTS steps ahead of the GPU
        host.copy_(src)
        dst.copy_(host, non_blocking=True)
        done.record(torch.cuda.current_stream(dst.device))
        self._used[name][i] = True

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of the current values (to undo warm-up runs that advanced token/position)."""
        return {n: t.clone() for n, t in self.tensors.items()}

    def restore(self, snap: Mapping[str, torch.Tensor]) -> None:
        for n, t in self.tensors.items():
            t.copy_(snap[n])
