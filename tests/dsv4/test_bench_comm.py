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


def test_large_sizes_are_timed_through_the_two_shot_plan_and_nccl():
    """Up to 64 KB the two-shot has nothing to serve (the one-shot does); above, a plan with
    large_bytes; the small-message implementations keep their 4 MB limit (NCCL above)."""
    assert "the two-shot serves messages above 64 KB" in comm.plan_args("twoshot", 64 << 10)
    assert comm.plan_args("twoshot", 32 << 20) == {"large_bytes": 32 << 20}
    assert comm.plan_args("oneshot", 32 << 20) == {"max_bytes": 4 << 20, "prefer": "oneshot"}
    assert comm.plan_args("oneshot", 8 << 10) == {"max_bytes": 8 << 10, "prefer": "oneshot"}
    assert comm.plan_args("nccl_f32", 32 << 20) == {"prefer": "nccl"}
    rows = [{"impl": "twoshot", "kb": 32768, "served_by": "twoshot", "eager_us": 150.0,
             "graph_us": 140.0, "check": "exact, same bits on 2 ranks and twice"}]
    assert comm.format_table(rows, "t").splitlines()[2].split()[:4] == ["twoshot", "32768",
                                                                       "150.00", "140.00"]


def test_nccl_f32_all_reduces_a_float32_copy_and_casts_back():
    import torch
    seen = []

    def ar(y):                          # two ranks holding the same values
        seen.append(y.dtype)
        return y.mul_(2)
    x = torch.tensor([1.0, 3.0, 1.0 + 2 ** -7], dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    f32 = comm.Float32Copy(ar)
    f32(x, out)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    assert out.tolist() == [2.0, 6.0, 2.0 + 2 ** -6] and f32.impl_for(6, x.dtype).name == "nccl_f32"


def test_large_arguments_are_checked_before_any_gpu_work(capsys):
    assert comm.main(["--device", "cuda:0,cuda:1", "--sizes", "1024,131072"]) == 2
    assert "131072 KB is past the largest message the two-shot takes (65536 KB)" in \
        capsys.readouterr().err
    comm.main(["--device", "cuda:0,cuda:1", "--sizes", "1024", "--impls", "twoshot,nccl_f32"])
    assert "unknown" not in capsys.readouterr().err     # known: the next check is the GPUs'
