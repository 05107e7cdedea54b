"""A weight source that generates every tensor directly on its destination device, in the stored
format, with the synthetic checkpoints' distribution: full-size benchmarks without a checkpoint.

Values depend only on (seed, name) and the device's generator: on the CPU they equal what
`synthetic.write_checkpoint(cfg, seed=seed)` writes, tensor for tensor.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..errors import TensorMismatchError
from .checkpoint import (
    EXACT_CASTS,
    ITEMSIZE,
    TORCH_DTYPES,
    expected_tensor_table,
    load_with_progress,
)
from .config import ModelConfig
from .formats import FP8_BLOCK, quantize_fp4_weight, quantize_fp8_weight
from .parts import Part
from .synthetic import init_tensor, tensor_seed

SCALE_CACHE_BYTES = 64 * 2**20   # scales kept from their weight's quantization until requested
QUANT_CHUNK_ELEMS = 16 * 2**20   # master elements quantized per chunk (bounds the temporaries)


class DeviceWeights:
    """Weight source for `Transformer.load`: `load_into(name, dst)` generates `name` on dst.device.

    FP8 linears and FP4 experts are quantized from their float32 master (synthetic.init_tensor);
    the scale of a weight is kept (bounded cache) until requested, or regenerated when it comes
    first or was evicted, so any request order works. Temporaries: one float32 master (the
    largest is embed/head, V x D x 4 bytes) plus bounded quantization chunks; nothing goes
    through the host except the small tid2eid tables (init_tensor builds them in chunks).
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.cfg, self.seed = cfg, seed
        self.table = expected_tensor_table(cfg)          # name -> (stored shape, dtype name)
        self._scales: OrderedDict[str, torch.Tensor] = OrderedDict()  # weight name -> scale
        self._scale_bytes = 0
        self._gens: dict[torch.device, torch.Generator] = {}

    # ---- sizes -------------------------------------------------------------------------------
    def nbytes(self, names=None) -> int:
        """Stored bytes of `names` (all tensors of the config when None)."""
        names = self.table if names is None else names
        return sum(_stored_bytes(self._spec(n)) for n in names)

    def _spec(self, name: str):
        try:
            return self.table[name]
        except KeyError:
            raise TensorMismatchError(f"{name!r} is not a tensor of this config (n_layers = "
                                      f"{self.cfg.n_layers}); check the model was built from the "
                                      f"same config as DeviceWeights") from None

    # ---- generation --------------------------------------------------------------------------
    def _gen(self, name: str, device: torch.device) -> torch.Generator:
        """The device's generator, reseeded for `name` (same state as a fresh seeded one)."""
        gen = self._gens.get(device)
        if gen is None:
            gen = self._gens[device] = torch.Generator(device=device)
        return gen.manual_seed(tensor_seed(self.seed, name))

    def _quantized(self, wname: str, device: torch.device, q_out: torch.Tensor | None = None):
        """(weight, scale) of FP8/FP4 weight `wname` on `device`; the weight written into q_out
        when given. Quantized in row chunks: blocks never straddle rows of different chunks, so
        the result equals quantizing the whole master at once."""
        shape, dtype = self.table[wname]
        sname = wname[:-len(".weight")] + ".scale"
        sshape, _ = self.table[sname]
        fp4 = dtype == "I8"
        dense = (shape[0], shape[1] * 2) if fp4 else tuple(shape)        # [out, in] master
        master = init_tensor(wname, dense, self.cfg, self._gen(wname, device), device)
        q = q_out if q_out is not None else torch.empty(shape, dtype=TORCH_DTYPES[dtype],
                                                        device=device)
        s = torch.empty(sshape, dtype=torch.float8_e8m0fnu, device=device)
        step = 1 if fp4 else FP8_BLOCK                                    # rows per scale row
        rows = max(step, QUANT_CHUNK_ELEMS // max(dense[1], 1) // step * step)
        quant = quantize_fp4_weight if fp4 else quantize_fp8_weight
        for r0 in range(0, dense[0], rows):
            r1 = min(r0 + rows, dense[0])
            qc, sc = quant(master[r0:r1])
            q[r0:r1].view(torch.uint8).copy_(qc.view(torch.uint8))    # raw bytes: fp8 dtypes
            s[r0 // step:-(-r1 // step)].view(torch.uint8).copy_(sc.view(torch.uint8))
            del qc, sc
        del master
        return q, s

    def _remember_scale(self, wname: str, s: torch.Tensor) -> None:
        self._scales[wname] = s
        self._scale_bytes += s.numel()
        while self._scale_bytes > SCALE_CACHE_BYTES and self._scales:
            _, old = self._scales.popitem(last=False)
            self._scale_bytes -= old.numel()

    def _check_dst(self, name: str, dst: torch.Tensor, part: Part | None = None) -> None:
        shape, dtype = self._spec(name)
        allowed = EXACT_CASTS.get(dtype, (TORCH_DTYPES[dtype],))
        try:
            want = tuple(shape) if part is None else part.shape(tuple(shape))
        except ValueError as e:
            raise TensorMismatchError(f"load_into({name}): {e}; the model was built for another "
                                      f"config or tensor-parallel degree") from None
        if tuple(dst.shape) != want or dst.dtype not in allowed:
            of = "" if part is None else f" (part {part} of {list(shape)})"
            raise TensorMismatchError(
                f"load_into({name}): destination is {list(dst.shape)} {dst.dtype}, but the "
                f"config stores {list(want)} {dtype}{of}; allocate the destination with shape "
                f"{list(want)} and dtype {' or '.join(str(d) for d in allowed)}")

    def load_into(self, name: str, dst: torch.Tensor, part: Part | None = None) -> torch.Tensor:
        """Generate tensor `name` into `dst` (stored shape; stored dtype or an exact widening,
        e.g. a BF16-stored norm into float32: rounded through bf16 first). Asynchronous on CUDA.
        part: dst holds only that slice (a tensor-parallel shard): the whole tensor is generated
        on dst's device (a temporary) and the part kept, so the shard equals what a sliced load
        of the written checkpoint gives."""
        self._check_dst(name, dst, part)
        if part is not None:
            shape, dtype = self.table[name]
            full = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=dst.device)
            dst.copy_(part.take(self.load_into(name, full)))
            return dst
        shape, dtype = self.table[name]
        dev = dst.device
        if name.endswith(".scale"):
            wname = name[:-len(".scale")] + ".weight"
            s = self._scales.pop(wname, None)
            if s is not None:
                self._scale_bytes -= s.numel()
            else:                           # scale first (or evicted): regenerate the pair
                _, s = self._quantized(wname, dev)
            dst.view(torch.uint8).copy_(s.view(torch.uint8))
            return dst
        if dtype in ("F8_E4M3", "I8"):
            direct = dst.is_contiguous() and dst.dtype == TORCH_DTYPES[dtype]
            q, s = self._quantized(name, dev, q_out=dst if direct else None)
            if not direct:
                dst.copy_(q)
            self._remember_scale(name, s)
            return dst
        t = init_tensor(name, shape, self.cfg, self._gen(name, dev), dev)
        if dtype == "BF16":
            t = t.to(torch.bfloat16)        # the values a checkpoint holds, even in an f32 dst
        dst.copy_(t)
        return dst

    def get(self, name: str, device="cpu") -> torch.Tensor:
        """Tensor `name` in its stored dtype on `device` (a fresh tensor)."""
        shape, dtype = self._spec(name)
        return self.load_into(name, torch.empty(shape, dtype=TORCH_DTYPES[dtype],
                                                device=torch.device(device)))

    def load_many(self, items, desc: str = "generate", progress: bool | None = None,
                  parts: dict | None = None) -> None:
        """load_into for each (name, dst), with a progress bar over stored bytes on stderr;
        parts: name -> Part for the destinations that hold a slice."""
        load_with_progress(self, items, desc, progress, parts)


def _stored_bytes(spec) -> int:
    shape, dtype = spec
    n = 1
    for s in shape:
        n *= s
    return n * ITEMSIZE[dtype]
