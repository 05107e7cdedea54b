"""dsv4.parallel.group on the CPU: two gloo ranks form a group (our launcher and torchrun's
environment), with multicast off; a rank that never joins ends the start-up within its timeout
with an error naming it, not a hang."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import parallel_ranks
from conftest import REPO
from dsv4.errors import DeviceError, ParallelError
from dsv4.parallel import MULTICAST_OFF, start, start_from_env
from dsv4.parallel.launch import free_port


def test_two_cpu_ranks_form_a_group_with_multicast_off():
    got = [r["describe"] for r in parallel_ranks.two_cpu_ranks()]
    assert [g["rank"] for g in got] == [0, 1]
    for g in got:
        assert g["world"] == 2 and g["device"] == "cpu" and g["backend"] == "gloo"
        assert g["ranks"] == [0, 1]
        assert g["env"] == MULTICAST_OFF


@pytest.mark.parametrize("rank, words", [
    (0, "rank 0 waited 2 s at 127.0.0.1:"),
    (1, "rank 1 could not reach rank 0 at 127.0.0.1:"),
])
def test_a_rank_that_never_joins_ends_the_start_within_the_timeout(rank, words):
    t0 = time.monotonic()
    with pytest.raises(ParallelError) as e:
        start(rank, 2, "cpu", master_port=free_port(), timeout_s=2)
    assert time.monotonic() - t0 < 15
    msg = str(e.value)
    assert words in msg and "did not start or died" in msg and "same world size" in msg
    assert not dist.is_initialized()


def test_start_from_env_without_torchrun():
    with pytest.raises(DeviceError, match=r"RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set.*"
                                          r"torchrun --nproc-per-node"):
        start_from_env(device="cpu", environ={})
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "MASTER_ADDR": "x",
           "MASTER_PORT": "1"}
    with pytest.raises(DeviceError, match="LOCAL_RANK 3 but only 2 device"):
        start_from_env(device=["cpu", "cpu"], environ=env)
    with pytest.raises(DeviceError, match="rank 5 of world size 2"):
        start_from_env(device="cpu", environ={**env, "RANK": "5"})


SCRIPT = r"""
import os, torch
from dsv4.parallel import plan_allreduce, start_from_env
g = start_from_env(device=["cpu", "cpu"], timeout_s=30)
x = torch.full((8,), float(g.rank + 1))
plan_allreduce(g)(x)
# one write: the ranks share stdout
os.write(1, f"rank {g.rank} of {g.world_size} {g.backend} {x.tolist()[0]} "
            f"{os.environ['NCCL_NVLS_ENABLE']}\n".encode())
g.close()
# close() joins gloo's threads (named gloo_tcp_loop, pt_gloo_runloop): left running, they met the
# interpreter's teardown, where gloo aborted now and then
tasks = "/proc/self/task"
left = [n for n in (open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks))
        if "gloo" in n] if os.path.isdir(tasks) else []
os.write(1, f"rank {g.rank} gloo threads left {left}\n".encode())
g.close()                             # a second call does nothing
"""


def test_torchrun_starts_two_cpu_ranks(tmp_path):
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in MULTICAST_OFF}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(script)], capture_output=True,
                       text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = sorted(l for l in r.stdout.splitlines() if l.startswith("rank"))
    assert lines == ["rank 0 gloo threads left []", "rank 0 of 2 gloo 3.0 0",
                     "rank 1 gloo threads left []", "rank 1 of 2 gloo 3.0 0"], r.stdout


def test_a_teardown_that_hangs_ends_in_an_error_that_says_why(monkeypatch):
    """NCCL's teardown waits for every CUDA graph that captured one of its collectives: close()
    waits for destroy_process_group at most min(timeout_s, 60) s and then names the likely
    cause; an error of the teardown itself is reported as the group's."""
    import torch

    from dsv4.parallel.group import TPGroup
    g = TPGroup(0, 2, torch.device("cpu"), 0.3, object())
    monkeypatch.setattr(dist, "destroy_process_group", lambda pg: time.sleep(5))
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match=r"did not tear down within 0.3 s.*CUDA graph"):
        g._destroy()
    assert time.monotonic() - t0 < 3

    def boom(pg):
        raise RuntimeError("comm error")
    monkeypatch.setattr(dist, "destroy_process_group", boom)
    with pytest.raises(ParallelError, match="destroy_process_group failed: comm error"):
        g._destroy()
