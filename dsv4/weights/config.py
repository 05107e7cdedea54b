"""ModelConfig: the DSV4 hyper-parameters, read from either released config.json style, validated.

Two input styles give the same frozen `ModelConfig` (field names follow the official
`ModelArgs`): the released root `config.json` (HF-style keys: `hidden_size`,
`num_hidden_layers`, `rope_scaling`, `quantization_config`, ...) and the inference-style
`inference/config.json` (`dim`, `n_layers`, ...). Mapping: DSV4_SPEC §1.3.
Runtime knobs (devices, max_seq_len, activation dtype) are not here.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, MissingFileError
from . import dspark as _dspark
from .dspark import DSparkConfig

FP8_BLOCK = 128   # weight block (both dims) and activation-quant block of FP8 linears
FP4_BLOCK = 32    # FP4 expert scale group along K
KV_QUANT_BLOCK = 64  # FP8 fake-quant block of the KV "nope" dims
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
_FLOAT_FIELDS = ("route_scale", "swiglu_limit", "norm_eps", "compress_rope_theta", "rope_theta",
                 "rope_factor", "hc_eps")


@dataclass(frozen=True)
class ModelConfig:
    """DSV4 model hyper-parameters (inference naming). Validated on construction."""
    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_heads: int
    n_routed_experts: int
    n_activated_experts: int
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_hash_layers: int = 0
    n_mtp_layers: int = 1
    n_shared_experts: int = 1
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    norm_eps: float = 1e-6
    compress_rope_theta: float = 40000.0
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # weight formats: dtype "fp8" = FP8 e4m3 linears with 128x128 ue8m0 scales, "bf16" = plain
    dtype: str = "bf16"
    scale_fmt: str | None = None
    # routed experts: "fp4" = packed e2m1 + per-32 ue8m0; None = same as `dtype`
    expert_dtype: str | None = None
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position_embeddings: int = 1048576
    # a DSpark draft module in place of the MTP block (dsv4.weights.dspark; not loaded: n_mtp_layers = 0)
    dspark: DSparkConfig | None = None

    def __post_init__(self):
        if isinstance(self.dspark, Mapping):        # replace() / asdict() round trips
            object.__setattr__(self, "dspark", DSparkConfig(**self.dspark))
        if not isinstance(self.compress_ratios, (list, tuple)):
            raise _err("compress_ratios", self.compress_ratios, "expected a list of integers")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in self.compress_ratios):
            raise _err("compress_ratios", list(self.compress_ratios), "expected a list of integers")
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        for k in _FLOAT_FIELDS:  # 160000 and 160000.0 are the same config
            v = getattr(self, k)
            if isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, k, float(v))
        _validate(self)

    # ---- derived -------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def quantized(self) -> bool:
        return self.dtype == "fp8"

    @property
    def expert_format(self) -> str:
        """'fp4', 'fp8' or 'bf16': how routed experts are stored."""
        if self.expert_dtype == "fp4":
            return "fp4"
        return "fp8" if self.quantized else "bf16"

    def ratio(self, layer: int) -> int:
        """Compress ratio of main layer `layer` (or the MTP block at index n_layers + i)."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        return d

    def replace(self, **changes) -> "ModelConfig":
        d = asdict(self)
        d.update(changes)
        return ModelConfig(**d)

    # ---- I/O -----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a released root config (HF keys) or an inference-style config. Errors
        start with `source` and name the keys of that style (`num_attention_heads = 5`)."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if "hidden_size" in d:
            kw, names = _from_hf(d, source), _FIELD_TO_KEY
        elif "dim" in d:
            kw, names = _from_inference(d, source), {}
        else:
            raise ConfigError(f"{source}: neither 'hidden_size' (released config.json) nor 'dim' "
                              f"(inference config) is present; not a DeepSeek-V4 config")
        try:
            return cls(**kw)
        except ConfigError as e:        # validation speaks of fields: say the file's keys
            raise ConfigError(f"{source}: {_in_keys(str(e), names)}; fix that value in "
                              f"{Path(source).name}") from None
        except TypeError as e:  # pragma: no cover - guarded by the key mapping
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise MissingFileError(f"config not found: {path}")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(path))

    def to_hf_dict(self) -> dict:
        """The released root-config form (HF-style keys) of this config."""
        d = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hc_eps": self.hc_eps,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.dim,
            "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads,
            "index_topk": self.index_topk,
            "max_position_embeddings": self.max_position_embeddings,
            "moe_intermediate_size": self.moe_inter_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "norm_topk_prob": True,
            "num_attention_heads": self.n_heads,
            "num_experts_per_tok": self.n_activated_experts,
            "num_hidden_layers": self.n_layers,
            "num_hash_layers": self.n_hash_layers,
            "num_key_value_heads": 1,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.rope_head_dim,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "routed_scaling_factor": self.route_scale,
            "scoring_func": self.score_func,
            "sliding_window": self.window_size,
            "swiglu_limit": self.swiglu_limit,
            "tie_word_embeddings": False,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "vocab_size": self.vocab_size,
            "compress_rope_theta": self.compress_rope_theta,
            "compress_ratios": list(self.compress_ratios),
        }
        if self.original_seq_len > 0:
            d["rope_scaling"] = {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                                 "factor": self.rope_factor,
                                 "original_max_position_embeddings": self.original_seq_len,
                                 "type": "yarn"}
        if self.quantized:
            d["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                        "quant_method": "fp8", "scale_fmt": "ue8m0",
                                        "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        if self.expert_dtype is not None:
            d["expert_dtype"] = self.expert_dtype
        if self.dspark is not None:
            d.update(_dspark.to_hf(self.dspark))
            d["compress_ratios"] += list(self.dspark.compress_ratios)
        return dict(sorted(d.items()))


# ---- key mapping -------------------------------------------------------------------------

# HF key -> ModelConfig field (same-named keys are listed with themselves)
_HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers", "num_hash_layers": "n_hash_layers",
    "num_nextn_predict_layers": "n_mtp_layers", "num_attention_heads": "n_heads",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "swiglu_limit": "swiglu_limit",
    "q_lora_rank": "q_lora_rank", "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size", "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta", "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim",
    "index_topk": "index_topk", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps", "expert_dtype": "expert_dtype", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "max_position_embeddings": "max_position_embeddings",
}
_INFERENCE_KEYS = {f.name for f in fields(ModelConfig)} - {"bos_token_id", "eos_token_id",
                                                           "max_position_embeddings"}
# inference-style keys of ModelArgs that are runtime knobs, not model hyper-parameters
_INFERENCE_RUNTIME_KEYS = {"max_batch_size", "max_seq_len", "scale_dtype"}
_REQUIRED = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts",
             "n_activated_experts", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups",
             "o_lora_rank", "window_size", "compress_ratios", "index_n_heads", "index_head_dim",
             "index_topk")
_FIELD_TO_HF = {v: k for k, v in _HF_KEYS.items()}
# field -> where a released config.json holds it (for error messages)
_FIELD_TO_KEY = {**_FIELD_TO_HF, "rope_factor": "rope_scaling.factor",
                 "original_seq_len": "rope_scaling.original_max_position_embeddings",
                 "beta_fast": "rope_scaling.beta_fast", "beta_slow": "rope_scaling.beta_slow",
                 "dtype": "quantization_config", "scale_fmt": "quantization_config.scale_fmt"}
_FIELD_RE = re.compile(r"\b(" + "|".join(sorted(_FIELD_TO_KEY, key=len, reverse=True)) + r")\b")


def _in_keys(message: str, names: Mapping[str, str]) -> str:
    """A validation message with each ModelConfig field name replaced by its config key."""
    if not names:
        return message
    return _FIELD_RE.sub(lambda m: names.get(m.group(1), m.group(1)), message)


def _from_hf(d: Mapping[str, Any], source: str) -> dict:
    kw = {field_: d[key] for key, field_ in _HF_KEYS.items() if key in d and d[key] is not None}
    missing = [_FIELD_TO_HF[f] for f in _REQUIRED if f not in kw]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(repr(m) for m in missing)}")
    if d.get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"{source}: num_key_value_heads = {d['num_key_value_heads']!r}; "
                          f"DeepSeek-V4 attention has exactly 1 shared KV head")
    rs = d.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, Mapping):
            raise ConfigError(f"{source}: rope_scaling = {rs!r}; expected an object or null")
        rtype = rs.get("type", rs.get("rope_type", "yarn"))
        if rtype != "yarn":
            raise ConfigError(f"{source}: rope_scaling.type = {rtype!r}; only 'yarn' is supported")
        for key, field_ in (("factor", "rope_factor"), ("original_max_position_embeddings",
                            "original_seq_len"), ("beta_fast", "beta_fast"),
                            ("beta_slow", "beta_slow")):
            if key in rs:
                kw[field_] = rs[key]
        if "original_max_position_embeddings" not in rs:
            raise ConfigError(f"{source}: rope_scaling.original_max_position_embeddings is "
                              f"missing; YaRN needs the original context length")
    qc = d.get("quantization_config")
    if qc is None:
        kw["dtype"] = "bf16"
        kw["scale_fmt"] = None
    else:
        _check_quant_config(qc, source)
        kw["dtype"] = "fp8"
        kw["scale_fmt"] = "ue8m0"
    n_layers = kw.get("n_layers")
    if isinstance(n_layers, int) and not isinstance(n_layers, bool):
        ds = _dspark.from_hf(d, n_layers)
        if ds is not None:       # the backbone only: the draft module is not an MTP block
            kw["dspark"], kw["n_mtp_layers"] = ds, 0
            if isinstance(kw["compress_ratios"], (list, tuple)):
                kw["compress_ratios"] = kw["compress_ratios"][:n_layers]
    if d.get("tie_word_embeddings", False):
        raise ConfigError(f"{source}: tie_word_embeddings = true; DeepSeek-V4 has a separate "
                          f"head.weight (expected false)")
    return kw


def _check_quant_config(qc, source: str) -> None:
    if not isinstance(qc, Mapping):
        raise ConfigError(f"{source}: quantization_config = {qc!r}; expected an object")
    allowed = {"quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": ("ue8m0",),
               "activation_scheme": ("dynamic",)}
    for key, ok in allowed.items():
        if key in qc and qc[key] not in ok:
            raise ConfigError(f"{source}: quantization_config.{key} = {qc[key]!r}; "
                              f"allowed: {', '.join(repr(o) for o in ok)}")
    if "quant_method" not in qc:
        raise ConfigError(f"{source}: quantization_config.quant_method is missing; expected 'fp8'")
    wbs = qc.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if list(wbs) != [FP8_BLOCK, FP8_BLOCK]:
        raise ConfigError(f"{source}: quantization_config.weight_block_size = {wbs!r}; "
                          f"only [{FP8_BLOCK}, {FP8_BLOCK}] is supported")


def _from_inference(d: Mapping[str, Any], source: str) -> dict:
    unknown = sorted(set(d) - _INFERENCE_KEYS - _INFERENCE_RUNTIME_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(repr(u) for u in unknown)} in an "
                          f"inference-style config (allowed: the official ModelArgs fields)")
    missing = [f for f in _REQUIRED if f not in d]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(repr(m) for m in missing)}")
    kw = {k: v for k, v in d.items() if k in _INFERENCE_KEYS}
    kw.setdefault("dtype", "fp8")  # ModelArgs default
    if kw["dtype"] == "fp8":
        sf = kw.get("scale_fmt", "ue8m0")
        if d.get("scale_dtype", "fp8") != "fp8":
            raise ConfigError(f"{source}: scale_dtype = {d['scale_dtype']!r}; only 'fp8' (ue8m0 "
                              f"scales) is supported")
        kw["scale_fmt"] = sf
    else:
        kw["scale_fmt"] = None
    return kw


# ---- validation --------------------------------------------------------------------------

def _err(key: str, value, allowed: str) -> ConfigError:
    return ConfigError(f"{key} = {value!r}; {allowed}")


def _validate(c: ModelConfig) -> None:
    ints_pos = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts",
                "n_activated_experts", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups",
                "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
                "hc_mult", "hc_sinkhorn_iters")
    for k in ints_pos:
        v = getattr(c, k)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise _err(k, v, "must be a positive integer" + (" (a JSON number, not a string)"
                                                              if isinstance(v, str) else ""))
    for k in ("n_hash_layers", "n_mtp_layers", "original_seq_len", "bos_token_id", "eos_token_id"):
        v = getattr(c, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _err(k, v, "must be a non-negative integer" + (" (a JSON number, not a string)"
                                                                  if isinstance(v, str) else ""))
    for k in ("norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "rope_factor"):
        v = getattr(c, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
            raise _err(k, v, "expected a positive finite number")
    for k in ("route_scale", "swiglu_limit"):
        v = getattr(c, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or not math.isfinite(v):
            raise _err(k, v, "expected a non-negative finite number")
    for k in ("beta_fast", "beta_slow"):
        v = getattr(c, k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _err(k, v, "expected a number")
    if c.beta_fast <= c.beta_slow:
        raise _err("beta_fast", c.beta_fast, f"expected > beta_slow = {c.beta_slow}")

    n_ratios = c.n_layers + c.n_mtp_layers
    if len(c.compress_ratios) != n_ratios:
        raise ConfigError(f"compress_ratios has {len(c.compress_ratios)} entries; expected "
                          f"n_layers + n_mtp_layers = {c.n_layers} + {c.n_mtp_layers} = {n_ratios}")
    for i, r in enumerate(c.compress_ratios):
        if r != 0 and r < 2:
            raise ConfigError(f"compress_ratios[{i}] = {r}; allowed: 0 (window only), 4 (overlapped "
                              f"compression + indexer) or another integer >= 2")

    if c.dspark is not None and c.n_mtp_layers:
        raise _err("n_mtp_layers", c.n_mtp_layers, "must be 0 with a DSpark draft module (its "
                   "mtp.* blocks are not MTP blocks)")
    if c.score_func not in SCORE_FUNCS:
        raise _err("score_func", c.score_func, f"allowed: {', '.join(SCORE_FUNCS)}")
    if c.n_activated_experts > c.n_routed_experts:
        raise _err("n_activated_experts", c.n_activated_experts,
                   f"must be <= n_routed_experts = {c.n_routed_experts}")
    if c.n_shared_experts != 1:
        raise _err("n_shared_experts", c.n_shared_experts, "DeepSeek-V4 has exactly 1 shared expert")
    if c.n_hash_layers > c.n_layers:
        raise _err("n_hash_layers", c.n_hash_layers, f"must be <= n_layers = {c.n_layers}")
    if c.n_heads % c.o_groups:
        raise _err("n_heads", c.n_heads, f"must be a multiple of o_groups = {c.o_groups}")
    if c.rope_head_dim % 2:
        raise _err("rope_head_dim", c.rope_head_dim, "must be even (RoPE rotates pairs)")
    if c.rope_head_dim >= c.head_dim:
        raise _err("rope_head_dim", c.rope_head_dim, f"must be < head_dim = {c.head_dim}")
    if c.nope_head_dim % KV_QUANT_BLOCK:
        raise ConfigError(f"head_dim - rope_head_dim = {c.head_dim} - {c.rope_head_dim} = "
                          f"{c.nope_head_dim}; must be a multiple of {KV_QUANT_BLOCK} "
                          f"(FP8 fake-quant blocks of the KV)")
    ih = c.index_head_dim
    if ih & (ih - 1):
        raise _err("index_head_dim", ih, "must be a power of two (Hadamard transform)")
    if ih % FP4_BLOCK or ih <= c.rope_head_dim:
        raise _err("index_head_dim", ih, f"must be a multiple of {FP4_BLOCK} and > rope_head_dim "
                   f"= {c.rope_head_dim}")
    if c.dtype not in ("fp8", "bf16"):
        raise _err("dtype", c.dtype, "allowed: 'fp8' (quantization_config present) or 'bf16'")
    if c.dtype == "fp8" and c.scale_fmt != "ue8m0":
        raise _err("scale_fmt", c.scale_fmt, "only 'ue8m0' scales are supported with FP8 weights")
    if c.expert_dtype not in (None, "fp4"):
        raise _err("expert_dtype", c.expert_dtype, "allowed: 'fp4' or absent")
    if c.expert_dtype == "fp4" and c.dtype != "fp8":
        raise _err("expert_dtype", c.expert_dtype,
                   "FP4 experts need FP8 activation quantization (a quantization_config)")
    if c.bos_token_id >= c.vocab_size or c.eos_token_id >= c.vocab_size:
        raise ConfigError(f"bos_token_id/eos_token_id = {c.bos_token_id}/{c.eos_token_id}; "
                          f"must be < vocab_size = {c.vocab_size}")
    _validate_blocks(c)


def _validate_blocks(c: ModelConfig) -> None:
    """Block divisibility of every quantized linear (FP8: 128 both dims; FP4: act-quant 128 on K)."""
    # activation quantization (per 128 along K) also runs in front of bf16-weight checkpoints?
    # No: only FP8/FP4 weights quantize their input, so checks apply only when quantized.
    if not c.quantized:
        return
    H, Dh, G = c.n_heads, c.head_dim, c.o_groups
    fp8_linears = {
        "wq_a": (c.q_lora_rank, c.dim),
        "wq_b": (H * Dh, c.q_lora_rank),
        "wkv": (Dh, c.dim),
        "wo_a": (G * c.o_lora_rank, H * Dh // G),
        "wo_b": (c.dim, G * c.o_lora_rank),
        "shared_experts.w1/w3": (c.moe_inter_dim, c.dim),
        "shared_experts.w2": (c.dim, c.moe_inter_dim),
    }
    if any(r == 4 for r in c.compress_ratios):
        fp8_linears["indexer.wq_b"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
    if c.n_mtp_layers:
        fp8_linears["mtp e_proj/h_proj"] = (c.dim, c.dim)
    src = {"wq_a": "q_lora_rank / hidden_size", "wq_b": "num_attention_heads*head_dim / q_lora_rank",
           "wkv": "head_dim / hidden_size", "wo_a": "o_groups*o_lora_rank / heads*head_dim/o_groups",
           "wo_b": "hidden_size / o_groups*o_lora_rank",
           "shared_experts.w1/w3": "moe_intermediate_size / hidden_size",
           "shared_experts.w2": "hidden_size / moe_intermediate_size",
           "indexer.wq_b": "index_n_heads*index_head_dim / q_lora_rank",
           "mtp e_proj/h_proj": "hidden_size"}
    for name, (out_f, in_f) in fp8_linears.items():
        if out_f % FP8_BLOCK or in_f % FP8_BLOCK:
            raise ConfigError(f"FP8 linear {name} has shape [{out_f}, {in_f}] ({src[name]}); both "
                              f"dims must be multiples of the {FP8_BLOCK}x{FP8_BLOCK} scale block")
    # routed experts: K must take 128-wide activation quant; FP4 groups of 32 follow from that
    for name, (out_f, in_f) in {"experts.w1/w3": (c.moe_inter_dim, c.dim),
                                "experts.w2": (c.dim, c.moe_inter_dim)}.items():
        if in_f % FP8_BLOCK or (c.expert_format == "fp8" and out_f % FP8_BLOCK):
            raise ConfigError(f"expert linear {name} has shape [{out_f}, {in_f}]; its input dim must "
                              f"be a multiple of {FP8_BLOCK} (activation quantization)"
                              + (" and its output dim too (FP8 blocks)" if c.expert_format == "fp8"
                                 else ""))
