"""`dsv4 bench --parallel tp` on the CPU (two gloo ranks, the tiny-tp preset): the report's
contract, each rank reading less than one process does (its shard) and the same on every rank,
and the flags it does not take in TP mode refused before anything starts. The figures that
matter come from GPUs (BENCHMARKS.md)."""
from __future__ import annotations

import json

from dsv4.cli import bench

FAST = ["--device", "cpu,cpu", "--parallel", "tp", "--mode", "eager", "--steps", "3",
        "--warmup", "1", "--context", "40", "--json", "-"]


def test_tp_bench_on_two_cpu_ranks(capsys):
    rc = bench.main(["--preset", "tiny-tp", *FAST])
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
    rc = bench.main(["--preset", "tiny-tp", "--device", "cpu", "--mode", "eager", "--steps", "3",
                     "--warmup", "1", "--context", "40", "--json", "-"])
    one = json.loads(capsys.readouterr()[0])
    assert rc == 0
    # a rank reads its heads, its part of every expert and of the head; the rest whole
    assert one["bytes_per_token"] / 2 < a < one["bytes_per_token"]


def test_tp_bench_refuses_what_it_does_not_measure(capsys):
    assert bench.main(["--preset", "tiny", *FAST]) == 2          # 64 expert rows a rank
    assert "cannot be split over 2 ranks" in capsys.readouterr()[1]
    assert bench.main(["--preset", "tiny-tp", "--prefill", "16", *FAST]) == 2
    assert "--prefill with --parallel tp" in capsys.readouterr()[1]
    assert bench.main(["--preset", "tiny-tp", *FAST[:1], "cpu", *FAST[2:]]) == 2
    assert "at least two" in capsys.readouterr()[1]
