"""The tensor-parallel model on two GPUs (one process a GPU, NCCL, memory poisoned first): on the
parity checkpoints that split over two ranks, the golden tokens forced, every rank's logits are
within the official reference's tolerance (../shared/data/parity/README.md), the same bits on
every rank, the same bits in graph mode as eager, and the same bits from a second graph Session.
GPU: `python -m pytest -m multigpu tests/dsv4/parallel/test_tp_gpu.py`."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tp_ranks
from conftest import parity_case_dir
from helpers import small_checkpoint
from dsv4.parallel import launch

CASES = [("p1-bf16-3layer", "fp32"), ("p1-bf16-3layer", "bf16"), ("p3-mtp", "fp32")]
DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def _rel_l2(logits: np.ndarray, golden: np.ndarray) -> tuple[float, float]:
    err = np.linalg.norm(logits - golden, axis=1) / np.linalg.norm(golden, axis=1)
    return float(np.median(err)), float(np.percentile(err, 95))


@pytest.mark.multigpu
@pytest.mark.parametrize("name,mode", CASES)
def test_tp2_parity_graph_and_eager(name, mode):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    d = parity_case_dir(name)
    case = json.loads((d / "case.json").read_text())
    g = np.load(d / f"golden-{mode}.npz")
    golden, forced = g["logits"], g["tokens"].tolist()
    # the group's default timeout: rank 0 may build the CUDA library first (about a minute)
    got = launch(tp_ranks.parity_rank, ["cuda:0", "cuda:1"], str(d), DTYPE[mode],
                 case["prompt_ids"], forced, deadline_s=240)
    tol = case["modes"][mode]["tolerance"]
    for r in got:
        for run in ("eager", "graph", "graph2"):
            assert r[run].shape == golden.shape, (r["rank"], run, r[run].shape)
        med, p95 = _rel_l2(r["eager"].numpy(), golden)
        assert med < tol["median"] and p95 < tol["p95"], \
            f"{name}/{mode} rank {r['rank']}: relative L2 median {med:.3g} / p95 {p95:.3g} vs {tol}"
        assert torch.equal(r["graph"], r["eager"]), f"rank {r['rank']}: graph != eager bits"
        assert torch.equal(r["graph2"], r["graph"]), f"rank {r['rank']}: a second run differs"
        assert torch.equal(r["eager"], got[0]["eager"]), f"rank {r['rank']}: not rank 0's bits"
    if mode == "fp32":     # the argmax where the reference is sure of it
        top2 = np.sort(golden, axis=1)[:, -2:]
        sure = top2[:, 1] - top2[:, 0] > 1e-3
        bad = np.nonzero(sure & (got[0]["eager"].numpy().argmax(1) != golden.argmax(1)))[0]
        assert bad.size == 0, f"argmax differs on rows {bad.tolist()}"


@pytest.mark.multigpu
def test_tp2_prefill_graphs_plan_alike_and_decode_as_eager_pieces(tmp_path):
    """Prefill chunk graphs in tensor parallel (RuntimeConfig.prefill_graphs, built by the
    Session): every rank plans the same pieces (the slowest rank's times: a rank planning by its
    own could split the prompt differently and mismatch its all-reduces), and a Session replaying
    them decodes the same ids and logits, bit for bit, as one that prefills the same pieces
    eagerly; the same bits on every rank; closing the Session lets the graphs go, and the group
    then closes (NCCL's teardown waits for graphs that captured its all-reduces: it hung on the
    fifteenth and eighteenth sessions' runs while the graphs lived)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    # the tiny-tp preset: its shard keeps the prefill kernels (the p1 parity checkpoint's shard of
    # moe_inter_dim 64 runs the routed experts' host-reading reference: capture_blocker)
    from dsv4.weights.presets import TINY_TP
    d = small_checkpoint(tmp_path, "bf16", cfg=TINY_TP)
    prompt = list(range(5, 17))
    got = launch(tp_ranks.prefill_graphs_rank, ["cuda:0", "cuda:1"], str(d), prompt, 8,
                 deadline_s=240)
    assert got[0]["plan"] == got[1]["plan"] and got[0]["replay_ms"] == got[1]["replay_ms"]
    # a tiny model: replays are faster
    assert got[0]["plan"] == [(8, True), (4, True)], (got[0]["plan"], got[0]["replay_ms"],
                                                      got[0]["eager_ms"])
    assert all(r["released"] for r in got)
    for r in got:
        w, wo = r["with"], r["without"]
        assert w["ids"] == wo["ids"] and torch.equal(w["logits"], wo["logits"]), r["rank"]
        assert w["ids"] == got[0]["with"]["ids"], r["rank"]
        assert torch.equal(w["logits"], got[0]["with"]["logits"]), r["rank"]


@pytest.mark.multigpu
def test_tp2_all_reduce_with_the_mhc_post_decodes_as_reduce_then_post(tmp_path):
    """DSV4_FUSE_POST (Options.fuse_post, on by default) on an FP8 checkpoint in bfloat16, TP2: every block
    binds it and a decode step makes its 2 all-reduces a layer through the fused launch; graph
    == eager and a second graph Session give the same bits, the same on every rank; the logits
    stay within rounding of the run without it (the post's float order is the kernel's own)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    from dsv4.weights.presets import TINY_TP
    d = small_checkpoint(tmp_path, "fp8", cfg=TINY_TP)
    prompt, forced = list(range(5, 17)), [(11 * i + 7) % 500 for i in range(8)]
    got = launch(tp_ranks.fuse_post_rank, ["cuda:0", "cuda:1"], str(d), prompt, forced,
                 deadline_s=240)
    n = TINY_TP.n_layers
    for r in got:
        on, off = r["on"], r["off"]
        assert on["bound"] == n and off["bound"] == 0, (on["bound"], off["bound"])
        assert on["fused"] == 2 * n and off["fused"] == 0, (on["fused"], off["fused"])
        for runs in (on, off):
            assert torch.equal(runs["graph"], runs["eager"]), f"rank {r['rank']}: graph != eager"
            assert torch.equal(runs["graph2"], runs["graph"]), f"rank {r['rank']}: second run"
        assert torch.equal(on["eager"], got[0]["on"]["eager"]), f"rank {r['rank']}: not rank 0's"
        med, p95 = _rel_l2(on["eager"].numpy(), off["eager"].numpy())
        assert med < 5e-2 and p95 < 1e-1, (med, p95)     # a missing sum or stream: O(1)


@pytest.mark.multigpu
def test_tp2_prefill_chunks_through_the_two_shot_give_nccls_bits(tmp_path):
    """A TP2 rank plans our two-shot for a prefill chunk's partials (dsv4.runtime.tp.
    two_shot_bytes): a float32 prompt of 300 tokens in chunks of 256 rows goes through it (and
    the one-shot for the last 44), and gives the same logits' bits and tokens as with NCCL
    forced (both sum two values once in float32), on every rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    from dsv4.weights.presets import TINY_TP
    d = small_checkpoint(tmp_path, "bf16", cfg=TINY_TP)
    prompt = [(7 * i + 3) % 2000 for i in range(300)]
    got = launch(tp_ranks.two_shot_rank, ["cuda:0", "cuda:1"], str(d), prompt, deadline_s=240)
    for r in got:
        planned, nccl = r["planned"], r["nccl"]
        key = "parallel.allreduce.twoshot"
        assert planned["table"][key].startswith("chosen"), planned["table"]
        assert not nccl["table"].get(key, "").startswith("chosen"), nccl["table"]
        assert planned["tokens"] == nccl["tokens"], r["rank"]
        assert torch.equal(planned["logits"], nccl["logits"]), f"rank {r['rank']}: bits differ"
        assert torch.equal(planned["logits"], got[0]["planned"]["logits"]), r["rank"]
