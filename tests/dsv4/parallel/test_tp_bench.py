"""`dsv4 bench --parallel tp` on the CPU (two gloo ranks, the tiny-tp preset): the report's
contract, each rank reading less than one process does (its shard) and the same on every rank,
and the flags it does not take in TP mode refused before anything starts. The figures that
matter come from GPUs (BENCHMARKS.md)."""
from __future__ import annotations

import json

import pytest

from dsv4.cli import bench

FAST = ["--device", "cpu,cpu", "--parallel", "tp", "--mode", "eager", "--steps", "3",
        "--warmup", "1", "--context", "40", "--json", "-"]


def test_tp_bench_on_two_cpu_ranks(capsys, tmp_path):
    rc = bench.main(["--preset", "tiny-tp", "--prefill", "20,9", "--prefill-reps", "1",
                     "--prefill-profile", "--trace", str(tmp_path / "t"), *FAST])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "tensor parallel over 2: cpu,cpu" in err
    rep = json.loads(out)
    assert rep["parallel"] == "tp" and rep["world"] == 2 and rep["devices"] == ["cpu", "cpu"]
    assert rep["eager_ms_per_token"] > 0 and rep["graph_ms_per_token"] is None
    assert [r["mode"] for r in rep["runs"]] == ["eager"] and rep["valid"] is False
    r = rep["runs"][0]
    assert r["head_embed_ms"] > 0 and r["per_layer_ms"] > 0 and len(rep["ms_per_token_per_rank"]) == 2
    a, b = rep["bytes_per_token_per_rank"]
    assert a == b                                   # the same shard sizes on both ranks
    # --prefill: each length's time to first token, every rank prefilling the same prompt
    assert [p["tokens"] for p in rep["prefill_runs"]] == [20, 9]
    for p in rep["prefill_runs"]:
        assert p["ttft_ms"] > 0 and len(p["ttft_ms_per_rank"]) == 2
        assert p["ttft_ms"] == p["ttft_ms_per_rank"][0]
    assert "prefill 20 tokens: TTFT" in err
    # each rank's host issue of those prefills: wall, its thread's CPU, involuntary switches
    for p in rep["prefill_runs"]:
        assert len(p["host_per_rank"]) == 2
        for h in p["host_per_rank"]:
            assert 0 < h["host_issue_ms"] <= p["ttft_ms"] * 1.5 and h["host_cpu_ms"] >= 0
            assert h["host_switches"] is None or h["host_switches"] >= 0
    assert err.count("host issue of the plan's prefills") == 2
    # --prefill-profile is a CUDA profile: on the CPU a note says it was not taken
    assert all("profile" not in p for p in rep["prefill_runs"])
    assert "--prefill-profile: a CUDA profile; not taken on the CPU" in rep["notes"]
    # the all-reduces' latency is measured in a CUDA graph only
    assert rep["allreduce_us"] is None and rep["allreduces_per_layer"] == 2
    assert "communication a layer: -" in err
    # --trace profiles a CUDA graph step: on the CPU no step, no trace, no all-reduce comparison
    assert r["allreduce_skew"] is None and "all-reduce across ranks" not in err
    assert not list(tmp_path.iterdir())
    rc = bench.main(["--preset", "tiny-tp", "--device", "cpu", "--mode", "eager", "--steps", "3",
                     "--warmup", "1", "--context", "40", "--json", "-"])
    one = json.loads(capsys.readouterr()[0])
    assert rc == 0
    # a rank reads its heads, its part of every expert and of the head; the rest whole
    assert one["bytes_per_token"] / 2 < a < one["bytes_per_token"]


def test_tp_bench_speculative_on_two_cpu_ranks(capfd):
    """--speculative in TP: every rank builds its MTP block and runs the same verify passes and
    sessions (the oracle's drafts keyed by position: the same on every rank); the report has
    rank 0's figures, every rank's verify times, and the tokens of plain decoding on every
    rank. The preset's first two layers (the hash layer, ratio 4 with the indexer: the one-process
    speculative bench's depth; all four in test_tp_bench_on_two_cpu_ranks)."""
    rc = bench.main(["--preset", "tiny-tp", "--layers", "2", "--speculative", "--spec-tokens",
                     "8", *FAST])
    out, err = capfd.readouterr()          # the ranks log from their own processes
    assert rc == 0, err
    rep = json.loads(out)
    assert set(rep["spec_verify_ms"]) == {"1", "2", "3", "4"}
    assert len(rep["spec_verify_ms_per_rank"]) == 2 and rep["spec_step_ms"] > 0
    assert rep["spec_same_tokens"] is True and rep["spec_new_tokens"] == 8
    e2e = {r["a"]: r for r in rep["spec_e2e"]}
    assert e2e[0.0]["acceptance_rate"] == 0 and e2e[1.0]["acceptance_rate"] == 1
    assert err.count("] verify T=2:") == 1          # rank 0 logs alone


def test_tp_bench_refuses_what_it_does_not_measure(capsys):
    assert bench.main(["--preset", "tiny", *FAST]) == 2          # 64 expert rows a rank
    assert "cannot be split over 2 ranks" in capsys.readouterr()[1]
    assert bench.main(["--preset", "tiny-tp", "--prefill", "16", "--prefill-graphs", "1",
                       *FAST]) == 2
    assert "--prefill-graphs 1: chunk graphs are CUDA graphs, the ranks are on cpu,cpu" in \
        capsys.readouterr()[1]
    assert bench.main(["--preset", "tiny-tp", "--prefill", "2000000", *FAST]) == 2
    assert "above the model's 1048576 positions" in capsys.readouterr()[1]
    assert bench.main(["--preset", "tiny-tp", *FAST[:1], "cpu", *FAST[2:]]) == 2
    assert "at least two" in capsys.readouterr()[1]
    assert bench.main(["--preset", "tiny-tp", "--layer-kernels", *FAST]) == 2
    assert "--layer-kernels needs CUDA devices" in capsys.readouterr()[1]


def test_kernel_cases_of_a_rank_have_its_shard_shapes(monkeypatch):
    """bench_kernels --tp N: the split weights' cases take a rank's shapes (its heads' wq_b / wo_a
    / wo_b and attention, 1 / N of the shared and routed inter dim, its vocabulary rows of the
    head), the replicated ones stay whole; --contexts sets the attention case's entries; a degree
    the model cannot split is refused."""
    import torch

    from dsv4.bench import kernels
    from dsv4.bench.kernels import build_cases
    from dsv4.errors import ConfigError
    monkeypatch.setattr(kernels, "n_copies", lambda nbytes: 1)   # shapes only: no L2-sized copies
    from dsv4.weights.presets import get_preset
    cfg = get_preset("tiny-tp")
    names = ["wq_a+wkv", "wq_b", "wo_a", "wo_b", "shared.w1+w3", "shared.w2", "head",
             "experts.up", "attention.r128"]
    for tp in (1, 2, 4):
        got = {c.name: c.shape for c in build_cases("tiny-tp", torch.device("cpu"), names, tp=tp,
                                                    contexts=(1024,))}
        H, G, I = cfg.n_heads // tp, cfg.o_groups // tp, cfg.moe_inter_dim // tp
        assert got["wq_a+wkv"] == f"[{cfg.q_lora_rank + cfg.head_dim}, {cfg.dim}]"
        assert got["wq_b"] == f"[{H * cfg.head_dim}, {cfg.q_lora_rank}]"
        assert got["wo_a"] == (f"[{G * cfg.o_lora_rank}, {H * cfg.head_dim // G}]"
                               + (f" G={G}" if G > 1 else ""))
        assert got["wo_b"] == f"[{cfg.dim}, {G * cfg.o_lora_rank}]"
        assert got["shared.w1+w3"] == f"[{I}, {cfg.dim}] x2 (w1+w3)"
        assert got["shared.w2"] == f"[{cfg.dim}, {I}]"
        assert got["head"] == f"[{-(-cfg.vocab_size // tp)}, {cfg.dim}]"
        assert f"I={I} " in got["experts.up"]
        assert got["attention.r128"].startswith(f"ctx 1024: {H} heads, {cfg.window_size} + 8 rows")
    with pytest.raises(ConfigError):
        next(build_cases("tiny-tp", torch.device("cpu"), names, tp=8))


@pytest.mark.multigpu
def test_tp_bench_profiles_a_prefill_and_traces_every_rank(capfd, tmp_path):
    """On two GPUs, --prefill-profile: every rank profiles the same prefill (their all-reduces
    match), the report carries every rank's kernel count and device time and rank 0's top
    kernels; --trace: every rank's profiled graph step, and rank 0's timeline in the report, of
    a step the ranks started together (not one whose all-reduces waited for the other rank's
    profiler to start: that span was 461 ms a layer). The ranks log from their own processes:
    capfd, not capsys."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    rc = bench.main(["--preset", "tiny-tp", "--device", "cuda:0,cuda:1", "--parallel", "tp",
                     "--mode", "graph", "--granularity", "device", "--steps", "3", "--warmup",
                     "1", "--context", "40", "--prefill", "32", "--prefill-reps", "1",
                     "--prefill-profile", "--trace", str(tmp_path / "t"), "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    rep = json.loads(out)
    for r in (0, 1):
        assert json.loads((tmp_path / f"t-rank{r}-graph-device.json").read_text())["traceEvents"]
    run = rep["runs"][0]
    tl = run["timeline"]
    assert tl["span_us"] > 0 and tl["streaming_us"] > 0
    # the profiled step is one step: its kernels span far less than 10 timed steps
    assert tl["span_us"] < 10 * 1e3 * run["ms_per_token"], (tl, run["ms_per_token"])
    assert err.count("a layer (profiled)") == 1        # rank 0's line only
    # the ranks' all-reduce calls of that step on the host clock: two a layer and one line
    sk = run["allreduce_skew"]
    assert sk["calls"] >= 2 * rep["layers"], sk
    assert sk["skew_us"]["median"] >= 0 and sum(sk["last_to_arrive"]) + sk["ties"] == sk["calls"]
    assert err.count("graph/device: all-reduce across ranks: ") == 1
    (p,) = rep["prefill_runs"]
    assert len(p["profile_per_rank"]) == 2
    for q in p["profile_per_rank"]:
        assert q["kernels"] > 0 and q["device_ms"] > 0 and q["device_span_ms"] > 0
    assert p["profile"]["top"] and p["profile"]["kernels"] == p["profile_per_rank"][0]["kernels"]
    assert "rank 0's kernels by device time" in err
    # the profiled prefill (the ranks start it together): every rank's trace, its collective
    # calls paired (split by rows: two all-gathers and two reduce-scatters a layer), one line;
    # the events themselves are not in the report
    for r in (0, 1):
        assert json.loads((tmp_path / f"t-rank{r}-prefill32.json").read_text())["traceEvents"]
    sk = p["collective_skew"]
    assert sk["calls"] >= 4 * rep["layers"], sk
    assert sum(sk["last_to_arrive"]) + sk["ties"] == sk["calls"], sk
    assert err.count("prefill 32: collectives across ranks: ") == 1
    assert "events" not in p["profile"]


@pytest.mark.multigpu
def test_tp_bench_prefill_graphs_on_two_gpus(capfd):
    """--prefill-graphs in TP: the chunk graphs built by both ranks, the plan's TTFT beside the
    same prompt as eager chunks only and as chunk graphs only, and the plan's build-time times
    of the largest size (the slowest rank's) in the line."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    rc = bench.main(["--preset", "tiny-tp", "--device", "cuda:0,cuda:1", "--parallel", "tp",
                     "--mode", "graph", "--granularity", "device", "--steps", "3", "--warmup",
                     "1", "--context", "40", "--prefill", "24", "--prefill-reps", "2",
                     "--prefill-graphs", "16", "--no-kernels", "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    rep = json.loads(out)
    (p,) = rep["prefill_runs"]
    assert p["eager_ttft_ms"] > 0 and p["replay_ttft_ms"] > 0
    pg = rep["prefill_graphs"]
    assert pg["max_rows"] == 16
    assert pg["built_replay_ms"]["16"] > 0 and pg["built_eager_ms"]["16"] > 0
    assert f"chunk graphs only {p['replay_ttft_ms']:.1f} ms" in err
    assert f"replay {pg['built_replay_ms']['16']:.1f} / eager " in err


@pytest.mark.multigpu
def test_tp_bench_layer_kernels_on_two_gpus(capfd):
    """--layer-kernels in TP: both ranks replay each kind's first layer op by op and whole (the
    whole layer's all-reduces meet), rank 0's shard in the report and the table."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    rc = bench.main(["--preset", "tiny-tp", "--device", "cuda:0,cuda:1", "--parallel", "tp",
                     "--mode", "graph", "--granularity", "device", "--steps", "3", "--warmup",
                     "1", "--context", "40", "--no-kernels", "--layer-kernels", "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    lks = json.loads(out)["layer_kernels"]
    assert lks and all(lk["ops"] and lk["layer_us"] > 0 for lk in lks)
    assert all(r["us"] > 0 for lk in lks for r in lk["ops"])
    assert "rank 0's shard, each op alone and the layer whole:" in err


@pytest.mark.multigpu
def test_tp_bench_speculative_on_two_gpus(capfd):
    """On two GPUs, --speculative in graph mode: the verify passes and the speculative sessions
    captured and replayed on both ranks in step, the tokens of plain decoding on both."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    rc = bench.main(["--preset", "tiny-tp", "--device", "cuda:0,cuda:1", "--parallel", "tp",
                     "--mode", "graph", "--granularity", "device", "--steps", "5", "--warmup",
                     "1", "--context", "40", "--speculative", "--spec-tokens", "16",
                     "--no-kernels", "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["spec_mode"] == "graph" and rep["spec_same_tokens"] is True
    assert all(v > 0 for r in rep["spec_verify_ms_per_rank"] for v in r.values())
    assert rep["spec_verify2_over_plain"] > 0

