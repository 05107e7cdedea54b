"""DSpark checkpoints (DeepSeek-V4-Flash 0731): the draft module's config keys and tensors.

These releases keep the April backbone and replace the single MTP block with a DSpark draft
module (semi-autoregressive block drafting). dsv4 loads the backbone and decodes plainly; the
draft module is recognised, left unread and named in one notice. Layout as read by the public
vLLM loader (`vllm/models/deepseek_v4/nvidia/dspark.py`): draft blocks `mtp.{i}.*` shaped like
main layers (sliding-window attention), `mtp.0.main_proj` (the concatenated hidden states of
`dspark_target_layer_ids` -> hidden) and `mtp.0.main_norm`, and on the last stage the final
`norm`, `hc_head_*`, `markov_head.markov_w{1,2}` (rank `dspark_markov_rank`) and
`confidence_head.proj`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError

KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
        "dspark_markov_rank")
DEFAULT_BLOCKS = 3          # vLLM's default when the config does not say (the 0731 release: 3)
MTP_PREFIX = "mtp."         # every draft tensor lives under it
PARTS = ("main_proj", "main_norm", "markov_head", "confidence_head")


@dataclass(frozen=True)
class DSparkConfig:
    """The draft module's hyper-parameters, as the released config.json states them."""
    block_size: int                    # tokens drafted per block (gamma)
    noise_token_id: int | None         # the placeholder id of positions being drafted
    target_layer_ids: tuple            # main layers whose hidden states feed main_proj
    markov_rank: int                   # rank of the Markov head's V x r / r x V factors
    n_blocks: int = DEFAULT_BLOCKS     # draft blocks mtp.0 .. mtp.{n_blocks - 1}
    compress_ratios: tuple = ()        # the draft blocks' entries of compress_ratios
    nextn_layers: int | None = None    # num_nextn_predict_layers as written (kept for round trips)

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        for key, v in (("dspark_block_size", self.block_size),
                       ("dspark_markov_rank", self.markov_rank), ("draft blocks", self.n_blocks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{key} = {v!r}; must be a positive integer")
        if not self.target_layer_ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0
                for i in self.target_layer_ids):
            raise ConfigError(f"dspark_target_layer_ids = {list(self.target_layer_ids)!r}; must be "
                              f"a non-empty list of layer indices")
        if self.noise_token_id is not None and (isinstance(self.noise_token_id, bool) or not
                                                isinstance(self.noise_token_id, int)):
            raise ConfigError(f"dspark_noise_token_id = {self.noise_token_id!r}; must be an "
                              f"integer token id")


def from_hf(d: Mapping[str, Any], n_layers: int) -> DSparkConfig | None:
    """The DSpark part of a released config.json, or None when it has no dspark_* key.

    The draft blocks are the entries of compress_ratios past the main layers (the 0731 config
    lists 46 for 43 layers); without such entries, vLLM's default of 3 blocks."""
    if not any(k in d for k in KEYS):
        return None
    for k in ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank"):
        if k not in d:
            raise ConfigError(f"{k} is missing: a DSpark config (it has "
                              f"{', '.join(x for x in KEYS if x in d)}) needs dspark_block_size, "
                              f"dspark_target_layer_ids and dspark_markov_rank")
    targets = d["dspark_target_layer_ids"]
    if not isinstance(targets, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in targets):
        raise ConfigError(f"dspark_target_layer_ids = {targets!r}; must be a list of main layer "
                          f"indices < num_hidden_layers = {n_layers}")
    ratios = d.get("compress_ratios")
    extra = tuple(ratios[n_layers:]) if isinstance(ratios, (list, tuple)) else ()
    return DSparkConfig(block_size=d["dspark_block_size"],
                        noise_token_id=d.get("dspark_noise_token_id"), target_layer_ids=targets,
                        markov_rank=d["dspark_markov_rank"],
                        n_blocks=len(extra) or DEFAULT_BLOCKS, compress_ratios=extra,
                        nextn_layers=d.get("num_nextn_predict_layers"))


def to_hf(ds: DSparkConfig) -> dict:
    """The config.json keys of `ds` (compress_ratios entries go after the main layers')."""
    d = {"dspark_block_size": ds.block_size, "dspark_target_layer_ids": list(ds.target_layer_ids),
         "dspark_markov_rank": ds.markov_rank}
    if ds.noise_token_id is not None:
        d["dspark_noise_token_id"] = ds.noise_token_id
    d["num_nextn_predict_layers"] = ds.nextn_layers if ds.nextn_layers is not None else ds.n_blocks
    return d


def skipped_notice(cfg, skipped: Mapping[str, Any]) -> str:
    """The one line that says what a DSpark checkpoint's plain decode leaves out.
    `skipped`: name -> TensorInfo of the tensors not loaded."""
    ds = cfg.dspark
    stages = sorted({int(m.group(1)) for n in skipped if (m := re.match(r"mtp\.(\d+)\.", n))})
    parts = [p for p in PARTS if any(f".{p}." in n for n in skipped)]
    nbytes = sum(i.nbytes for i in skipped.values())
    where = (f"mtp.{stages[0]}-{stages[-1]}" if len(stages) > 1 else
             f"mtp.{stages[0]}" if stages else "no mtp.* tensors")
    return (f"DSpark checkpoint (dspark_block_size {ds.block_size}, target layers "
            f"{','.join(map(str, ds.target_layer_ids))}): its draft module is skipped, "
            f"{len(skipped)} tensors ({where}"
            + (f": {', '.join(parts)}, draft blocks" if parts else "")
            + f"; {_size(nbytes)} not read); the backbone decodes plainly (DSpark "
              f"drafting is not supported yet)")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
