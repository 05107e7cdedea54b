"""Named configs: the real DeepSeek-V4-Flash / -Pro hyper-parameters and a small `tiny` model.

`flash` and `pro` equal the released configs (`../shared/data/configs/`); `tiny` keeps the real
vocabulary (129280, so the real tokenizer works) and every architectural feature (hash layer,
window-only, ratio-4 with indexer, another ratio, FP8 + FP4 weights, MTP block) at toy size;
`tiny-dspark` is `tiny`'s backbone with a DSpark draft module in place of the MTP block.
"""
from __future__ import annotations

from .config import ModelConfig
from .dspark import DSparkConfig

_COMMON = dict(
    vocab_size=129280, n_hash_layers=3, n_mtp_layers=1, n_shared_experts=1,
    n_activated_experts=6, score_func="sqrtsoftplus", swiglu_limit=10.0, head_dim=512,
    rope_head_dim=64, norm_eps=1e-6, o_lora_rank=1024, window_size=128,
    compress_rope_theta=160000.0, original_seq_len=65536, rope_theta=10000.0, rope_factor=16.0,
    beta_fast=32, beta_slow=1, index_n_heads=64, index_head_dim=128, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4",
)

FLASH = ModelConfig(
    dim=4096, moe_inter_dim=2048, n_layers=43, n_heads=64, n_routed_experts=256,
    route_scale=1.5, q_lora_rank=1024, o_groups=8, index_topk=512,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0), **_COMMON)

PRO = ModelConfig(
    dim=7168, moe_inter_dim=3072, n_layers=61, n_heads=128, n_routed_experts=384,
    route_scale=2.5, q_lora_rank=1536, o_groups=16, index_topk=1024,
    compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0), **_COMMON)

TINY = ModelConfig(
    vocab_size=129280, dim=128, moe_inter_dim=128, n_layers=4, n_hash_layers=1, n_mtp_layers=1,
    n_heads=4, n_routed_experts=16, n_shared_experts=1, n_activated_experts=6,
    score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0, q_lora_rank=128,
    head_dim=128, rope_head_dim=64, norm_eps=1e-6, o_groups=2, o_lora_rank=128, window_size=16,
    compress_ratios=(0, 4, 16, 4, 0), compress_rope_theta=160000.0, original_seq_len=64,
    rope_theta=10000.0, rope_factor=4.0, beta_fast=32, beta_slow=1, index_n_heads=4,
    index_head_dim=128, index_topk=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4")

# TINY's backbone with a DSpark draft module (3 window-only blocks, as the 0731 release) in
# place of the MTP block: dsv4 loads the backbone and skips the draft module (dsv4.weights.dspark)
TINY_DSPARK = TINY.replace(
    n_mtp_layers=0, compress_ratios=TINY.compress_ratios[:TINY.n_layers],
    dspark=DSparkConfig(block_size=5, noise_token_id=128799, target_layer_ids=(1, 2, 3),
                        markov_rank=16, n_blocks=3, compress_ratios=(0, 0, 0), nextn_layers=1))

# tiny with shapes that split over 2 and 4 tensor-parallel ranks in whole quantization blocks
# (expert inter dim 512, 4 output groups): a TP run on the CPU (`dsv4 bench --parallel tp`,
# `dsv4 make-checkpoint --preset tiny-tp` then `dsv4 decode --parallel tp --device cpu,cpu`)
TINY_TP = TINY.replace(moe_inter_dim=512, o_groups=4)

PRESETS = {"flash": FLASH, "pro": PRO, "tiny": TINY, "tiny-dspark": TINY_DSPARK, "tiny-tp": TINY_TP}


def get_preset(name: str, n_layers: int | None = None) -> ModelConfig:
    """A preset by name, optionally cut to its first `n_layers` layers (MTP entry kept last)."""
    if name not in PRESETS:
        from ..errors import ConfigError
        raise ConfigError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    return truncate_layers(PRESETS[name], n_layers) if n_layers else PRESETS[name]


def truncate_layers(cfg: ModelConfig, n_layers: int) -> ModelConfig:
    """The same model with only its first `n_layers` main layers (hash layers capped to fit)."""
    from ..errors import ConfigError
    if not 1 <= n_layers <= cfg.n_layers:
        raise ConfigError(f"layers = {n_layers}; allowed: 1..{cfg.n_layers}")
    ratios = cfg.compress_ratios[:n_layers] + cfg.compress_ratios[cfg.n_layers:]
    return cfg.replace(n_layers=n_layers, compress_ratios=ratios,
                       n_hash_layers=min(cfg.n_hash_layers, n_layers))
