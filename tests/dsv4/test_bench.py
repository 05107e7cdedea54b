"""Benchmark harness on the CPU: DeviceWeights equals a written synthetic checkpoint, the tiny preset
end to end (eager), the byte count against a hand count, partial labelling, the memory check."""
from __future__ import annotations

import json

import pytest
import torch

from dsv4.bench import decode as bench_decode
from dsv4.bench.decode import capacity_for
from dsv4.cli import bench
from dsv4.bench import memory
from dsv4.weights.checkpoint import open_checkpoint
from dsv4.weights.device_weights import DeviceWeights
from dsv4.errors import TensorMismatchError
from dsv4.model.transformer import Transformer
from dsv4.runtime.config import RuntimeConfig
from dsv4.weights.presets import TINY, get_preset
from dsv4.weights.synthetic import write_checkpoint

SMALL = TINY.replace(vocab_size=1024)
KEYS = ("eager_ms_per_token", "graph_ms_per_token", "bytes_per_token", "floor_ms", "copy_TBps",
        "kernels_per_layer", "kernels_per_layer_method", "capture_s", "graph_bytes",
        "ratio_to_floor", "tokens_per_s", "spread_ms", "preset", "layers", "full_layers",
        "partial", "devices", "context", "steps", "gpu_name", "torch", "triton", "date",
        "command", "bytes_breakdown", "per_granularity", "runs", "extrapolated")
FAST = ["--device", "cpu", "--steps", "2", "--warmup", "1", "--context", "40", "--json", "-"]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def hand_count(cfg, L: int) -> int:
    """Bytes per token at position L, from the config alone (the floor's definition)."""
    D, H, Dh, Rq, G, Ro = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, \
        cfg.o_lora_rank
    I, E, k, hc, W, V = cfg.moe_inter_dim, cfg.n_routed_experts, cfg.n_activated_experts, \
        cfg.hc_mult, cfg.window_size, cfg.vocab_size
    ih, di, mix = cfg.index_n_heads, cfg.index_head_dim, (2 + cfg.hc_mult) * cfg.hc_mult

    def fp8(o, i):                      # e4m3 weight + 128x128 e8m0 scales
        return o * i + -(-o // 128) * -(-i // 128)

    def fp4(o, i):                      # packed e2m1 + per-32 e8m0 scales
        return o * i // 2 + o * i // 32

    def comp(r, dc):                    # wkv + wgate (bf16), ape (f32), norm (f32)
        c = 2 if r == 4 else 1
        return 2 * c * dc * D * 2 + r * c * dc * 4 + dc * 4

    total = 0
    for l in range(cfg.n_layers):
        r = cfg.compress_ratios[l]
        total += fp8(Rq, D) + fp8(H * Dh, Rq) + fp8(Dh, D) + fp8(G * Ro, H * Dh // G) + fp8(D, G * Ro)
        total += (2 * D + Rq + Dh + H) * 4                        # norms + sink, float32
        total += 2 * (mix * hc * D + mix + 3) * 4                  # mHC attn + ffn
        total += E * D * 2 + (k * 8 if l < cfg.n_hash_layers else E * 4)   # gate + ids | bias
        total += k * (2 * fp4(I, D) + fp4(D, I))                   # k routed experts
        total += 2 * fp8(I, D) + fp8(D, I)                         # shared expert
        total += comp(r, Dh) if r else 0
        total += fp8(ih * di, Rq) + ih * D * 2 + comp(4, di) if r == 4 else 0
        vis = (L + 1) // r if r else 0
        total += min(W, L + 1) * Dh * 2                            # window rows, bf16
        total += (min(cfg.index_topk, vis) * Dh * 2 + vis * di * 2) if r == 4 else vis * Dh * 2
    return total + V * D * 2 + D * 2 + D * 4 + (hc * hc * D + hc + 1) * 4


# ---- DeviceWeights ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    return open_checkpoint(write_checkpoint(SMALL, tmp_path_factory.mktemp("bench") / "ck",
                                            seed=7, shards=1))


def test_device_weights_equal_checkpoint(small_ckpt):
    names = ["layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale",           # FP8 pair
             "layers.2.ffn.experts.3.w2.scale", "layers.2.ffn.experts.3.w2.weight",  # FP4, scale first
             "layers.2.attn_norm.weight", "layers.0.ffn.gate.tid2eid", "layers.1.hc_attn_fn",
             "layers.3.attn.indexer.compressor.ape", "embed.weight"]
    dw = DeviceWeights(SMALL, seed=7)
    for n in names:
        assert torch.equal(_raw(dw.get(n)), _raw(small_ckpt.get(n))), n
    norm = torch.empty(SMALL.dim, dtype=torch.float32)          # BF16-stored, f32 destination
    dw.load_into("layers.2.attn_norm.weight", norm)
    assert torch.equal(norm, small_ckpt.get("layers.2.attn_norm.weight").float())
    # whole model: every destination equals a checkpoint load (any order, views into banks)
    a = Transformer(SMALL, RuntimeConfig(max_seq_len=256))
    b = Transformer(SMALL, RuntimeConfig(max_seq_len=256))
    a.load(small_ckpt)
    b.load(DeviceWeights(SMALL, seed=7))
    tb = b.tensors()
    for n, t in a.tensors().items():
        assert torch.equal(_raw(t), _raw(tb[n])), n


def test_device_weights_seed_and_errors():
    dw = DeviceWeights(SMALL, seed=1)
    w = dw.get("layers.0.attn.wkv.weight")
    assert torch.equal(_raw(w), _raw(DeviceWeights(SMALL, seed=1).get("layers.0.attn.wkv.weight")))
    assert not torch.equal(_raw(w), _raw(DeviceWeights(SMALL, seed=2).get("layers.0.attn.wkv.weight")))
    with pytest.raises(TensorMismatchError, match=r"layers.0.attn.wkv.weight.*\[128, 128\]"):
        dw.load_into("layers.0.attn.wkv.weight", torch.empty(64, 128, dtype=torch.float8_e4m3fn))
    with pytest.raises(TensorMismatchError, match="not a tensor of this config"):
        dw.load_into("layers.9.attn.wkv.weight", torch.empty(1))


# ---- the benchmark ----------------------------------------------------------------------------

def _run(capsys, *args) -> dict:
    rc = bench.main(["--preset", "tiny", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "dsv4 bench: tiny" in err            # the table goes to stderr with --json -
    return json.loads(out)                      # exactly one JSON object on stdout


def test_tiny_eager_end_to_end(capsys):
    rep = _run(capsys, *FAST)
    assert all(k in rep for k in KEYS), [k for k in KEYS if k not in rep]
    assert rep["eager_ms_per_token"] > 0 and rep["tokens_per_s"]["eager"] > 0
    lo, hi = rep["spread_ms"]["eager"]
    assert lo <= rep["eager_ms_per_token"] <= hi
    for k in ("graph_ms_per_token", "floor_ms", "copy_TBps", "capture_s", "graph_bytes",
              "gpu_name", "per_granularity", "extrapolated"):
        assert rep[k] is None, k
    assert rep["kernels_per_layer"] == {"eager": None, "graph": None}
    assert rep["ratio_to_floor"] == {"eager": None, "graph": None}
    assert rep["partial"] is False and rep["layers"] == rep["full_layers"] == 4
    assert rep["bytes_per_token"] == hand_count(TINY, 40) == sum(rep["bytes_breakdown"].values())
    assert rep["capacity"] == 256 and rep["valid"] is False
    assert rep["command"].startswith("python scripts/bench.py --preset tiny")
    assert [r["mode"] for r in rep["runs"]] == ["eager"]


def test_partial_layers_labelled_and_extrapolated(capsys):
    rep = _run(capsys, "--layers", "2", "--mode", "eager", *FAST)
    assert rep["partial"] is True and rep["layers"] == 2 and rep["full_layers"] == 4
    assert rep["bytes_per_token"] == hand_count(get_preset("tiny", 2), 40)
    ext, r = rep["extrapolated"], rep["runs"][0]
    assert ext["layers"] == 4 and ext["bytes_per_token"] == hand_count(TINY, 40)
    assert ext["eager_ms_per_token"] == pytest.approx(r["per_layer_ms"] * 4 + r["head_embed_ms"])
    assert r["per_layer_ms"] == pytest.approx((r["ms_per_token"] - r["head_embed_ms"]) / 2)


def test_memory_check_names_device_and_fixes(capsys, monkeypatch):
    meta = Transformer(TINY, RuntimeConfig(max_seq_len=256, devices=("meta",)))
    _, est = memory.memory_estimate(memory.layer_sizes(meta), 2, [torch.device("cpu")], 0)
    monkeypatch.setattr(memory, "free_memory", lambda d: est["cpu"]["total"] + 1)
    rc = bench.main(["--preset", "tiny", "--reserve-gib", "0", *FAST])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    for part in ("cpu needs an estimated", "GiB host memory available", "--layers 2 (the most that fit here)",
                 "more devices (--device", "smaller --context", "--reserve-gib 0"):
        assert part in err, part


def test_bad_arguments_exit_2(capsys):
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--mode", "graph"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--layers", "9"]) == 2
    assert "layers = 9" in capsys.readouterr().err
    assert bench.main(["--preset", "nope"]) == 2
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--layer-rows", "0"]) == 2
    assert "--layer-rows 0: must be >= 1" in capsys.readouterr().err
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--layer-rows", "2"]) == 2
    assert "add --layer-kernels" in capsys.readouterr().err


def test_capacity():
    assert capacity_for(40, 2, 1) == 256
    assert capacity_for(4096, 100, 10) == 4352          # 4207 rounded up to 256
    assert capacity_for(65536, 100, 10) % 256 == 0


def test_prefill_bench_on_cpu(capsys):
    """--prefill: per length TTFT, tok/s, FLOPs and touched bytes (floors need CUDA); the touched
    bytes lie between the weights without the routed experts and all of them."""
    rep = _run(capsys, "--prefill", "16,48", "--prefill-reps", "1", "--no-decode", *FAST)
    assert rep["runs"] == [] and rep["prefill_kernels"] == "on"
    assert [r["tokens"] for r in rep["prefill_runs"]] == [16, 48]
    meta = Transformer(TINY, RuntimeConfig(max_seq_len=256, devices=("meta",)))
    allw = sum(t.numel() * t.element_size() for t in meta.tensors().values()) \
        - meta.embed.numel() * meta.embed.element_size()
    noexp = allw - sum(t.numel() * t.element_size() for n, t in meta.tensors().items()
                       if ".experts." in n)
    for r in rep["prefill_runs"]:
        assert r["ttft_ms"] > 0 and r["tok_per_s"] > 0 and r["compute_floor_ms"] is None
        # the host's issue (no sync on the CPU: the whole prefill) and this thread's CPU in it
        assert 0 < r["host_issue_ms"] <= r["ttft_ms"] and 0 <= r["host_cpu_ms"]
        assert r["host_switches"] is None or r["host_switches"] >= 0
        assert all(0 < h <= TINY.n_routed_experts for h in r["experts_hit"])
        assert noexp < r["bytes"] <= allw
    a, b = rep["prefill_runs"]
    assert b["flops"] > 2 * a["flops"] and a["bytes"] <= b["bytes"]
    # one layer by hand: 2 x weights per token + window attention (+ the head once)
    one = get_preset("tiny", 1)
    m1 = Transformer(one, RuntimeConfig(max_seq_len=256, devices=("meta",)))
    from dsv4.bench.prefill import prefill_flops
    D, I, k, H, Dh = one.dim, one.moe_inter_dim, one.n_activated_experts, one.n_heads, one.head_dim
    w = (one.q_lora_rank * D + H * Dh * one.q_lora_rank + Dh * D + one.o_groups * one.o_lora_rank
         * H * Dh // one.o_groups + D * one.o_groups * one.o_lora_rank + one.n_routed_experts * D
         + 3 * I * D * (k + 1) + 2 * one.mix_hc * one.hc_mult * D)
    att = sum(min(p + 1, one.window_size) for p in range(10))
    assert prefill_flops(m1, 10) == 2 * w * 10 + 4 * H * Dh * att + 2 * one.vocab_size * D
    rep = _run(capsys, "--prefill", "8", "--prefill-reps", "1", "--prefill-kernels", "off", *FAST)
    assert rep["prefill_kernels"] == "off" and rep["eager_ms_per_token"] > 0
    import os
    assert "DSV4_PREFILL_KERNELS" not in os.environ
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--prefill", "0"]) == 2


def test_speculative_bench_on_cpu(capsys, monkeypatch):
    """--speculative: verify passes T = 1..4, the step, and end-to-end rates whose measured
    acceptance follows the oracle's rate a (tokens per step = 1 + acceptance), with the tokens
    of plain decoding. The oracle's rates: 0, 1 and one between (the bench's other four rates
    run the same loop; each rate is two 40-token runs, ~3 s each on a CPU)."""
    from dsv4.bench import speculative as bench_spec
    assert {0.0, 0.5, 1.0} <= set(bench_spec.ACCEPTANCE)
    monkeypatch.setattr(bench_spec, "ACCEPTANCE", (0.0, 0.5, 1.0))
    rep = _run(capsys, "--speculative", "--layers", "2", "--spec-tokens", "40", *FAST)
    assert set(rep["spec_verify_ms"]) == {"1", "2", "3", "4"}     # JSON keys
    assert all(v > 0 for v in rep["spec_verify_ms"].values()) and rep["spec_step_ms"] > 0
    assert rep["spec_plain_follow_ms"] > 0 and rep["spec_new_tokens"] == 40
    # the step's device work (segments back to back) and the host's turn-around split the step
    assert rep["spec_step_device_ms"] > 0
    assert rep["spec_host_ms"] == pytest.approx(rep["spec_step_ms"] - rep["spec_step_device_ms"])
    assert rep["spec_same_tokens"] is True
    e2e = {r["a"]: r for r in rep["spec_e2e"]}
    assert set(e2e) == {0.0, 0.5, 1.0}
    # every step drafts but the last (one token wanted: a plain step)
    assert e2e[0.0]["acceptance_rate"] == 0 and e2e[0.0]["tokens_per_step"] == 1
    assert e2e[0.0]["speculative_steps"] == e2e[0.0]["steps"] - 1
    assert e2e[1.0]["acceptance_rate"] == 1
    for r in e2e.values():
        assert r["tokens_per_step"] == pytest.approx(1 + r["acceptance_rate"], abs=0.06)
    policy = {r["a"]: r for r in rep["spec_e2e_default"]}   # drafts that fail: plain steps
    assert policy[0.0]["speculative_steps"] < policy[0.0]["steps"] // 2
    assert policy[1.0]["speculative_steps"] == policy[1.0]["steps"] - 1


@pytest.mark.cuda
def test_prefill_profile_cuda(capsys):
    """--prefill-profile: the kernel table, the host ops, and the unprofiled host issue time vs
    the device's span over the same prefill."""
    rep = _run(capsys, "--device", "cuda:0", "--prefill", "32", "--prefill-reps", "1",
               "--prefill-profile", "--no-decode", "--no-kernels", "--json", "-")
    pr = rep["prefill_runs"][0]["profile"]
    assert pr["kernels"] > 0 and pr["device_ms"] > 0 and pr["top"] and pr["host_top"]
    assert pr["host_issue_ms"] > 0 and pr["device_span_ms"] > 0
    assert sum(c for _, c, _ in pr["top"]) <= pr["kernels"]
    assert sum(c for _, c, _ in pr["table"]) == pr["kernels"] and pr["top"] == pr["table"][:25]


@pytest.mark.cuda
def test_prefill_graphs_bench_cuda(capsys):
    """--prefill-graphs: beside the plan's TTFT, the same prompt as eager chunks only and as
    chunk graphs only (whatever the build measured), each column in the table."""
    rep = _run(capsys, "--device", "cuda:0", "--prefill", "24", "--prefill-reps", "2",
               "--prefill-graphs", "16", "--no-decode", "--no-kernels", "--json", "-")
    (r,) = rep["prefill_runs"]
    assert r["eager_ttft_ms"] > 0 and r["replay_ttft_ms"] > 0 and r["ttft_ms"] > 0
    pg = rep["prefill_graphs"]
    assert pg["max_rows"] == 16 and set(pg["built_replay_ms"]) >= {"1", "8", "16"}
    from dsv4.bench.prefill import format_rows
    head, row = format_rows(rep)[1:3]
    assert head.endswith("eager ms  replay ms"), head
    assert row.split()[-2:] == [f"{r['eager_ttft_ms']:.1f}", f"{r['replay_ttft_ms']:.1f}"], row


@pytest.mark.cuda
def test_layer_kernels_on_the_last_device_cuda(capsys):
    """--layer-kernels on a device other than the current one (cuda:1 of two: each op alone was
    launched from cuda:0 and Triton refused its pointers): every op of each kind's first layer
    timed, the layer whole, the sum; on one GPU this is cuda:0."""
    dev = f"cuda:{torch.cuda.device_count() - 1}"
    rep = _run(capsys, "--device", dev, "--mode", "graph", "--steps", "3", "--warmup", "1",
               "--context", "40", "--no-kernels", "--layer-kernels", "--json", "-")
    lks = rep["layer_kernels"]
    assert lks and all(lk["ops"] and lk["layer_us"] > 0 for lk in lks)
    assert all(r["us"] > 0 for lk in lks for r in lk["ops"])


@pytest.mark.cuda
def test_graph_step_timeline_cuda(capsys):
    """A profiled graph step's timeline (dsv4.bench.timeline): its span split into weights
    streaming and not, the idle part held by named kernels."""
    rep = _run(capsys, "--device", "cuda:0", "--mode", "graph", "--granularity", "device",
               "--steps", "5", "--warmup", "2", "--context", "40", "--json", "-")
    tl = rep["runs"][0]["timeline"]
    assert tl["span_us"] > 0 and tl["streaming_us"] > 0 and tl["idle_us"] > 0
    assert tl["streaming_us"] + tl["idle_us"] == pytest.approx(tl["span_us"], rel=1e-6)
    assert tl["idle_under"] and all(us > 0 for _, us in tl["idle_under"])
    assert tl["layers"] == rep["layers"]


def test_cpu_memory_check_counts_dequantized_copies(capsys, monkeypatch):
    """A CPU run keeps dequantized weights (and dequantizing a Flash expert bank needs tens of GB
    of temporaries): the check counts both and refuses before generating anything."""
    meta = Transformer(get_preset("flash"), RuntimeConfig(max_seq_len=4352, devices=("meta",)))
    sizes = memory.layer_sizes(meta)
    _, cpu = memory.memory_estimate(sizes, 1, [torch.device("cpu")], 0)
    _, gpu = memory.memory_estimate(sizes, 1, [torch.device("cuda:0")], 0)
    bank = 256 * 2048 * 4096                                      # one Flash expert matrix
    assert cpu["cpu"]["dense"] >= 3 * bank * 2 and gpu["cuda:0"]["dense"] == 0
    assert cpu["cpu"]["reserve"] >= bank * memory.DEQUANT_FP4 > gpu["cuda:0"]["reserve"]
    monkeypatch.setattr(memory, "free_memory", lambda d: 24 * 2**30)   # the 24 GB machine
    generated = []
    monkeypatch.setattr(bench_decode, "DeviceWeights", lambda *a: generated.append(a))
    rc = bench.main(["--preset", "flash", "--device", "cpu", "--layers", "1", "--steps", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and not generated, err
    for part in ("cpu needs an estimated", "dequantized copies", "host memory available",
                 "not even one layer fits"):
        assert part in err, (part, err)


def test_bytes_a_tensor_parallel_rank_reads():
    """Each rank of a TP run reads its shard of the split weights (attention's wq_b / wo_a /
    wo_b, every expert's and the shared expert's inter slice, the head's vocabulary rows) and
    the replicated rest whole: the byte floor per rank, from the shapes (printed with -s for
    BENCHMARKS.md: full Flash at context 4,096, the H200's measured copy bandwidth 4.25 TB/s;
    scripts/tp_bytes.py prints any preset's)."""
    flash = get_preset("flash")
    rows = memory.tp_floor_table(flash, (1, 2, 4), 4096, copy_tb_s=4.25)
    one = memory.token_bytes(Transformer(flash, RuntimeConfig(4097, devices=("meta",))), 4096)
    assert rows[0]["by_component"] == one and rows[0]["bytes_per_rank"] == sum(one.values())
    for r in rows[1:]:
        b, tp = r["by_component"], r["tp"]
        for k in ("routed_experts", "shared_expert", "head"):             # split whole
            assert b[k] * tp == one[k], k
        for k in ("compressor", "indexer", "mhc", "router", "norms", "embed_row", "kv_window",
                  "kv_compressed", "index_cache"):                      # replicated
            assert b[k] == one[k] or (k == "norms" and b[k] < one[k]), k   # attn_sink is split
        assert one["attention"] / tp < b["attention"] < one["attention"]  # wq_a, wkv replicated
    assert rows[1]["replicated"] == rows[2]["replicated"]       # R + S / tp, the same R
    for r in rows:
        print(f"flash tp={r['tp']}: {r['bytes_per_rank'] / 1e9:.3f} GB a rank a token "
              f"(replicated {r['replicated'] / 1e9:.3f} GB), floor {r['floor_ms']:.3f} ms at "
              f"4.25 TB/s")


def test_layer_kernels_byte_count_of_cache_views():
    """--layer-kernels' bytes of an op: the compressor's output, a view of the KV cache past the
    window, is one row written, not read (the whole 266 MB cache was counted at a 1M context);
    the attention reads its attended rows, the index scores the visible index rows, an expert
    bank's op k / E of it a row."""
    from types import SimpleNamespace as NS

    from dsv4.bench.layer_kernels import op_bytes
    kv = torch.zeros(16 + 64, 8, dtype=torch.bfloat16)      # a window of 16, 64 compressed rows
    ix = torch.zeros(65, 4, dtype=torch.bfloat16)           # the index cache (+ a scratch row)
    w = [torch.zeros(8, 4, 4) for _ in range(3)]
    bank = NS(w1=w[0], w1_scale=None, w2=w[1], w2_scale=None, w3=w[2], w3_scale=None,
              n_experts=8)
    blk = NS(cfg=NS(n_activated_experts=2, window_size=16, index_topk=8),
             ffn=NS(experts=bank, tid2eid=None), ratio=4)
    st = NS(kv_cache=kv, index_cache=ix)
    ctx, x = 200, torch.zeros(1, 32)                         # 50 visible entries, 8 attended
    assert op_bytes("compressor_decode", (x, kv[16:]), {}, blk, st, ctx) == 32 * 4
    assert op_bytes("sparse_attention_decode", (kv,), {}, blk, st, ctx) == (16 + 8) * 8 * 2
    assert op_bytes("index_scores", (ix[:-1],), {}, blk, st, ctx) == 50 * 4 * 2
    assert op_bytes("fp4_experts_up", (x, w[0]), {}, blk, st, ctx) == 32 * 4 + 8 * 16 * 4 * 2 // 8
    # a verify step's rows: each row's experts (distinct), at most the whole bank
    assert op_bytes("fp4_experts_up", (x, w[0]), {}, blk, st, ctx, rows=3) == \
        32 * 4 + 8 * 16 * 4 * 6 // 8
    assert op_bytes("fp4_experts_up", (x, w[0]), {}, blk, st, ctx, rows=5) == 32 * 4 + 8 * 16 * 4
