"""Released-format DSV4 checkpoints: the tensor table a config implies, strict validation, lazy loads.

`open_checkpoint(dir)` checks the files, every safetensors header and every tensor name/shape/dtype
before any tensor data is read; `Checkpoint.get` / `.load_into` then read one tensor at a time.
"""
from __future__ import annotations

import json
import math
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..errors import (
    CheckpointError,
    CorruptFileError,
    MissingFileError,
    TensorMismatchError,
)
from . import dspark
from .config import FP4_BLOCK, FP8_BLOCK, ModelConfig
from .parts import Part
from .values import check_values

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_LISTED = 10                    # offenders named in one error message
PROGRESS_MIN_BYTES = 256 * 2**20   # load_many shows its bar above this many bytes
MAX_HEADER_BYTES = 100 * 2**20     # the safetensors library's own header limit

# safetensors dtype name -> torch dtype (the release uses the first six)
TORCH_DTYPES = MappingProxyType({
    "BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "I64": torch.int64,
    "F16": torch.float16, "F64": torch.float64, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
    "I16": torch.int16, "I32": torch.int32, "BOOL": torch.bool,
})
# stored dtype -> destination dtypes load_into may convert to: exact for every stored value
# (the reference holds norms, compressor weights, head in float32 and tid2eid as int32)
EXACT_CASTS = MappingProxyType({
    "BF16": (torch.bfloat16, torch.float32, torch.float64),
    "F16": (torch.float16, torch.float32, torch.float64),
    "F32": (torch.float32, torch.float64),
    "I8": (torch.int8, torch.int16, torch.int32, torch.int64),
    "I64": (torch.int64, torch.int32),   # int32 only when the values fit (checked)
})
ITEMSIZE = MappingProxyType({k: torch.empty((), dtype=v).element_size()
                             for k, v in TORCH_DTYPES.items()})

TensorSpec = tuple[tuple[int, ...], str]   # (shape, safetensors dtype name)


# ---- the tensor table (DSV4_SPEC §2.1) -------------------------------------------------------

def expected_tensor_table(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of the released checkpoint for `cfg`: name -> (shape, dtype name).

    Order: embed, main layers, head/norm/hc_head, MTP blocks (the release's shard order).
    """
    D, V = cfg.dim, cfg.vocab_size
    t: dict[str, TensorSpec] = {"embed.weight": ((V, D), "BF16")}
    for layer in range(cfg.n_layers):
        _block(t, cfg, f"layers.{layer}.", layer)
    t["head.weight"] = ((V, D), "BF16")
    t["norm.weight"] = ((D,), "BF16")
    _hc_head(t, cfg, "")
    for i in range(cfg.n_mtp_layers):
        p = f"mtp.{i}."
        _block(t, cfg, p, cfg.n_layers + i)
        _linear(t, cfg, p + "e_proj", D, D)
        _linear(t, cfg, p + "h_proj", D, D)
        for n in ("enorm", "hnorm", "norm"):
            t[p + n + ".weight"] = ((D,), "BF16")
        _hc_head(t, cfg, p)
    return t


def _linear(t: dict, cfg: ModelConfig, name: str, out_f: int, in_f: int) -> None:
    """An FP8 linear (e4m3 weight + 128x128 ue8m0 scale) or, without quantization, plain BF16."""
    if cfg.quantized:
        t[name + ".weight"] = ((out_f, in_f), "F8_E4M3")
        t[name + ".scale"] = ((math.ceil(out_f / FP8_BLOCK), math.ceil(in_f / FP8_BLOCK)), "F8_E8M0")
    else:
        t[name + ".weight"] = ((out_f, in_f), "BF16")


def _expert(t: dict, cfg: ModelConfig, name: str, out_f: int, in_f: int) -> None:
    if cfg.expert_format == "fp4":   # two e2m1 codes per byte along K, one scale per 32 of K
        t[name + ".weight"] = ((out_f, in_f // 2), "I8")
        t[name + ".scale"] = ((out_f, in_f // FP4_BLOCK), "F8_E8M0")
    else:
        _linear(t, cfg, name, out_f, in_f)


def _hc_head(t: dict, cfg: ModelConfig, p: str) -> None:
    hc = cfg.hc_mult
    t[p + "hc_head_fn"] = ((hc, hc * cfg.dim), "F32")
    t[p + "hc_head_base"] = ((hc,), "F32")
    t[p + "hc_head_scale"] = ((1,), "F32")


def _block(t: dict, cfg: ModelConfig, p: str, layer_id: int) -> None:
    """One transformer block (main layer or MTP block) under prefix `p`."""
    D, H, Dh, Rq, G = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups
    E, I, hc, mix = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.hc_mult, cfg.mix_hc
    r = cfg.ratio(layer_id)
    t[p + "attn_norm.weight"] = ((D,), "BF16")
    t[p + "ffn_norm.weight"] = ((D,), "BF16")
    for part in ("attn", "ffn"):
        t[p + f"hc_{part}_fn"] = ((mix, hc * D), "F32")
        t[p + f"hc_{part}_base"] = ((mix,), "F32")
        t[p + f"hc_{part}_scale"] = ((3,), "F32")
    a = p + "attn."
    t[a + "attn_sink"] = ((H,), "F32")
    _linear(t, cfg, a + "wq_a", Rq, D)
    t[a + "q_norm.weight"] = ((Rq,), "BF16")
    _linear(t, cfg, a + "wq_b", H * Dh, Rq)
    _linear(t, cfg, a + "wkv", Dh, D)
    t[a + "kv_norm.weight"] = ((Dh,), "BF16")
    _linear(t, cfg, a + "wo_a", G * cfg.o_lora_rank, H * Dh // G)
    _linear(t, cfg, a + "wo_b", D, G * cfg.o_lora_rank)
    if r > 0:
        c = 2 if r == 4 else 1   # ratio 4 compresses overlapping windows: two KV halves
        _compressor(t, a + "compressor.", D, c * Dh, r, Dh)
    if r == 4:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        _linear(t, cfg, a + "indexer.wq_b", ih * idim, Rq)
        t[a + "indexer.weights_proj.weight"] = ((ih, D), "BF16")
        _compressor(t, a + "indexer.compressor.", D, 2 * idim, r, idim)
    f = p + "ffn."
    t[f + "gate.weight"] = ((E, D), "BF16")
    if cfg.is_hash_layer(layer_id):
        t[f + "gate.tid2eid"] = ((cfg.vocab_size, cfg.n_activated_experts), "I64")
    else:
        t[f + "gate.bias"] = ((E,), "F32")
    for e in range(E):
        _expert(t, cfg, f + f"experts.{e}.w1", I, D)
        _expert(t, cfg, f + f"experts.{e}.w2", D, I)
        _expert(t, cfg, f + f"experts.{e}.w3", I, D)
    _linear(t, cfg, f + "shared_experts.w1", I, D)
    _linear(t, cfg, f + "shared_experts.w2", D, I)
    _linear(t, cfg, f + "shared_experts.w3", I, D)


def _compressor(t: dict, p: str, D: int, width: int, r: int, norm_dim: int) -> None:
    t[p + "wkv.weight"] = ((width, D), "BF16")
    t[p + "wgate.weight"] = ((width, D), "BF16")
    t[p + "ape"] = ((r, width), "F32")
    t[p + "norm.weight"] = ((norm_dim,), "BF16")


# ---- opening and validation ------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: shard file name, shape, dtype name, byte range in the data section."""
    file: str
    shape: tuple[int, ...]
    dtype: str
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


def open_checkpoint(path, cfg: ModelConfig | None = None) -> "Checkpoint":
    """Open and fully validate a released-format checkpoint folder (no tensor data is read).

    Checks, in order: the folder, config.json (skipped when `cfg` is given), the shard set against
    model.safetensors.index.json (or a single model.safetensors), every safetensors header
    (truncation, corruption), the index against the headers, then names/shapes/dtypes against
    `expected_tensor_table(cfg)`. Raises a `CheckpointError` subclass / `ConfigError`, never warns.
    A DSpark checkpoint's draft module (`mtp.*`, dsv4.weights.dspark) is set aside unchecked and unread:
    `Checkpoint.skipped` lists it and `Checkpoint.notice` says so in one line.
    """
    root = Path(path)
    if not root.exists():
        raise MissingFileError(f"checkpoint directory not found: {root}")
    if not root.is_dir():
        raise MissingFileError(f"{root} is not a directory (it is a file); pass the checkpoint "
                               f"folder that holds config.json and the *.safetensors shards")
    if cfg is None:
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise MissingFileError(f"{cfg_path} not found; a checkpoint folder needs the released "
                                   f"config.json next to its shards")
        cfg = ModelConfig.from_json(cfg_path)
    files, weight_map = _shard_files(root)
    infos: dict[str, TensorInfo] = {}
    for fname in files:
        for name, info in _read_header(root / fname, fname).items():
            if name in infos:
                raise CheckpointError(f"{root}: tensor {name} is stored twice, in {infos[name].file} "
                                      f"and {fname}; remove the duplicate shard")
            infos[name] = info
    if weight_map is not None:
        _check_index(root, weight_map, infos)
    skipped = {}
    if cfg.dspark is not None:   # the draft module is not read: set it aside unchecked
        skipped = {n: i for n, i in infos.items() if n.startswith(dspark.MTP_PREFIX)}
        infos = {n: i for n, i in infos.items() if n not in skipped}
    table = _check_table(root, cfg, infos)
    return Checkpoint(root, cfg, {n: infos[n] for n in table}, skipped)


def _shard_files(root: Path) -> tuple[list[str], dict[str, str] | None]:
    """The shard file names to read, and the index's weight map (None for a single file)."""
    present = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
    index = root / INDEX_NAME
    if index.is_file():
        try:
            d = json.loads(index.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptFileError(f"{index}: not valid JSON ({e}); download the index again") from None
        wm = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CorruptFileError(f"{index}: expected {{\"weight_map\": {{tensor name: shard file}}}}; "
                                   f"download the index again")
        named = sorted(set(wm.values()))
        missing = [f for f in named if not (root / f).is_file()]
        if missing:
            raise MissingFileError(f"{root}: {len(missing)} shard(s) named in {INDEX_NAME} are missing: "
                                   f"{_names(missing)}; download them again")
        stray = [f for f in present if f not in named]
        if stray:
            raise CheckpointError(f"{root}: {len(stray)} safetensors file(s) not named in {INDEX_NAME}: "
                                  f"{_names(stray)}; remove them (a leftover of another download?) "
                                  f"or regenerate the index")
        return named, wm
    if (root / SINGLE_NAME).is_file():
        stray = [f for f in present if f != SINGLE_NAME]
        if stray:
            raise CheckpointError(f"{root}: {SINGLE_NAME} sits next to other safetensors files "
                                  f"({_names(stray)}) and there is no {INDEX_NAME}; remove them")
        return [SINGLE_NAME], None
    if present:
        raise MissingFileError(f"{index} not found, but {root} holds {len(present)} shard(s) "
                               f"({_names(present)}); download the index with the shards")
    raise MissingFileError(f"{root}: no weights: expected {INDEX_NAME} plus the shards it names, "
                           f"or a single {SINGLE_NAME}")


def _read_header(file: Path, fname: str) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check that every tensor's bytes lie inside the file."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise CorruptFileError(f"{file}: corrupt or truncated safetensors file (header length "
                                   f"{n} does not fit the file size {size}); download it again")
        raw = f.read(n)
    try:
        hdr = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{file}: corrupt safetensors header (not valid JSON: {e}); "
                               f"download it again") from None
    if not isinstance(hdr, dict):
        raise CorruptFileError(f"{file}: corrupt safetensors header (not a JSON object); download it again")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    beyond = []
    for name, e in hdr.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(s) for s in e["shape"])
            begin, end = (int(o) for o in e["data_offsets"])
            dtype = str(e["dtype"])
            ok = all(s >= 0 for s in shape) and 0 <= begin <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CorruptFileError(f"{file}: corrupt safetensors header (entry {name!r} = {e!r}); "
                                   f"download it again")
        if dtype in ITEMSIZE and math.prod(shape) * ITEMSIZE[dtype] != end - begin:
            raise CorruptFileError(f"{file}: corrupt safetensors header ({name} is {list(shape)} "
                                   f"{dtype} but spans {end - begin} bytes); download it again")
        if end > data_size:
            beyond.append((name, end))
        out[name] = TensorInfo(fname, shape, dtype, begin, end)
    if beyond:
        name, end = max(beyond, key=lambda x: x[1])
        raise CorruptFileError(f"{file} is truncated: {len(beyond)} tensor(s) end past its "
                               f"{data_size} data bytes (e.g. {name} ends at byte {end}); download "
                               f"it again")
    # the safetensors reader needs the byte ranges to tile the data section exactly
    pos = 0
    for name, info in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != pos:
            raise CorruptFileError(f"{file}: corrupt safetensors header ({name} starts at byte "
                                   f"{info.begin}, expected {pos}: overlapping or gapped tensors); "
                                   f"download it again")
        pos = info.end
    if pos != data_size:
        raise CorruptFileError(f"{file}: {data_size - pos} unexpected byte(s) after the last tensor "
                               f"(a corrupted or appended file); download it again")
    return out


def _check_index(root: Path, weight_map: dict[str, str], infos: dict[str, TensorInfo]) -> None:
    problems = []
    for name, fname in weight_map.items():
        info = infos.get(name)
        if info is None:
            problems.append(f"{name} is listed in {fname} but no shard holds it")
        elif info.file != fname:
            problems.append(f"{name} is listed in {fname} but stored in {info.file}")
    problems += [f"{name} (in {info.file}) is not in the index"
                 for name, info in infos.items() if name not in weight_map]
    if problems:
        raise CheckpointError(f"{root / INDEX_NAME} does not match the shard headers "
                              f"({len(problems)} problem(s)): {'; '.join(problems[:MAX_LISTED])}; "
                              f"re-download the checkpoint (or regenerate the index from the shards)")


def _fmt(spec: TensorSpec) -> str:
    return f"{list(spec[0])} {spec[1]}"


def _check_table(root: Path, cfg: ModelConfig, infos: dict[str, TensorInfo]) -> dict[str, TensorSpec]:
    """Strict comparison with the config's tensor table; one TensorMismatchError for all offenders."""
    table = expected_tensor_table(cfg)
    found = {n: (i.shape, i.dtype) for n, i in infos.items()}
    wrong = [n for n in table if n in found and found[n] != table[n]]
    missing = [n for n in table if n not in found]
    unexpected = [n for n in found if n not in table]
    total = len(wrong) + len(missing) + len(unexpected)
    if not total:
        return table
    listed = (wrong + missing + unexpected)[:MAX_LISTED]
    lines = [f"{n}: " + (f"unexpected, found {_fmt(found[n])}" if n not in table else
                         f"expected {_fmt(table[n])}, missing" if n not in found else
                         f"expected {_fmt(table[n])}, found {_fmt(found[n])}") for n in listed]
    hints = _mismatch_hints(cfg, table, found, wrong, unexpected)
    fix = " ".join(hints) if hints else "Check that config.json belongs to these shards."
    shown = f"first {len(listed)} of {total}" if total > len(listed) else f"all {total}"
    raise TensorMismatchError(
        f"{root}: {total} tensor(s) do not match config.json (wrong shape/dtype {len(wrong)}, "
        f"missing {len(missing)}, unexpected {len(unexpected)}). {fix} The offenders ({shown}): "
        f"{'; '.join(lines)}")


def _mismatch_hints(cfg, table, found, wrong, unexpected) -> list[str]:
    """Fixes for the common config/shard disagreements (formats, layer counts)."""
    hints = []
    experts = [n for n in wrong if ".experts." in n and n.endswith(".weight")]
    # a format hint only where the stored dtype differs from the expected one (a shape
    # mismatch of FP4 experts under "expert_dtype": "fp4" is not a format problem)
    if any(found[n][1] == "I8" and table[n][1] != "I8" for n in experts):
        hints.append('The shards hold FP4 experts (I8 + per-32 scales): add "expert_dtype": "fp4" '
                     'to config.json.')
    elif any(table[n][1] == "I8" and found[n][1] != "I8" for n in experts):
        hints.append(f"The shards hold {found[experts[0]][1]} experts, not FP4: remove "
                     f'"expert_dtype" from config.json.')
    emb = "embed.weight"
    if emb in wrong and len(found[emb][0]) == 2:
        (v, d), (cv, cd) = found[emb][0], table[emb][0]
        if d != cd:
            hints.append(f"The shards have hidden_size = {d} ({emb} is {list(found[emb][0])}) but "
                         f"config.json says hidden_size = {cd}: fix hidden_size.")
        if v != cv:
            hints.append(f"The shards have vocab_size = {v} ({emb} is {list(found[emb][0])}) but "
                         f"config.json says vocab_size = {cv}: fix vocab_size.")
    dense = [n for n in wrong if ".experts." not in n and n.endswith(".weight")]
    if any(table[n][1] == "BF16" and found[n][1] == "F8_E4M3" for n in dense):
        hints.append("The shards hold FP8 linears: config.json needs the release's "
                     '"quantization_config" (quant_method fp8, 128x128 ue8m0 scales).')
    elif any(table[n][1] == "F8_E4M3" and found[n][1] == "BF16" for n in dense):
        hints.append('The shards hold BF16 linears: remove "quantization_config" (and '
                     '"expert_dtype") from config.json.')
    layers = {int(m.group(1)) for n in found if (m := re.match(r"layers\.(\d+)\.", n))}
    if layers and max(layers) + 1 != cfg.n_layers:
        hints.append(f"The shards hold layers 0..{max(layers)} but num_hidden_layers = "
                     f"{cfg.n_layers}: fix num_hidden_layers.")
    mtp = {int(m.group(1)) for n in found if (m := re.match(r"mtp\.(\d+)\.", n))}
    if len(mtp) != cfg.n_mtp_layers and cfg.dspark is None:
        hints.append(f"The shards hold {len(mtp)} MTP block(s) but num_nextn_predict_layers = "
                     f"{cfg.n_mtp_layers}: fix num_nextn_predict_layers.")
    return hints


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f", ... ({len(items)} in all)" if len(items) > MAX_LISTED else "")


# ---- loading ---------------------------------------------------------------------------------

def load_with_progress(source, items, desc: str, progress: bool | None,
                       parts: dict | None = None) -> None:
    """`source.load_into(name, dst)` for each (name, dst), with a progress bar over the stored
    bytes (`source.nbytes([name])`) on stderr; progress None shows it only above
    PROGRESS_MIN_BYTES. parts: name -> Part (dsv4.weights.parts) for the destinations that hold a
    slice of their tensor (a tensor-parallel rank's shard), passed as `part=`. Shared by
    Checkpoint and DeviceWeights."""
    items = list(items)
    parts = parts or {}
    sizes = [source.nbytes([n]) for n, _ in items]
    show = progress if progress is not None else sum(sizes) > PROGRESS_MIN_BYTES
    with tqdm(total=sum(sizes), desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, disable=not show) as bar:
        for (name, dst), n in zip(items, sizes):
            if name in parts:
                source.load_into(name, dst, part=parts[name])
            else:
                source.load_into(name, dst)
            bar.update(n)


class Checkpoint:
    """A validated checkpoint; tensors are read lazily from memory-mapped shards, one at a time.

    Use as a context manager (or call `close()`) to release the shard handles.
    """

    def __init__(self, path: Path, config: ModelConfig, infos: dict[str, TensorInfo],
                 skipped: dict[str, TensorInfo] | None = None):
        self.path = Path(path)
        self.config = config
        self._infos = infos          # name -> TensorInfo, in tensor-table order
        self.skipped = dict(skipped or {})   # stored but not part of the model (DSpark drafts)
        self._handles: dict = {}     # shard file name -> open safe_open handle

    @property
    def notice(self) -> str | None:
        """One line naming what this checkpoint holds and the runtime leaves out, or None."""
        if self.config.dspark is None:
            return None
        return dspark.skipped_notice(self.config, self.skipped)

    # ---- names and sizes ---------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """All names, in tensor-table order (embed, layers, head/norm, MTP)."""
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of {self.path}") from None

    def nbytes(self, names=None) -> int:
        """Stored bytes of `names` (all tensors when None)."""
        return sum(self.info(n).nbytes for n in (self._infos if names is None else names))

    def prefix_names(self, prefix: str) -> list[str]:
        return [n for n in self._infos if n.startswith(prefix)]

    def layer_names(self, layer) -> list[str]:
        """Names of main layer `layer` (an int, or "layers.3") or an MTP block ("mtp.0")."""
        p = f"layers.{layer}" if isinstance(layer, int) else str(layer)
        return self.prefix_names(p.rstrip(".") + ".")

    def global_names(self) -> list[str]:
        """embed, head, norm and hc_head_* (everything outside layers.* and mtp.*)."""
        return [n for n in self._infos if not n.startswith(("layers.", "mtp."))]

    # ---- reading -----------------------------------------------------------------------------
    def _handle(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            h = self._handles[fname] = safe_open(str(self.path / fname), framework="pt")
        return h

    def get(self, name: str, device="cpu") -> torch.Tensor:
        """One tensor in its stored dtype (e.g. float8_e4m3fn, int8 for FP4) on `device`."""
        info = self.info(name)
        t = self._handle(info.file).get_tensor(name)
        return t if torch.device(device).type == "cpu" else t.to(device)

    def load_into(self, name: str, dst: torch.Tensor, part: Part | None = None) -> torch.Tensor:
        """Copy tensor `name` (or its `part`: only those bytes are read) into `dst` (any device;
        may be a view, e.g. one slot of a stack).

        `dst` must have the stored shape (the part's), and the stored dtype or an exact widening
        of it (EXACT_CASTS: e.g. BF16 -> float32, I64 -> int32 when the values fit). A part past
        the tensor's end is zeros there. The values read are checked first where that is cheap
        (dsv4.weights.values: scales, routing table, small float tensors): a corrupt shard is a
        CorruptFileError naming the tensor and the file.
        """
        info = self.info(name)
        allowed = EXACT_CASTS.get(info.dtype, (info.torch_dtype,))
        try:
            want = info.shape if part is None else part.shape(info.shape)
        except ValueError as e:
            raise TensorMismatchError(f"load_into({name}): {e}; the model was built for another "
                                      f"config or tensor-parallel degree") from None
        if tuple(dst.shape) != want or dst.dtype not in allowed:
            held = "holds" if part is None else f"holds {list(info.shape)}, whose part {part} is"
            raise TensorMismatchError(
                f"load_into({name}): destination is {list(dst.shape)} {dst.dtype}, but {info.file} "
                f"{held} {list(want)} {info.dtype}; allocate the destination with shape "
                f"{list(want)} and dtype {' or '.join(str(d) for d in allowed)}")
        if part is None:
            src = self._handle(info.file).get_tensor(name)
        else:          # only the part's bytes are read (safetensors reads a slice of the map)
            src = self._handle(info.file).get_slice(name)[part.index(info.shape[part.dim])]
        check_values(name, info.dtype, src, str(self.path / info.file),
                     self.config.n_routed_experts)
        if dst.dtype != src.dtype and not dst.is_floating_point() and src.numel():
            lo, hi = torch.iinfo(dst.dtype).min, torch.iinfo(dst.dtype).max
            if src.min().item() < lo or src.max().item() > hi:
                raise TensorMismatchError(f"load_into({name}): values span [{src.min().item()}, "
                                          f"{src.max().item()}], outside {dst.dtype}; use an "
                                          f"{src.dtype} destination")
        into = dst
        if part is not None and src.shape != dst.shape:    # past the end: zeros
            n = src.shape[part.dim]
            dst.narrow(part.dim, n, dst.shape[part.dim] - n).zero_()
            into = dst.narrow(part.dim, 0, n)
        into.copy_(src)
        return dst

    def load_many(self, items, desc: str = "load", progress: bool | None = None,
                  parts: dict | None = None) -> None:
        """load_into for each (name, dst) with a byte progress bar on stderr; parts: name ->
        Part for the destinations that hold a slice."""
        load_with_progress(self, items, desc, progress, parts)

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Release the shard handles (idempotent; later reads reopen them)."""
        handles, self._handles = self._handles, {}
        for h in handles.values():
            h.__exit__(None, None, None)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self._infos)} tensors, {self.nbytes() / 2**30:.2f} GiB)"
