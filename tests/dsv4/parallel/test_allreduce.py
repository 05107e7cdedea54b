"""dsv4.parallel.allreduce on the CPU: two gloo ranks; the plan falls back to torch.distributed
(the NCCL path) and says why the others cannot serve; sums exact where the arithmetic is, into
poisoned outputs and in place, the same bits on every rank and on a second run; bad calls and an
unavailable implementation get errors that name the problem and the fix; who serves which size
(one-shot, two-shot, NCCL) and how the table says it."""
from __future__ import annotations

import types

import pytest
import torch

import parallel_ranks
from dsv4.errors import DeviceError
from dsv4.parallel import IMPLEMENTATIONS, PREFERENCE, plan_allreduce
from dsv4.parallel.allreduce import AllReduce, _agreed


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


def test_the_two_shot_asked_for_on_the_cpu_says_why_it_cannot_serve():
    for r in parallel_ranks.two_cpu_ranks():
        t, only_nccl = r["large"]["None"], r["large"]["nccl"]
        assert t["parallel.allreduce"] == "nccl"
        assert t["parallel.allreduce.twoshot"] == "unavailable: not a CUDA device"
        assert list(t).index("parallel.allreduce.twoshot") == len(t) - 2    # just before nccl
        assert only_nccl["parallel.allreduce.twoshot"] == ("not tried: 'nccl' was asked for "
                                                           "(NCCL serves every size)")
        # not asked for (large_bytes 0, the default): no row, the table of before
        assert "parallel.allreduce.twoshot" not in r["allreduce"]["table"]


@pytest.mark.parametrize("large, words", [
    (-1, "large_bytes = -1: expected 0 (off) or 65537 .. 64 MiB"),
    (64 << 10, "large_bytes = 65536: expected 0 (off) or 65537"),
    (1000, "(above max_bytes = 65536: the two-shot serves what the small-message path does not"),
    ((64 << 20) + 16, "large_bytes = 67108880: expected 0 (off) or 65537 .. 64 MiB"),
])
def test_plan_refuses_a_large_bytes_out_of_bounds(large, words):
    """Before any collective (the group is never touched): the value, the bounds, why."""
    with pytest.raises(DeviceError) as e:
        plan_allreduce(None, large_bytes=large)
    assert words in str(e.value)


def _kernel(cls, cap: int, calls: list):
    """One of our kernels' host sides as the plan sees it (name, supports(), max_bytes), without
    a buffer; check() and close() recorded in calls."""
    impl = object.__new__(cls)
    impl.cap = impl.max_bytes = cap
    impl.check = lambda: calls.append((impl.name, "check"))
    impl.close = lambda: calls.append((impl.name, "close"))
    return impl


def _planned(fast=True, large=True, calls=None) -> AllReduce:
    from dsv4.parallel.nccl import NcclAllReduce
    from dsv4.parallel.oneshot import OneShotAllReduce
    from dsv4.parallel.twoshot import TwoShotAllReduce
    calls = [] if calls is None else calls
    # gloo: NCCL's own float32-exactness (two NCCL ranks) stays out of the routing checks
    group = types.SimpleNamespace(world_size=2, backend="gloo", timeout_s=30.0)
    choice = {"oneshot": "chosen: ...", "twoshot": "chosen: ...", "nccl": "fallback: ..."}
    return AllReduce(group, _kernel(OneShotAllReduce, 64 << 10, calls) if fast else None,
                     NcclAllReduce(group), (64 << 10) if fast else 0, choice,
                     _kernel(TwoShotAllReduce, 32 << 20, calls) if large else None)


def test_impl_for_picks_the_one_shot_then_the_two_shot_then_nccl_by_size():
    ar = _planned()
    bf16, f32 = torch.bfloat16, torch.float32
    served = {n: ar.impl_for(n, bf16).name for n in (16, 8192, 64 << 10, (64 << 10) + 16,
                                                     1 << 20, 32 << 20, (32 << 20) + 16)}
    assert served == {16: "oneshot", 8192: "oneshot", 64 << 10: "oneshot",
                      (64 << 10) + 16: "twoshot", 1 << 20: "twoshot", 32 << 20: "twoshot",
                      (32 << 20) + 16: "nccl"}
    assert ar.impl_for(1 << 20, torch.float64).name == "nccl"       # a dtype neither takes
    assert ar.impl_for((1 << 20) + 8, bf16).name == "nccl"          # not a multiple of 16 bytes
    assert ar.sums_in_float32(1 << 20, bf16) and ar.sums_in_float32(4096, f32)
    assert not ar.sums_in_float32(64 << 20, bf16)
    # without the one-shot (another small path, or none), the two-shot takes what it can
    assert _planned(fast=False).impl_for(4096, bf16).name == "twoshot"
    assert _planned(large=False).impl_for(1 << 20, bf16).name == "nccl"


def test_the_table_says_who_serves_up_to_what_and_check_close_reach_both():
    assert _planned().table()["parallel.allreduce"] == ("oneshot up to 64 KB, twoshot up to "
                                                        "32 MB, nccl above")
    assert _planned(large=False).table()["parallel.allreduce"] == "oneshot up to 64 KB, nccl above"
    assert _planned(fast=False).table()["parallel.allreduce"] == "twoshot up to 32 MB, nccl above"
    assert _planned(False, False).table()["parallel.allreduce"] == "nccl"
    assert _planned().table()["parallel.allreduce.twoshot"] == "chosen: ..."
    calls = []
    ar = _planned(calls=calls)
    ar.check()
    ar.close()
    assert calls == [("oneshot", "check"), ("twoshot", "check"), ("oneshot", "close"),
                     ("twoshot", "close")]
    assert ar.fast is None and ar.large is None


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
    from dsv4.parallel.twoshot import TwoShotAllReduce
    assert OneShotAllReduce.sums_in_float32 is True and TwoShotAllReduce.sums_in_float32 is True
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


def _post_tensors(T=2, C=4, D=64, dtype=None, seed=5):
    import torch
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.bfloat16
    return (torch.randn(T, D, generator=gen).to(dtype), torch.randn(T, C, D, generator=gen).to(dtype),
            torch.rand(T, C, generator=gen), torch.rand(T, C, C, generator=gen),
            torch.empty(T, C, D, dtype=dtype))


def test_the_one_shot_takes_the_post_by_shapes_dtypes_and_addresses():
    """OneShotAllReduce.supports_post: x [T, D] within the buffer, res / out [T, 4, D] of x's
    dtype, post / comb float32 [T, 4] / [T, 4, 4], all contiguous and 16-byte aligned, out apart
    from res; float32 or bf16. What it refuses, the caller serves as before (reduce, then post)."""
    import torch

    from dsv4.parallel.oneshot import OneShotAllReduce
    impl = _kernel(OneShotAllReduce, 64 << 10, [])
    x, res, post, comb, out = _post_tensors()
    assert impl.supports_post(x, res, post, comb, out)
    assert impl.supports_post(*_post_tensors(dtype=torch.float32))
    assert not impl.supports_post(*_post_tensors(dtype=torch.float16))
    assert not impl.supports_post(*_post_tensors(C=3))                 # hc_mult 4 only
    assert not impl.supports_post(x, res, post, comb, res)             # in place over res
    assert not impl.supports_post(x, res, post.double(), comb, out)
    assert not impl.supports_post(x, res, post, comb, out.float())
    assert not impl.supports_post(x[:, 8:], res, post, comb, out)      # not contiguous / aligned
    big = _post_tensors(T=9, D=4096)                                   # 72 KB > the buffer
    assert not impl.supports_post(*big)
    assert impl.supports_post(*_post_tensors(T=8, D=4096))             # 64 KB: the buffer's size
    odd = torch.empty(2 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64)   # 2-byte offset
    assert not impl.supports_post(odd, res, post, comb, out)


def test_the_all_reduce_adds_the_post_where_its_serving_kernel_can():
    """AllReduce.post: the one-shot's fused launch where it serves the size and takes the
    tensors; otherwise False and nothing runs (NCCL above the one-shot's sizes, no one-shot)."""
    import torch
    launched = []
    ar = _planned()
    ar.group.device = torch.device("cpu")
    ar.fast.post = lambda *t: launched.append(t)
    t = _post_tensors()
    assert ar.post(*t) is True and len(launched) == 1 and launched[0][0] is t[0]
    assert ar.post(*_post_tensors(C=3)) is False                       # refused: not launched
    assert ar.post(*_post_tensors(T=9, D=4096)) is False               # the two-shot's size
    no_fast = _planned(fast=False)
    no_fast.group.device = torch.device("cpu")
    assert no_fast.post(*t) is False and len(launched) == 1


def test_reduce_post_is_the_post_of_the_reduce_where_no_kernel_fuses_them():
    """TensorParallel.reduce_post: where the communicator's all-reduce cannot add the mHC
    post (gloo, NCCL, sizes past the one-shot's), the sum over the ranks (reduce) and then the
    post, into `out` when given; where it can, its own output and nothing else runs."""
    import torch

    from dsv4.model.sharding import TensorParallel
    from dsv4.numerics.mhc import hc_post
    y, res, post, comb, _ = _post_tensors()
    other = torch.randn(y.shape).to(y.dtype)

    class Comm:
        def __init__(self, fuses):
            self.fuses, self.calls = fuses, []

        def sums_in_float32(self, x):
            return True

        def all_reduce(self, x):
            self.calls.append("all_reduce")
            return x.copy_((x.float() + other.float()).to(x.dtype))

        def all_reduce_post(self, x, res, post, comb, out):
            self.calls.append("all_reduce_post")
            if self.fuses:
                out.fill_(7)
            return self.fuses

    def post_fn(x, res, post, comb, out=None):
        return out.copy_(hc_post(x, res, post, comb))

    want = hc_post((y.float() + other.float()).to(y.dtype), res, post, comb)
    comm = Comm(False)
    got = TensorParallel(0, 2, comm).reduce_post(y.clone(), res, post, comb, post_fn)
    assert torch.equal(got, want) and comm.calls == ["all_reduce_post", "all_reduce"]
    into = torch.empty_like(res)
    assert TensorParallel(0, 2, Comm(False)).reduce_post(y.clone(), res, post, comb, post_fn,
                                                         out=into) is into
    assert torch.equal(into, want)
    comm = Comm(True)
    got = TensorParallel(0, 2, comm).reduce_post(y.clone(), res, post, comb, post_fn)
    assert comm.calls == ["all_reduce_post"] and bool((got == 7).all())


def test_a_rank_plans_its_all_reduce_with_the_backends_pdl_switch(monkeypatch):
    """A TP rank's all-reduce launches with PDL exactly where the rank's kernels do: the runtime
    options' switch (RuntimeConfig.options), else DSV4_PDL."""
    import torch

    from dsv4.backend.options import Options
    from dsv4.runtime import tp
    from dsv4.runtime.config import RuntimeConfig
    group = types.SimpleNamespace(world_size=2, device=torch.device("cpu"))

    class Planned(Exception):
        pass

    def plan(group, **kw):
        raise Planned(kw)

    monkeypatch.setattr(tp.Communicator, "plan", plan)
    closed = []
    monkeypatch.setattr(tp, "open_checkpoint", lambda path: types.SimpleNamespace(
        config=types.SimpleNamespace(dim=4096), close=lambda: closed.append(path)))
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
    assert closed == ["unused"] * 4                  # a failed load closes the checkpoint
    # a CUDA rank loads the prebuilt library the options name before its plan loads one
    from dsv4.kernels.cuda import lib as cuda_lib
    loads = []
    monkeypatch.setattr(cuda_lib, "status", lambda dev, path=None: loads.append((str(dev), path)))
    cuda = types.SimpleNamespace(world_size=2, device=torch.device("cuda", 1))
    for opts in (Options(cuda_lib="/pre/built.so"), Options()):
        with pytest.raises(Planned):
            tp.rank_communicator(cuda, RuntimeConfig(64, options=opts),
                                 types.SimpleNamespace(dim=4096))
    assert loads == [("cuda:1", "/pre/built.so")]


def test_the_two_shot_serves_a_prefill_chunk_on_two_cuda_ranks_where_asked():
    """Where asked (Options.two_shot, DSV4_TWO_SHOT=1) a rank plans the two-shot
    (plan_allreduce's large_bytes) up to its largest prefill message, [prefill_chunk, dim] in the
    activation dtype, on two CUDA ranks; by default (slower than NCCL inside a prefill), on four
    ranks (not yet run on 4 GPUs) and on gloo ranks, NCCL serves them."""
    import torch

    from dsv4.backend.options import Options
    from dsv4.parallel.allreduce import LARGE_BYTES_LIMIT
    from dsv4.runtime.config import RuntimeConfig
    from dsv4.runtime.tp import two_shot_bytes
    cfg = types.SimpleNamespace(dim=4096)
    on = Options(two_shot=True)

    def ranks(n, dev="cuda:0"):
        return types.SimpleNamespace(world_size=n, device=torch.device(dev))
    assert two_shot_bytes(ranks(2), RuntimeConfig(8192), cfg, on) == 4096 * 4096 * 2
    assert two_shot_bytes(ranks(2), RuntimeConfig(8192, prefill_chunk=512), cfg, on) == 512 * 8192
    assert two_shot_bytes(ranks(2), RuntimeConfig(8192, dtype=torch.float32), cfg, on) == 64 << 20
    assert two_shot_bytes(ranks(2), RuntimeConfig(1 << 16, prefill_chunk=16384), cfg, on) == \
        LARGE_BYTES_LIMIT                            # 128 MB of partials: NCCL above 64 MB
    assert two_shot_bytes(ranks(2), RuntimeConfig(64, prefill_chunk=8), cfg, on) == 0  # one-shot's
    assert two_shot_bytes(ranks(4), RuntimeConfig(8192), cfg, on) == 0
    assert two_shot_bytes(ranks(2, "cpu"), RuntimeConfig(8192), cfg, on) == 0
    # off by default: the options given, RuntimeConfig.options, the environment
    assert two_shot_bytes(ranks(2), RuntimeConfig(8192), cfg, Options()) == 0
    assert two_shot_bytes(ranks(2), RuntimeConfig(8192, options=on), cfg) == 4096 * 4096 * 2
    assert Options.from_env({}).two_shot is False
    assert Options.from_env({"DSV4_TWO_SHOT": "1"}).two_shot is True
