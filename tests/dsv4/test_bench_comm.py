"""dsv4.bench.comm on the CPU: its table (a failed check shows, a skipped implementation says why)
and its argument errors (exit 2, one line). The measurement itself needs two GPUs
(scripts/bench_comm.py on the GPU hosts)."""
from __future__ import annotations

import pytest

from dsv4.bench import comm


def _rank_rows(digest="d0", exact=True, repeat=True, us=10.0):
    return {"default": {"parallel.allreduce": "oneshot up to 64 KB, nccl above"}, "rows": [
        {"impl": "oneshot", "kb": 8, "served_by": "oneshot", "exact": exact, "repeat": repeat,
         "digest": digest, "eager_us": us, "graph_us": us / 4},
        {"impl": "symm_two_shot", "skip": "all-reduce implementation 'symm_two_shot' is "
                                          "unavailable on rank 0: world size 3"},
    ]}


def test_merge_takes_the_slowest_rank_and_every_check():
    rows = comm.merge([_rank_rows(us=10.0), _rank_rows(us=12.0)])
    assert rows[0]["eager_us"] == 12.0 and rows[0]["graph_us"] == 3.0
    assert rows[0]["check"] == "exact, same bits on 2 ranks and twice"
    assert rows[1]["skip"].endswith("world size 3")
    bad = comm.merge([_rank_rows(), _rank_rows(digest="d1", exact=False, repeat=False)])[0]
    assert bad["check"] == ("FAIL: not the exact sum on rank(s) 1; different bits on different "
                            "ranks; different bits on a second run")
    table = comm.format_table(rows, "title").splitlines()
    assert table[0] == "title" and table[2].split()[:4] == ["oneshot", "8", "12.00", "3.00"]
    assert "skipped: all-reduce implementation 'symm_two_shot' is unavailable" in table[3]


@pytest.mark.parametrize("argv, words", [
    (["--device", "cuda:0"], "expected two or more GPUs"),
    (["--device", "cuda:0,cuda:1", "--impls", "fast"], "--impls: unknown fast"),
    (["--device", "cuda:0,cuda:1", "--sizes", "8,x"], "--sizes '8,x': expected comma-separated"),
])
def test_bad_arguments_exit_2_with_one_line(argv, words, capsys):
    assert comm.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
