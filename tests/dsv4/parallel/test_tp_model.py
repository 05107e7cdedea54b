"""The tensor-parallel model on the CPU (dsv4.model.sharding, dsv4.runtime.tp): two gloo ranks,
each holding its shard of a small model, give the one-process logits within float32 noise
(prefill in chunks, eager decode steps, fake-quant off, no top-k near-tie), the same greedy and
sampled tokens through a plain Session, the same logits bits on every rank; each rank's shard of
an FP8 / FP4 checkpoint is exactly the part of each tensor it names (read sliced), and random
weights made on the device give the same shard. Degrees a model cannot take are refused, naming
the sizes and the degrees it can. One start-up of two ranks serves the module (~30 s on 2 cores).
"""
from __future__ import annotations

import pytest
import torch

import tp_ranks
from dsv4.errors import ConfigError, TensorMismatchError
from dsv4.model.sharding import check_degree, split_problems
from dsv4.model.transformer import Transformer
from dsv4.parallel import launch
from dsv4.runtime.build import load_model
from dsv4.runtime.config import RuntimeConfig
from dsv4.weights.checkpoint import open_checkpoint
from dsv4.weights.parts import Part, weight_parts
from dsv4.weights.presets import FLASH, PRO
from helpers import GAP, SMALL, NearTies, disable_fake_quant, small_checkpoint

# SMALL with an odd vocabulary (the head's last rank gets a zero pad row) and experts whose
# inter dim splits in whole 128-blocks over two ranks (the FP8 / FP4 checkpoint needs that)
TP_CFG = SMALL.replace(vocab_size=2047, moe_inter_dim=256)
PROMPT = torch.randint(0, TP_CFG.vocab_size, (20,), generator=torch.Generator().manual_seed(4))
REL = 1e-5              # float32 noise between two summation orders, relative to the logits' size
FLIP_BOUND = 0.15       # what one flipped e4m3 / e2m1 rounding can do (tests/dsv4/test_prefill.py)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-ckpt")
    return {w: small_checkpoint(root, w, cfg=TP_CFG) for w in ("bf16", "fp8")}


@pytest.fixture(scope="module")
def ranks(ckpts):
    return launch(tp_ranks.tp_rank, ["cpu", "cpu"], str(ckpts["bf16"]), str(ckpts["fp8"]),
                  PROMPT.tolist(), timeout_s=60, deadline_s=300)


@pytest.fixture(scope="module")
def one(ckpts):
    """The same runs in one process."""
    res = {}
    with pytest.MonkeyPatch.context() as mp:
        ties = NearTies().install(mp)
        disable_fake_quant(mp.setattr)
        m, ck = load_model(ckpts["bf16"], tp_ranks.runtime())
        ck.close()
        res["greedy"] = tp_ranks.greedy_run(m, PROMPT)
        res["session"] = tp_ranks.session_tokens(m, PROMPT.tolist())
        res["min_gap"] = ties.min_gap
    m, ck = load_model(ckpts["fp8"], tp_ranks.runtime())
    ck.close()
    res["fp8_logits"] = m.prefill(PROMPT)
    return res


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the largest |b|, per row, the worst row."""
    return float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())


def test_tp2_gives_the_one_process_logits_and_tokens(ranks, one):
    assert one["min_gap"] > GAP and all(r["min_gap"] > GAP for r in ranks), \
        f"a top-k near-tie ({one['min_gap']:.2g}, {[r['min_gap'] for r in ranks]}): other inputs"
    want = one["greedy"]
    for r in ranks:
        got = r["greedy"]
        assert got["logits"].shape == (1 + tp_ranks.N_NEW, TP_CFG.vocab_size)
        assert got["tokens"] == want["tokens"]
        err = _close(got["logits"], want["logits"])
        assert err < REL, f"rank {r['rank']}: logits differ by {err:.3g} of their size"


def test_a_decode_step_all_reduces_twice_a_layer(ranks):
    """Two all-reduces a layer in a decode step (attention's output, the MoE's): what the TP
    bench's communication a layer counts (dsv4.bench.tp.ALLREDUCES_PER_LAYER)."""
    from dsv4.bench.tp import ALLREDUCES_PER_LAYER
    for r in ranks:
        n, layers = r["step_allreduces"]
        assert n == ALLREDUCES_PER_LAYER * layers


def test_a_prefill_chunk_splits_its_mhc_by_rows_over_the_ranks(ranks, one):
    """A chunk of an even number of rows runs sequence parallel: per layer two all-gathers (each
    sublayer's input rows) and two reduce-scatters (its sums), no all-reduce, one more
    all-gather a layer with an indexer (each rank selects its rows' compressed entries), one of
    the last layer's rows and one of the head's logits; the logits those of the split turned
    off (two all-reduces a layer) within float32 noise, the same bits on every rank. An odd
    chunk is not split."""
    for r in ranks:
        seq, L = r["seq"], r["seq"]["layers"]
        assert seq["indexers"] > 0
        assert seq["on_n"] == {"all_reduce": 0, "reduce_scatter": 2 * L,
                               "all_gather": 2 * L + seq["indexers"] + 2}
        assert seq["off_n"] == {"all_reduce": 2 * L, "reduce_scatter": 0, "all_gather": 1}
        assert seq["odd_n"] == seq["off_n"]
        err = _close(seq["on"][None], seq["off"][None])
        assert err < REL, f"rank {r['rank']}: split and whole differ by {err:.3g}"
    assert tp_ranks.same_bits(ranks[0]["seq"]["on"], ranks[1]["seq"]["on"])


def test_every_rank_holds_the_same_logits_bits(ranks):
    r0, r1 = ranks
    assert tp_ranks.same_bits(r0["greedy"]["logits"], r1["greedy"]["logits"])
    assert tp_ranks.same_bits(r0["fp8_logits"], r1["fp8_logits"])


def test_a_session_runs_unchanged_on_every_rank(ranks, one):
    for r in ranks:
        assert r["rt"] == (2, ("cpu",))
        assert r["table"]["parallel.group"] == "2 ranks, gloo, timeout 60 s"
        assert r["session"]["greedy"] == one["session"]["greedy"] == one["greedy"]["tokens"]
        assert r["session"]["sampled"] == ranks[0]["session"]["sampled"]
        assert r["session"]["sampled"] == one["session"]["sampled"]
        # closing a rank's Session lets go of the model's prefill chunk graphs (their NCCL
        # all-reduces would hold the group's teardown); one process keeps them for the next
        assert r["session"]["graphs_released"] and not one["session"]["graphs_released"]


def test_fp8_fp4_shards_are_the_parts_of_the_checkpoint(ranks):
    for r in ranks:
        s = r["shards"]
        assert s["bad"] == [] and s["synthetic"] == [], (s["bad"][:5], s["synthetic"][:5])
        assert all(s["dense"].values()), s["dense"]
        assert 0 < s["n_split"] < s["n"]
        assert s["head_rows"] == 1024                 # ceil(2047 / 2)
    # one progress bar for a TP load: rank 0 decides by size as one process does, the others none
    assert [r["shards"]["progress"] for r in ranks] == [None, False]
    # rank 1: heads 2..3 (of 4), output group 1 (of 2: wo_b columns 128..255, scale column 1),
    # inter rows 128..255 (FP4 w2: packed columns 64..127, scales per 32: 4..7), head rows
    # 1024..2047 (the last one past the vocabulary: zeros)
    assert ranks[1]["shards"]["parts"] == {
        "head.weight": (0, 1024, 2048), "layers.1.attn.attn_sink": (0, 2, 4),
        "layers.1.attn.wo_b.scale": (1, 1, 2), "layers.1.ffn.experts.3.w2.weight": (1, 64, 128),
        "layers.1.ffn.experts.3.w2.scale": (1, 4, 8)}
    assert ranks[0]["shards"]["parts"]["head.weight"] == (0, 0, 1024)


def test_fp8_tp2_stays_within_a_rounding_flip(ranks, one):
    """Fake-quant and W8A8 on: the ranks' float32 sums may flip an e4m3 rounding somewhere (as
    another chunking does), so only a bound; a wrong scale or slice moves the logits by ~1."""
    ref = one["fp8_logits"]
    for r in ranks:
        assert ((r["fp8_logits"] - ref).norm() / ref.norm()).item() < FLIP_BOUND


# ---- no processes: the degrees, the parts, the errors ----------------------------------------

def test_the_degrees_a_model_takes():
    for cfg in (FLASH, PRO):
        assert all(split_problems(cfg, w) == [] for w in (1, 2, 4, 8))
    with pytest.raises(ConfigError) as e:
        check_degree(SMALL, 2)              # FP8: 128 / 2 = 64 inter rows would split a block
    assert "shared expert rows (moe_inter_dim / world) = 64 is not a multiple of 128" in str(e.value)
    assert "Use tp = 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_degree(TP_CFG, 8)
    assert "n_heads = 4 is not a multiple of 8" in str(e.value) and "Use tp = 1 or 2" in str(e.value)
    with pytest.raises(ConfigError, match="tp = 3; allowed: 1, 2, 4, 8"):
        RuntimeConfig(tp=3)
    with pytest.raises(ConfigError, match="a tensor-parallel rank runs on one device"):
        RuntimeConfig(tp=2, devices=("cpu", "cpu"))
    with pytest.raises(ConfigError, match="needs this rank's communicator"):
        Transformer(TP_CFG, RuntimeConfig(max_seq_len=64, tp=2))


def test_a_rank_shapes_on_the_meta_device():
    m = Transformer(TP_CFG, RuntimeConfig(max_seq_len=64, devices=("meta",), tp=2, mtp=True))
    a, f = m.layers[1].attn, m.layers[1].ffn
    assert m.head.shape == (1024, TP_CFG.dim) and m.embed.shape == (2047, TP_CFG.dim)
    assert (a.n_heads, a.n_groups, tuple(a.wq_b.weight.shape)) == (2, 1, (256, TP_CFG.q_lora_rank))
    assert f.experts.w2.shape == (TP_CFG.n_routed_experts, TP_CFG.dim, 64)   # FP4: 2 a byte
    assert tuple(a.wkv.weight.shape) == (TP_CFG.head_dim, TP_CFG.dim)        # replicated
    parts = m.parts()
    assert parts["layers.1.attn.wq_b.weight"] == Part(0, 0, 256)
    assert parts["mtp.0.ffn.shared_experts.w2.scale"] == Part(1, 0, 1)   # the MTP block: alike
    assert "mtp.0.e_proj.weight" not in parts and "embed.weight" not in parts
    assert set(parts) <= set(m.tensors())


def test_parts_of_the_stored_formats():
    assert weight_parts("fp8", 1, 128, 256) == (Part(1, 128, 256), Part(1, 1, 2))
    assert weight_parts("fp4", 0, 64, 96) == (Part(0, 64, 96), Part(0, 64, 96))
    assert weight_parts("fp4", 1, 128, 256) == (Part(1, 64, 128), Part(1, 4, 8))
    assert weight_parts("bf16", 1, 3, 5) == (Part(1, 3, 5), None)
    with pytest.raises(ValueError, match=r"elements \[64, 128\) of dim 0 split its blocks of 128"):
        weight_parts("fp8", 0, 64, 128)
    t = torch.arange(12.).view(3, 4)
    assert torch.equal(Part(0, 2, 4).take(t), torch.tensor([[8., 9, 10, 11], [0, 0, 0, 0]]))
    assert torch.equal(Part(1, 1, 3).take(t), t[:, 1:3])


def test_a_part_that_does_not_fit_is_refused(ckpts):
    with open_checkpoint(ckpts["fp8"]) as ck:
        dst = torch.empty(1024, TP_CFG.dim, dtype=torch.bfloat16)
        got = ck.load_into("head.weight", dst, part=Part(0, 1024, 2048))
        assert torch.equal(got[-1], torch.zeros(TP_CFG.dim, dtype=torch.bfloat16))
        assert torch.equal(got[:-1], ck.get("head.weight")[1024:])
        with pytest.raises(TensorMismatchError) as e:
            ck.load_into("head.weight", torch.empty(512, TP_CFG.dim, dtype=torch.bfloat16),
                         part=Part(0, 0, 1024))
        assert "allocate the destination with shape [1024, 128]" in str(e.value)
        with pytest.raises(TensorMismatchError, match="another config or tensor-parallel degree"):
            ck.load_into("norm.weight", torch.empty(1), part=Part(0, 200, 201))
