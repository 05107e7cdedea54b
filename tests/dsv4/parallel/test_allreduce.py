"""dsv4.parallel.allreduce on the CPU: two gloo ranks; the plan falls back to torch.distributed
(the NCCL path) and says why the others cannot serve; sums exact where the arithmetic is, into
poisoned outputs and in place, the same bits on every rank and on a second run; bad calls and an
unavailable implementation get errors that name the problem and the fix."""
from __future__ import annotations

import types

import pytest

import parallel_ranks
from dsv4.parallel import IMPLEMENTATIONS, PREFERENCE
from dsv4.parallel.allreduce import _agreed


@pytest.fixture(scope="module")
def two_ranks():
    return [r["allreduce"] for r in parallel_ranks.two_cpu_ranks()]


def test_plan_on_the_cpu_is_torch_distributed(two_ranks):
    for r in two_ranks:
        t = r["table"]
        assert t["parallel.allreduce"] == "nccl"
        assert t["parallel.group"] == "2 ranks, gloo, timeout 30 s"
        assert t["parallel.allreduce.nccl"] == "chosen: torch.distributed.all_reduce (gloo)"
        for name in ("oneshot", "symm_one_shot", "symm_two_shot"):
            assert t[f"parallel.allreduce.{name}"] == "unavailable: not a CUDA device"


def test_sums_are_exact_and_the_same_bits_everywhere(two_ranks):
    r0, r1 = two_ranks
    assert r0["exact"] and all(ok for *_, ok in r0["exact"] + r1["exact"]), r0["exact"]
    assert r0["digests"] == r1["digests"]             # every rank, every dtype and shape
    assert all(r0["repeat"]) and all(r1["repeat"])    # a second run, the same bits
    assert r0["empty"] and r1["empty"]
    assert "out (9,) torch.float32 does not match x (8,) torch.float32" in r0["mismatch"]


def test_an_unavailable_implementation_asked_for_says_why_and_what_to_do(two_ranks):
    for msg in (r["prefer_oneshot"] for r in two_ranks):
        assert "all-reduce implementation 'oneshot' is unavailable on rank" in msg
        assert "not a CUDA device" in msg and "Ask for 'nccl'" in msg


def test_the_choice_is_agreed_and_ordered():
    assert set(PREFERENCE) == set(IMPLEMENTATIONS) and PREFERENCE[-1] == "nccl"
    assert _agreed([None, None]) is None
    assert _agreed(["no GPU", "no GPU"]) == "no GPU"
    assert _agreed([None, "no peer access"]) == "rank 1: no peer access"


def test_a_failure_of_one_rank_building_the_kernel_is_agreed_and_freed():
    got = [r["agreed"] for r in parallel_ranks.two_cpu_ranks()]
    (alloc0, name0, calls0), (open0, _, calls0b) = got[0]
    (alloc1, name1, calls1), (open1, _, calls1b) = got[1]
    assert alloc0 == alloc1 == ("unavailable: rank 1: allocating the buffer: allocation failed "
                                "(out of memory)")
    assert name0 == name1 == "nccl"             # both fell back, none waits on the other
    assert calls0 == ["alloc", "free"] and calls1 == []
    assert open0 == open1 == ("unavailable: rank 0: mapping the peers' buffers: opening rank 1's "
                              "buffer (cuda:None) failed (out of memory)")
    assert calls0b == ["alloc", "free"]         # rank 0 mapped nothing, freed its own
    assert calls1b == ["alloc", "open", "close", "free"]


def test_ranks_on_several_hosts_use_nccl_alone():
    for t in (r["hosts"] for r in parallel_ranks.two_cpu_ranks()):
        assert t["parallel.allreduce"] == "nccl"
        for name in ("oneshot", "symm_one_shot", "symm_two_shot"):
            assert t[f"parallel.allreduce.{name}"] == ("unavailable: the ranks span 2 hosts (peer "
                                                       "memory is one host's)")


def test_reduce_skips_the_casts_only_where_the_kernel_sums_in_float32():
    """TensorParallel.reduce: where the all-reduce serving a bf16 partial sums the exact float32
    values in rank order and rounds once (our one-shot kernel; NCCL on two ranks, one add
    rounded once), the partial is summed in place in
    bf16, without the float32 copy and the cast back; elsewhere (NCCL, gloo: they may round on
    the way) through the float32 copy. A communicator of two ranks faked here (the other rank's
    part fixed, the kernel's arithmetic) gives the same bits both ways; float32 partials are
    summed in place either way."""
    import torch

    from dsv4.model.sharding import TensorParallel
    from dsv4.parallel.allreduce import AllReduce
    from dsv4.parallel.nccl import NcclAllReduce
    from dsv4.parallel.oneshot import OneShotAllReduce
    assert OneShotAllReduce.sums_in_float32 is True
    for world, backend, dtype, says in ((2, "nccl", torch.bfloat16, True),
                                        (2, "nccl", torch.float16, True),
                                        (4, "nccl", torch.bfloat16, False),   # rounds every hop
                                        (2, "gloo", torch.bfloat16, False),
                                        (2, "nccl", torch.int32, False)):
        group = types.SimpleNamespace(world_size=world, backend=backend)
        nccl = NcclAllReduce(group)
        assert nccl.sums_in_float32(dtype) is says, (world, backend, dtype)
        # the plan asks whoever serves the size, attribute or method alike
        plan = AllReduce(group, None, nccl, 0)
        assert plan.sums_in_float32(1 << 20, dtype) is says
    gen = torch.Generator().manual_seed(3)
    other = torch.randn(3, 64, generator=gen).to(torch.bfloat16)

    class Comm:
        def __init__(self, f32_kernel):
            self.f32_kernel, self.calls = f32_kernel, []

        def sums_in_float32(self, x):
            return self.f32_kernel

        def all_reduce(self, x):        # rank 0 (this one) then rank 1, float32, rounded once
            self.calls.append(x.dtype)
            return x.copy_((x.float() + other.float()).to(x.dtype))

    y = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    got = {}
    for f32_kernel in (True, False):
        comm = Comm(f32_kernel)
        got[f32_kernel] = TensorParallel(0, 2, comm).reduce(y.clone())
        assert comm.calls == [torch.bfloat16 if f32_kernel else torch.float32]
        assert got[f32_kernel].dtype == torch.bfloat16
    assert torch.equal(got[True], got[False])
    for f32_kernel in (True, False):
        comm, y32 = Comm(f32_kernel), torch.randn(3, 64, generator=gen)
        out = TensorParallel(0, 2, comm).reduce(y32)
        assert out is y32 and comm.calls == [torch.float32]


def test_a_rank_plans_its_all_reduce_with_the_backends_pdl_switch(monkeypatch):
    """A TP rank's all-reduce launches with PDL exactly where the rank's kernels do: the runtime
    options' switch (RuntimeConfig.options), else DSV4_PDL. A runtime a rank refuses
    (prefill_graphs) is refused before the plan allocates anything."""
    import torch

    from dsv4.backend.options import Options
    from dsv4.errors import ConfigError
    from dsv4.runtime import tp
    from dsv4.runtime.config import RuntimeConfig
    group = types.SimpleNamespace(world_size=2, device=torch.device("cpu"))

    class Planned(Exception):
        pass

    def plan(group, **kw):
        raise Planned(kw)

    monkeypatch.setattr(tp.Communicator, "plan", plan)
    seen = []
    for opts, env in ((None, None), (None, "0"), (Options(pdl=False), None),
                      (Options(pdl=True), "0")):
        if env is None:
            monkeypatch.delenv("DSV4_PDL", raising=False)
        else:
            monkeypatch.setenv("DSV4_PDL", env)
        with pytest.raises(Planned) as e:
            tp.load_rank(group, "unused", RuntimeConfig(64, options=opts))
        seen.append(e.value.args[0]["pdl"])
    assert seen == [True, False, False, True]
    with pytest.raises(ConfigError, match="prefill_graphs = 16 in tensor parallel"):
        tp.load_rank(group, "unused", RuntimeConfig(64, prefill_graphs=16))
