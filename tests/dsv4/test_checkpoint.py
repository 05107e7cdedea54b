"""Checkpoint table, validation (every bad-input row of USERS.md) and lazy loading."""
from __future__ import annotations

import gzip
import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv4.weights.checkpoint as ckmod
from dsv4.weights.checkpoint import INDEX_NAME, expected_tensor_table, open_checkpoint
from dsv4.weights.config import ModelConfig
from dsv4.errors import (CheckpointError, ConfigError, CorruptFileError, MissingFileError,
                         TensorMismatchError, UserInputError)
from dsv4.weights.presets import TINY
from dsv4.weights.synthetic import write_checkpoint

SMALL = TINY.replace(vocab_size=1024)   # every tiny feature, small embed/head
PARITY = ("p1-bf16-3layer", "p2-fp8-2layer")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_checkpoint(SMALL, tmp_path_factory.mktemp("small") / "ckpt", weights="fp8", seed=1)


@pytest.fixture
def ckpt(written, tmp_path):
    """A private copy of the small FP8/FP4 checkpoint, free to damage."""
    return shutil.copytree(written, tmp_path / "ckpt")


def _index(d):
    return json.loads((d / INDEX_NAME).read_text())


def _edit_shard(d, name, fn):
    """Apply fn(dict of tensors) to the shard holding `name`, and rewrite the index to match."""
    idx = _index(d)
    fname = idx["weight_map"][name]
    tensors = load_file(d / fname)
    fn(tensors)
    save_file(tensors, d / fname, metadata={"format": "pt"})
    idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if f != fname}
    idx["weight_map"].update({n: fname for n in tensors})
    (d / INDEX_NAME).write_text(json.dumps(idx))


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _raises(exc, d):
    with pytest.raises(exc) as ei:
        open_checkpoint(d)
    assert isinstance(ei.value, UserInputError)
    assert "\n" not in str(ei.value)   # the CLI prints one line
    return str(ei.value)


# ---- tensor table ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["flash", "pro"])
def test_table_equals_released_table(shared_dir, model):
    d = shared_dir / "data" / "configs" / f"deepseek-v4-{model}"
    with gzip.open(d / "tensor-table.json.gz") as f:
        released = {n: (tuple(v["shape"]), v["dtype"]) for n, v in json.load(f).items()}
    table = expected_tensor_table(ModelConfig.from_json(d / "config.json"))
    assert len(table) == {"flash": 69187, "pro": 145116}[model]
    assert table == released


@pytest.mark.parametrize("case", PARITY)
def test_table_equals_parity_headers_and_opens(shared_dir, case):
    d = shared_dir / "data" / "parity" / case
    headers = {}
    for f in sorted(d.glob("*.safetensors")):
        n = struct.unpack("<Q", f.read_bytes()[:8])[0]
        h = json.loads(f.read_bytes()[8:8 + n])
        headers.update({k: (tuple(v["shape"]), v["dtype"]) for k, v in h.items()
                        if k != "__metadata__"})
    cfg = ModelConfig.from_json(d)
    assert expected_tensor_table(cfg) == headers
    with open_checkpoint(d) as ck:
        assert ck.config == cfg and set(ck.tensor_names()) == set(headers)
        name = "layers.0.attn.wq_a.weight"
        ref = load_file(d / _index(d)["weight_map"][name])[name]
        got = ck.get(name)
        assert got.dtype == ref.dtype and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_table_bf16_and_fp8_experts():
    bf = expected_tensor_table(SMALL.replace(dtype="bf16", scale_fmt=None, expert_dtype=None))
    assert not any(n.endswith(".scale") for n in bf)
    assert bf["layers.1.ffn.experts.3.w2.weight"] == ((128, 128), "BF16")
    f8 = expected_tensor_table(SMALL.replace(expert_dtype=None))
    assert f8["layers.1.ffn.experts.3.w2.weight"] == ((128, 128), "F8_E4M3")
    assert f8["layers.1.ffn.experts.3.w2.scale"] == ((1, 1), "F8_E8M0")
    fp4 = expected_tensor_table(SMALL)
    assert fp4["layers.1.ffn.experts.3.w2.weight"] == ((128, 64), "I8")
    assert fp4["layers.1.ffn.experts.3.w2.scale"] == ((128, 4), "F8_E8M0")
    # hash layer 0 has tid2eid, the others (and MTP) a bias; ratio 16 has no indexer
    assert fp4["layers.0.ffn.gate.tid2eid"] == ((1024, 6), "I64")
    assert "layers.1.ffn.gate.bias" in fp4 and "mtp.0.ffn.gate.bias" in fp4
    assert fp4["layers.2.attn.compressor.ape"] == ((16, 128), "F32")
    assert not any(n.startswith("layers.2.attn.indexer") for n in fp4)


# ---- bad inputs (USERS.md table) ------------------------------------------------------------

def test_missing_directory(tmp_path):
    msg = _raises(MissingFileError, tmp_path / "nope")
    assert str(tmp_path / "nope") in msg


def test_path_is_a_file(ckpt):
    msg = _raises(MissingFileError, ckpt / "config.json")
    assert "config.json is not a directory" in msg and "not found" not in msg


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    assert str(ckpt / "config.json") in _raises(MissingFileError, ckpt)


def test_invalid_config_value(ckpt):
    _edit_config(ckpt, scoring_func="relu")
    msg = _raises(ConfigError, ckpt)
    assert "config.json: scoring_func = 'relu'" in msg and "sqrtsoftplus" in msg


def test_unparsable_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    assert "config.json" in _raises(ConfigError, ckpt)


def test_missing_shard(ckpt):
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    msg = _raises(MissingFileError, ckpt)
    assert "model-00002-of-00002.safetensors" in msg and INDEX_NAME in msg


def test_missing_index(ckpt):
    (ckpt / INDEX_NAME).unlink()
    assert INDEX_NAME in _raises(MissingFileError, ckpt)


def test_no_weights(ckpt):
    for f in ckpt.glob("model*"):
        f.unlink()
    assert "model.safetensors" in _raises(MissingFileError, ckpt)


def test_extra_shard_not_in_index_is_an_error(ckpt):
    shutil.copyfile(ckpt / "model-00002-of-00002.safetensors", ckpt / "model-00003-of-00003.safetensors")
    msg = _raises(CheckpointError, ckpt)
    assert "model-00003-of-00003.safetensors" in msg and "not named in" in msg


def test_index_entry_points_to_wrong_file(ckpt):
    idx = _index(ckpt)
    idx["weight_map"]["embed.weight"] = "model-00002-of-00002.safetensors"
    (ckpt / INDEX_NAME).write_text(json.dumps(idx))
    msg = _raises(CheckpointError, ckpt)
    assert "embed.weight is listed in model-00002-of-00002.safetensors but stored in " \
           "model-00001-of-00002.safetensors" in msg


def test_index_lists_tensor_no_shard_holds(ckpt):
    name = "layers.1.attn.wq_a.weight"
    idx = _index(ckpt)
    _edit_shard(ckpt, name, lambda t: t.pop(name))
    (ckpt / INDEX_NAME).write_text(json.dumps(idx))   # the old index still names it
    assert f"{name} is listed in" in _raises(CheckpointError, ckpt)


def test_missing_tensor(ckpt):
    name = "layers.1.attn.wq_a.scale"
    _edit_shard(ckpt, name, lambda t: t.pop(name))
    msg = _raises(TensorMismatchError, ckpt)
    assert f"{name}: expected [1, 1] F8_E8M0, missing" in msg and "missing 1" in msg


def test_unexpected_tensor(ckpt):
    def add(t):
        t["layers.1.attn.bogus"] = torch.zeros(3, 5)
    _edit_shard(ckpt, "layers.1.attn.wq_a.weight", add)
    msg = _raises(TensorMismatchError, ckpt)
    assert "layers.1.attn.bogus: unexpected, found [3, 5] F32" in msg
    assert "unexpected 1" in msg


def test_wrong_shape(ckpt):
    name = "layers.2.attn.compressor.ape"
    def edit(t):
        t[name] = torch.zeros(8, 128)
    _edit_shard(ckpt, name, edit)
    assert f"{name}: expected [16, 128] F32, found [8, 128] F32" in _raises(TensorMismatchError, ckpt)


def test_wrong_dtype(ckpt):
    name = "layers.1.attn_norm.weight"
    def edit(t):
        t[name] = t[name].float()
    _edit_shard(ckpt, name, edit)
    assert f"{name}: expected [128] BF16, found [128] F32" in _raises(TensorMismatchError, ckpt)


def test_many_offenders_listed_up_to_ten_with_total(ckpt):
    name = "layers.1.ffn.experts.0.w1.weight"
    def drop(t):
        for n in [n for n in t if ".ffn.experts." in n and n.startswith("layers.1.")]:
            del t[n]
    _edit_shard(ckpt, name, drop)
    msg = _raises(TensorMismatchError, ckpt)
    assert "96 tensor(s) do not match" in msg and "first 10 of 96" in msg
    assert msg.count(", missing;") + msg.endswith(", missing") == 10


def test_fp4_experts_without_expert_dtype_hint(ckpt):
    _edit_config(ckpt, expert_dtype=None)
    msg = _raises(TensorMismatchError, ckpt)
    assert 'add "expert_dtype": "fp4" to config.json' in msg
    assert "expected [128, 128] F8_E4M3, found [128, 64] I8" in msg


def test_hidden_size_hint_without_a_wrong_format_hint(ckpt):
    """Only the shapes differ (the FP4 experts match "expert_dtype": "fp4"): the hint names
    hidden_size and does not advise adding expert_dtype, which is already there."""
    _edit_config(ckpt, hidden_size=256)
    msg = _raises(TensorMismatchError, ckpt)
    assert "expert_dtype" not in msg and "remove" not in msg, msg
    assert "The shards have hidden_size = 128 (embed.weight is [1024, 128]) but config.json says " \
           "hidden_size = 256: fix hidden_size." in msg
    assert "expected [1024, 256] BF16, found [1024, 128] BF16" in msg


def test_fp8_shards_with_bf16_config_hint(ckpt):
    _edit_config(ckpt, expert_dtype=None, quantization_config=None)
    assert "quantization_config" in _raises(TensorMismatchError, ckpt)


def test_layer_count_hint(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    _edit_config(ckpt, num_hidden_layers=3, compress_ratios=cfg["compress_ratios"][:3] + [0])
    msg = _raises(TensorMismatchError, ckpt)
    assert "layers 0..3 but num_hidden_layers = 3" in msg


def test_truncated_shard(ckpt):
    f = ckpt / "model-00001-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    msg = _raises(CorruptFileError, ckpt)
    assert str(f) in msg and "truncated" in msg


def test_truncated_to_header(ckpt):
    f = ckpt / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    assert str(f) in _raises(CorruptFileError, ckpt)


def test_trailing_bytes(ckpt):
    f = ckpt / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes() + bytes(16))
    msg = _raises(CorruptFileError, ckpt)
    assert str(f) in msg and "16 unexpected byte(s)" in msg


@pytest.mark.parametrize("damage", ["json", "length", "tiny", "entry", "overlap"])
def test_corrupt_header(ckpt, damage):
    f = ckpt / "model-00001-of-00002.safetensors"
    b = bytearray(f.read_bytes())
    if damage == "json":
        b[10:30] = b"\xff" * 20
    elif damage == "length":
        b[:8] = struct.pack("<Q", 2**40)
    elif damage == "tiny":
        b = b[:5]
    else:   # well-formed JSON with a bad byte span
        n = struct.unpack("<Q", bytes(b[:8]))[0]
        hdr = json.loads(bytes(b[8:8 + n]))
        if damage == "entry":
            hdr["layers.0.ffn.gate.tid2eid"]["shape"] = [1024, 7]   # same length, wrong span
        else:   # the first tensor shifted by 8 bytes: a gap, then an overlap
            assert hdr["layers.0.ffn.gate.tid2eid"]["data_offsets"] == [0, 1024 * 6 * 8]
            hdr["layers.0.ffn.gate.tid2eid"]["data_offsets"] = [8, 1024 * 6 * 8 + 8]
        raw = json.dumps(hdr, separators=(",", ":")).encode().ljust(n)
        assert len(raw) == n
        b[8:8 + n] = raw
    f.write_bytes(bytes(b))
    assert str(f) in _raises(CorruptFileError, ckpt)


def test_corrupt_index(ckpt):
    (ckpt / INDEX_NAME).write_text("{]")
    assert INDEX_NAME in _raises(CorruptFileError, ckpt)


def test_validation_reads_no_tensor_data(ckpt, monkeypatch):
    def no_data(*a, **k):
        raise AssertionError("tensor data read during validation")
    monkeypatch.setattr(ckmod, "safe_open", no_data)
    ck = open_checkpoint(ckpt)   # a valid checkpoint validates from headers alone
    with pytest.raises(AssertionError):
        ck.get("embed.weight")
    f = ckpt / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    _raises(CorruptFileError, ckpt)


def test_explicit_config_skips_config_json(ckpt):
    (ckpt / "config.json").unlink()
    cfg = SMALL
    with open_checkpoint(ckpt, cfg) as ck:
        assert ck.config is cfg
    with pytest.raises(TensorMismatchError):
        open_checkpoint(ckpt, SMALL.replace(vocab_size=2048))


# ---- loading -------------------------------------------------------------------------------

def test_get_dtypes_and_names(written):
    with open_checkpoint(written) as ck:
        dt = {"embed.weight": torch.bfloat16, "hc_head_fn": torch.float32,
              "layers.1.attn.wq_a.weight": torch.float8_e4m3fn,
              "layers.1.attn.wq_a.scale": torch.float8_e8m0fnu,
              "layers.1.ffn.experts.2.w1.weight": torch.int8,
              "layers.0.ffn.gate.tid2eid": torch.int64}
        for name, d in dt.items():
            t = ck.get(name)
            assert t.dtype == d and tuple(t.shape) == ck.info(name).shape
        assert ck.tensor_names()[0] == "embed.weight"
        assert set(ck.tensor_names()) == set(expected_tensor_table(ck.config))
        assert all(n.startswith("layers.1.") for n in ck.layer_names(1))
        assert "layers.1.attn.wq_a.weight" in ck.layer_names("layers.1")
        assert not any(n.startswith("layers.1") for n in ck.layer_names(0))
        assert set(ck.layer_names("mtp.0")) == set(ck.prefix_names("mtp.0."))
        assert set(ck.global_names()) == {"embed.weight", "head.weight", "norm.weight",
                                          "hc_head_fn", "hc_head_base", "hc_head_scale"}
        data = sum(f.stat().st_size - 8 - struct.unpack("<Q", f.read_bytes()[:8])[0]
                   for f in written.glob("*.safetensors"))
        assert ck.nbytes() == data == _index(written)["metadata"]["total_size"]
        assert ck.nbytes(["embed.weight"]) == 1024 * 128 * 2
        with pytest.raises(KeyError, match="bogus"):
            ck.get("bogus")


def test_load_into_stacked_slices(written):
    with open_checkpoint(written) as ck:
        E = ck.config.n_routed_experts
        name = "layers.2.ffn.experts.{}.w2.{}"
        w = torch.full((E,) + ck.info(name.format(0, "weight")).shape, 7, dtype=torch.int8)
        s = torch.zeros((E,) + ck.info(name.format(0, "scale")).shape, dtype=torch.float8_e8m0fnu)
        ck.load_many([(name.format(e, "weight"), w[e]) for e in range(E)]
                     + [(name.format(e, "scale"), s[e]) for e in range(E)], progress=False)
        for e in (0, 5, E - 1):
            assert torch.equal(w[e], ck.get(name.format(e, "weight")))
            assert torch.equal(s[e].view(torch.uint8), ck.get(name.format(e, "scale")).view(torch.uint8))
        # a strided slice of a stacked bf16 tensor
        norms = torch.zeros(128, 3, dtype=torch.bfloat16)
        ck.load_into("layers.1.attn_norm.weight", norms[:, 1])
        assert torch.equal(norms[:, 1], ck.get("layers.1.attn_norm.weight"))
        assert not norms[:, 0].any()


def test_load_into_mismatch(written):
    with open_checkpoint(written) as ck:
        with pytest.raises(TensorMismatchError, match=r"destination is \[64\].*holds \[128\]"):
            ck.load_into("norm.weight", torch.empty(64, dtype=torch.bfloat16))
        with pytest.raises(TensorMismatchError, match="torch.bfloat16 or torch.float32"):
            ck.load_into("norm.weight", torch.empty(128, dtype=torch.float16))
        with pytest.raises(TensorMismatchError, match="float8_e8m0fnu"):
            ck.load_into("layers.1.attn.wq_a.scale", torch.empty(1, 1))


def test_load_into_exact_widening(written):
    with open_checkpoint(written) as ck:
        n = "layers.1.attn.q_norm.weight"   # BF16 stored, float32 held (as the reference)
        dst = ck.load_into(n, torch.empty(128))
        assert torch.equal(dst, ck.get(n).float())
        n = "layers.0.ffn.gate.tid2eid"     # I64 stored, int32 is enough for expert ids
        dst = ck.load_into(n, torch.empty(1024, 6, dtype=torch.int32))
        assert torch.equal(dst.long(), ck.get(n))


def test_load_many_progress_bar(written, capsys):
    with open_checkpoint(written) as ck:
        dst = torch.empty(ck.info("embed.weight").shape, dtype=torch.bfloat16)
        ck.load_many([("embed.weight", dst)], desc="load", progress=True)
        err = capsys.readouterr().err
        assert "load" in err and "B" in err
        ck.load_many([("embed.weight", dst)])   # 256 KiB: below the threshold, no bar
        assert capsys.readouterr().err == ""


def test_close_and_reopen(written):
    ck = open_checkpoint(written)
    a = ck.get("norm.weight")
    ck.close()
    ck.close()
    assert torch.equal(ck.get("norm.weight"), a)   # reopens lazily
    ck.close()


def test_single_file_checkpoint(tmp_path):
    d = write_checkpoint(SMALL.replace(n_layers=1, compress_ratios=(4, 0)), tmp_path / "one",
                         weights="bf16", shards=0)
    assert not (d / INDEX_NAME).exists() and (d / "model.safetensors").is_file()
    with open_checkpoint(d) as ck:
        assert ck.get("layers.0.attn.wq_a.weight").dtype == torch.bfloat16
    shutil.copyfile(d / "model.safetensors", d / "model-00001-of-00001.safetensors")
    assert "model-00001-of-00001.safetensors" in _raises(CheckpointError, d)


@pytest.mark.cuda
def test_load_to_cuda(written):
    dev = torch.device("cuda", 0)
    with open_checkpoint(written) as ck:
        for n in ("embed.weight", "hc_head_fn", "layers.1.attn.wq_a.weight",
                  "layers.1.attn.wq_a.scale", "layers.1.ffn.experts.0.w1.weight",
                  "layers.0.ffn.gate.tid2eid"):
            t = ck.get(n, device=dev)
            assert t.device == dev and t.dtype == ck.info(n).torch_dtype
            assert torch.equal(t.cpu().view(torch.uint8), ck.get(n).view(torch.uint8))
        E = ck.config.n_routed_experts
        name = "layers.1.ffn.experts.{}.w3.scale"
        stacked = torch.zeros((E,) + ck.info(name.format(0)).shape, dtype=torch.float8_e8m0fnu,
                              device=dev)
        ck.load_many([(name.format(e), stacked[e]) for e in range(E)], progress=False)
        for e in range(E):
            assert torch.equal(stacked[e].cpu().view(torch.uint8),
                               ck.get(name.format(e)).view(torch.uint8))


# ---- DSpark checkpoints ------------------------------------------------------------------------

def test_dspark_checkpoint_opens_its_backbone(tmp_path):
    """A DSpark checkpoint (0731 layout: dspark_* keys, compress_ratios past the main layers,
    draft module under mtp.*) opens as its backbone; the draft tensors are set aside and named."""
    from dsv4.weights.synthetic import draft_tensor_table
    from dsv4.weights.presets import TINY_DSPARK
    cfg = TINY_DSPARK.replace(vocab_size=1024)
    d = write_checkpoint(cfg, tmp_path / "dspark", weights="fp8", seed=1)
    raw = json.loads((d / "config.json").read_text())
    assert raw["dspark_block_size"] == 5 and raw["dspark_target_layer_ids"] == [1, 2, 3]
    assert len(raw["compress_ratios"]) == cfg.n_layers + 3 and raw["num_nextn_predict_layers"] == 1
    ck = open_checkpoint(d)
    assert ck.config == cfg and ck.config.n_mtp_layers == 0
    assert set(ck.tensor_names()) == set(expected_tensor_table(cfg))
    draft = draft_tensor_table(cfg)
    assert set(ck.skipped) == set(draft) and all(n.startswith("mtp.") for n in draft)
    for part in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
                 "mtp.2.markov_head.markov_w1.weight", "mtp.2.confidence_head.proj.weight",
                 "mtp.1.attn.wkv.weight", "mtp.2.ffn.experts.0.w1.weight"):
        assert part in ck.skipped, part
    assert ck.skipped["mtp.0.main_proj.weight"].shape == (128, 3 * 128)
    note = ck.notice
    for part in ("DSpark checkpoint", "dspark_block_size 5", f"{len(draft)} tensors", "mtp.0-2",
                 "main_proj", "main_norm", "markov_head", "confidence_head", "not supported yet"):
        assert part in note, (part, note)
    assert open_checkpoint(ck.path).notice == note
    # the same shards under a config without the dspark keys: the usual table mismatch
    _edit_config(d, dspark_block_size=None, dspark_target_layer_ids=None,
                 dspark_markov_rank=None, dspark_noise_token_id=None,
                 compress_ratios=raw["compress_ratios"][:cfg.n_layers] + [0])
    assert "unexpected" in _raises(TensorMismatchError, d)


@pytest.mark.parametrize("changes, words", [
    ({"dspark_markov_rank": None}, ["dspark_markov_rank is missing"]),
    ({"dspark_target_layer_ids": [1, 9]}, ["dspark_target_layer_ids = [1, 9]", "< num_hidden_layers = 4"]),
    ({"dspark_block_size": 0}, ["dspark_block_size = 0", "positive integer"]),
])
def test_dspark_config_errors(changes, words):
    from dsv4.weights.presets import TINY_DSPARK
    d = TINY_DSPARK.to_hf_dict()
    for k, v in changes.items():
        d.pop(k) if v is None else d.__setitem__(k, v)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
