"""dsv4.parallel.launch on the CPU: a rank that raises, exits or stalls ends every rank within a
bounded time, and the error names the rank that failed first and how."""
from __future__ import annotations

import time

import pytest

import parallel_ranks
from dsv4.errors import ParallelError
from dsv4.parallel import launch


@pytest.mark.parametrize("how, words", [
    ("raise", "rank 1 of 2 (cpu) failed first: ValueError: boom at rank 1"),
    ("exit", "rank 1 of 2 (cpu) failed first: exited with code 7 without a result"),
])
def test_a_rank_that_fails_ends_the_run(how, words):
    t0 = time.monotonic()
    with pytest.raises(ParallelError) as e:
        launch(parallel_ranks.fail_after_start, ["cpu", "cpu"], how, timeout_s=30, grace_s=5,
               deadline_s=60)
    assert time.monotonic() - t0 < 30          # rank 0's all-reduce fails as rank 1 goes away
    msg = str(e.value)
    assert words in msg, msg
    assert "when one rank fails every rank ends" in msg
    assert e.value.first_rank == 1 and set(e.value.failures) <= {0, 1}


def test_a_stalled_rank_times_out_and_is_ended(capfd):
    t0 = time.monotonic()
    with pytest.raises(ParallelError) as e:
        launch(parallel_ranks.fail_after_start, ["cpu", "cpu"], "stall", timeout_s=3, grace_s=2,
               deadline_s=60)
    assert time.monotonic() - t0 < 30          # 3 s timeout + 2 s grace + start-up
    msg = str(e.value)
    assert ("rank 0 of 2 (cpu) failed first: ParallelError: rank 0 of 2 (cpu, gloo): "
            "all-reduce") in msg
    assert "stalled past the 3 s timeout" in msg
    assert "rank(s) 1 still running were terminated" in msg, msg
    # the terminated rank printed where it was stuck (its stack, on the stderr it inherits)
    err = capfd.readouterr().err
    assert "in fail_after_start" in err and "parallel_ranks.py" in err, err[-2000:]


def test_results_come_back_in_rank_order():
    got = parallel_ranks.two_cpu_ranks()          # launched for the group's and all-reduce's tests
    assert [r["describe"]["rank"] for r in got] == [0, 1]
    with pytest.raises(ParallelError, match="no devices given"):
        launch(parallel_ranks.describe, [])


def test_a_port_taken_before_the_ranks_bind_it_starts_them_again(monkeypatch):
    """The rendezvous port is free when chosen and bound seconds later by rank 0: when another
    process took it meanwhile (EADDRINUSE), every rank ends and all start again on another port.
    (grace_s 2, as the other tests here: rank 1, waiting for rank 0, is terminated after it; the
    default 10 s was most of this test's time.)"""
    import importlib
    import socket

    launch_mod = importlib.import_module("dsv4.parallel.launch")   # the module, not the function
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = [held.getsockname()[1]]
    real = launch_mod.free_port
    monkeypatch.setattr(launch_mod, "free_port",
                        lambda host="127.0.0.1": ports.pop() if ports else real(host))
    try:
        got = launch(parallel_ranks.describe, ["cpu", "cpu"], timeout_s=20, grace_s=2,
                     deadline_s=120)
    finally:
        held.close()
    assert [r["rank"] for r in got] == [0, 1] and not ports


def test_an_unguarded_script_is_told_to_guard_its_main(tmp_path):
    """A script that starts the ranks from its top level, with no `if __name__ == "__main__":`,
    runs again inside each rank (spawn imports the main module): the rank stops at once with an
    error that says what to change, and the run ends with exit status 1, not a hang or an
    unrelated multiprocessing assertion."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    script = tmp_path / "unguarded.py"
    script.write_text("from dsv4.parallel import launch\n\n"
                      "def fn(group):\n    return group.rank\n\n"
                      "print(launch(fn, ['cpu', 'cpu'], timeout_s=30, deadline_s=60))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    assert "Put the code that starts the run under `if __name__ == \"__main__\":`" in p.stderr
    assert "can only join a started process" not in p.stderr
