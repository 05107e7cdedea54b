"""ModelConfig: both released config styles, presets, and validation messages."""

import re

import pytest

from dsv4.weights.config import ModelConfig
from dsv4.errors import ConfigError
from dsv4.weights.presets import FLASH, PRO, TINY, get_preset, truncate_layers


@pytest.mark.parametrize("name,preset", [("flash", FLASH), ("pro", PRO)])
def test_real_configs_both_styles_identical(shared_dir, name, preset):
    d = shared_dir / "data" / "configs" / f"deepseek-v4-{name}"
    root = ModelConfig.from_json(d / "config.json")
    inf = ModelConfig.from_json(d / "inference-config.json")
    assert root == inf == preset
    assert root.compress_ratios[-1] == 0 and len(root.compress_ratios) == root.n_layers + 1
    assert root.expert_format == "fp4" and root.quantized


def test_flash_pro_values():
    assert (FLASH.dim, FLASH.n_layers, FLASH.n_routed_experts, FLASH.index_topk) == (4096, 43, 256, 512)
    assert FLASH.compress_ratios[:4] == (0, 0, 4, 128) and FLASH.compress_ratios[42] == 4
    assert (PRO.dim, PRO.n_layers, PRO.n_heads, PRO.o_groups) == (7168, 61, 128, 16)
    assert PRO.compress_ratios[:3] == (128, 128, 4)
    assert TINY.vocab_size == 129280


def test_hf_roundtrip_and_bf16_without_quant_config():
    assert ModelConfig.from_dict(TINY.to_hf_dict()) == TINY
    d = TINY.to_hf_dict()
    del d["quantization_config"], d["expert_dtype"]
    c = ModelConfig.from_dict(d)
    assert c.dtype == "bf16" and c.expert_format == "bf16"


def test_parity_configs_load(shared_dir):
    for case in ("p1-bf16-3layer", "p2-fp8-2layer"):
        c = ModelConfig.from_json(shared_dir / "data" / "parity" / case)
        assert c.dim == 256 and c.window_size == 16


def _bad(**changes):
    d = TINY.to_hf_dict()
    d.update(changes)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    return str(e.value)


@pytest.mark.parametrize("changes,words", [
    ({"compress_ratios": [0, 4, 16]}, ["compress_ratios", "3 entries", "num_hidden_layers + num_nextn_predict_layers"]),
    ({"compress_ratios": [0, 1, 16, 4, 0]}, ["compress_ratios[1]", "1"]),
    ({"scoring_func": "relu"}, ["scoring_func", "relu", "sqrtsoftplus"]),
    ({"num_experts_per_tok": 17}, ["num_experts_per_tok", "17", "n_routed_experts"]),
    ({"num_hash_layers": 9}, ["num_hash_layers", "9", "num_hidden_layers"]),
    ({"o_groups": 3}, ["o_groups = 3", "num_attention_heads = 4"]),
    ({"index_head_dim": 96}, ["index_head_dim", "96", "power of two"]),
    ({"head_dim": 160}, ["head_dim - qk_rope_head_dim", "96", "64"]),
    ({"hidden_size": 200}, ["FP8", "128"]),
    ({"moe_intermediate_size": 96}, ["128"]),
    ({"hidden_size": -4}, ["hidden_size = -4", "positive integer"]),
    ({"num_key_value_heads": 8}, ["num_key_value_heads", "1"]),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, ["rope_scaling.type", "linear", "yarn"]),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
     ["weight_block_size", "128"]),
    ({"quantization_config": {"quant_method": "awq"}}, ["quant_method", "awq"]),
    ({"expert_dtype": "int4"}, ["expert_dtype", "int4"]),
    # the user's words: config.json, its key and the value (not the internal field names)
    ({"num_attention_heads": 5}, ["config.json", "num_attention_heads = 5", "o_groups = 2"]),
    ({"hidden_size": "128"}, ["config.json", "hidden_size = '128'", "integer", "not a string"]),
    ({"num_hidden_layers": 2.5}, ["num_hidden_layers = 2.5", "integer"]),
    ({"rope_scaling": {"type": "yarn", "factor": "x", "original_max_position_embeddings": 4096}},
     ["rope_scaling.factor = 'x'"]),
    ({"rope_scaling": {"type": "yarn", "beta_fast": "32", "original_max_position_embeddings": 9}},
     ["rope_scaling.beta_fast = '32'", "number"]),
])
def test_validation_names_key_value_allowed(changes, words):
    msg = _bad(**changes)
    for w in words:
        assert w in msg, (w, msg)
    assert not re.search(r"\b(dim|n_heads|n_layers|score_func) = ", msg), msg  # internal names


def test_config_file_errors_name_the_file_and_key(tmp_path):
    import json
    d = TINY.to_hf_dict()
    d["num_attention_heads"] = 5
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_json(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: num_attention_heads = 5")
    # the inference style keeps its own (field) names
    inf = {k: v for k, v in TINY.to_dict().items()
           if k not in ("bos_token_id", "eos_token_id", "max_position_embeddings")}
    inf["n_heads"] = 5
    with pytest.raises(ConfigError, match="inference.json: n_heads = 5; must be a multiple of "
                                          "o_groups = 2"):
        ModelConfig.from_dict(inf, source="inference.json")


def test_missing_key_and_bad_files(tmp_path):
    d = TINY.to_hf_dict()
    del d["num_hidden_layers"]
    with pytest.raises(ConfigError, match="missing required key.*num_hidden_layers"):
        ModelConfig.from_dict(d)
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
    with pytest.raises(ConfigError, match="neither"):
        ModelConfig.from_dict({"foo": 1})
    from dsv4.errors import MissingFileError
    with pytest.raises(MissingFileError, match="config not found"):
        ModelConfig.from_json(tmp_path / "nope")


def test_inference_style_unknown_key():
    d = {**{k: v for k, v in FLASH.to_dict().items()
            if k not in ("bos_token_id", "eos_token_id", "max_position_embeddings")}, "n_layer": 3}
    with pytest.raises(ConfigError, match="n_layer"):
        ModelConfig.from_dict(d)


def test_truncate_layers():
    c = get_preset("flash", 4)
    assert c.n_layers == 4 and c.compress_ratios == (0, 0, 4, 128, 0) and c.n_hash_layers == 3
    assert truncate_layers(TINY, 1).n_hash_layers == 1
    with pytest.raises(ConfigError):
        get_preset("flash", 99)
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("huge")
