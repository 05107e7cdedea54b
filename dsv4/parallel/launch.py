"""Our own launcher of a tensor-parallel run: one process per device (multiprocessing spawn), each
joining the group (group.start) and calling fn(group, *args); the parent joins them and returns
their results, or ends every rank when one fails and raises a ParallelError naming the rank that
failed first and why. torchrun users skip this and call group.start_from_env in each process.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import ParallelError
from .group import DEFAULT_TIMEOUT_S, disable_multicast, start

# after the first failure, the other ranks get this long to end by themselves (their own errors
# then reach the report) before they are terminated
GRACE_S = 10.0
POLL_S = 0.1
EXIT_WAIT_S = 30.0          # a rank that reported its result gets this long to exit
# what ranks a failure first: a rank that died or raised its own error over one whose collective
# failed because of another rank (ParallelError from the group or a collective)
DIED, RAISED, COLLECTIVE = 0, 0, 1


@dataclass(frozen=True)
class RankFailure:
    rank: int
    device: str
    text: str               # one line: the error or how the process ended
    order: int              # DIED / RAISED / COLLECTIVE
    at: float               # time.monotonic() when the parent saw it


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for rank 0's rendezvous store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world: int, device: str, addr: str, port: int, timeout_s: float,
           conn, args) -> None:
    """A rank's process: multicast off before anything starts CUDA or NCCL, join, run, report.
    A rank terminated by the parent (past the deadline, or after another rank failed) first
    prints every thread's Python stack on stderr: where it was stuck."""
    disable_multicast()
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    try:
        group = start(rank, world, device, master_addr=addr, master_port=port, timeout_s=timeout_s)
        result = fn(group, *args)
        group.close()              # not after an error: a peer may be gone, do not wait on it
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:     # noqa: BLE001: every failure goes to the parent, then exit 1
        kind = COLLECTIVE if isinstance(e, ParallelError) else RAISED
        text = f"{type(e).__name__}: {e}".strip()
        try:
            conn.send_bytes(pickle.dumps(("error", kind, text)))
        except (OSError, pickle.PicklingError):
            pass
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)                # no atexit: a NCCL teardown with a dead peer may never return
    conn.close()


def _ended(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without a result"


def launch(fn: Callable, devices: Sequence, *args, timeout_s: float = DEFAULT_TIMEOUT_S,
           grace_s: float = GRACE_S, deadline_s: float | None = None,
           master_addr: str = "127.0.0.1") -> list:
    """Run fn(group, *args) on one process per device (rank i on devices[i]) and return the
    results in rank order. fn and args must be picklable (fn a module-level function); results
    come back by pickle. timeout_s: the group's timeout (start-up and every collective);
    deadline_s: the whole run's, if any. When a rank fails, the others get grace_s to end, then
    are terminated, and ParallelError names the first failure (its traceback is on stderr)."""
    devices = [str(d) for d in devices]
    world = len(devices)
    if world < 1:
        raise ParallelError("launch: no devices given (expected e.g. cuda:0,cuda:1 or cpu,cpu)")
    _check_not_bootstrapping("launch")
    for attempt in range(PORT_TRIES):
        # the port was free when chosen, but the ranks bind it seconds later (an interpreter
        # each): another process may take it meanwhile; then every rank ends and all start again
        # on another port
        results, failures, stopped, took = _launch_once(fn, devices, args, timeout_s, grace_s,
                                                        deadline_s, master_addr)
        if not (failures and not results and attempt + 1 < PORT_TRIES
                and any(_port_taken(f.text) for f in failures)):
            break
    if failures:
        raise _report(failures, stopped, world, took)
    return [results[r] for r in range(world)]


PORT_TRIES = 3


def _check_not_bootstrapping(what: str) -> None:
    """A rank starts as a fresh interpreter that imports the caller's main module again (the
    spawn start method); a script that starts ranks from its top level, unguarded, would start
    them again from inside each rank: say so, in the user's words, before anything starts."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ParallelError(
            f"{what}: called while a rank process was still starting: the script that starts the "
            f"ranks ran again inside the rank (each rank is a new Python process that imports "
            f"your main module). Put the code that starts the run under "
            f"`if __name__ == \"__main__\":` in that script")


def _port_taken(text: str) -> bool:
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _launch_once(fn, devices: list, args: tuple, timeout_s: float, grace_s: float,
                 deadline_s: float | None, master_addr: str):
    """One start of every rank on a fresh port -> (results {rank: result}, failures, stopped
    ranks, seconds)."""
    world = len(devices)
    ctx = multiprocessing.get_context("spawn")      # a fresh interpreter: no inherited CUDA state
    port = free_port(master_addr)
    procs, pipes = [], []
    for rank, dev in enumerate(devices):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, name=f"dsv4-rank{rank}",
                        args=(fn, rank, world, dev, master_addr, port, timeout_s, send, args))
        procs.append(p)
        pipes.append(recv)
    results: dict[int, object] = {}
    failures: list[RankFailure] = []
    stopped: list[int] = []
    t0 = time.monotonic()
    try:
        for p in procs:
            p.start()
        pending = set(range(world))
        stop_at = None
        while pending:
            multiprocessing.connection.wait(
                [pipes[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=POLL_S)
            now = time.monotonic()
            for r in sorted(pending):
                msg = _poll(pipes[r])
                if msg is None and not procs[r].is_alive():
                    msg = _poll(pipes[r]) or ("died", _ended(procs[r]))  # sent just before exit
                if msg is None:
                    continue
                pending.discard(r)
                if msg[0] == "ok":
                    results[r] = msg[1]
                elif msg[0] == "error":
                    failures.append(RankFailure(r, devices[r], msg[2], msg[1], now))
                else:
                    failures.append(RankFailure(r, devices[r], msg[1], DIED, now))
            if failures and stop_at is None:
                stop_at = now + grace_s
            if stop_at is not None and now >= stop_at:
                break
            if deadline_s is not None and now - t0 > deadline_s and pending:
                failures += [RankFailure(r, devices[r], f"did not finish within the "
                                         f"{deadline_s:g} s deadline", RAISED, now)
                             for r in sorted(pending)]
                break
        failed = {f.rank for f in failures}
        stopped = [r for r in sorted(pending) if r not in failed]   # terminated below
        for r in range(world):     # finished ranks exit by themselves; give them a moment
            if r in results:
                procs[r].join(EXIT_WAIT_S)
    finally:
        procs = [p for p in procs if p.pid is not None]    # started (a failed start: none after)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for c in pipes:
            c.close()
    return results, failures, stopped, time.monotonic() - t0


def _poll(conn):
    try:
        if conn.poll():
            return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None
    return None


def _report(failures: list[RankFailure], stopped: list[int], world: int,
            elapsed: float) -> ParallelError:
    first = min(failures, key=lambda f: (f.order, f.at, f.rank))
    others = [f for f in sorted(failures, key=lambda f: f.rank) if f is not first]
    msg = f"rank {first.rank} of {world} ({first.device}) failed first: {first.text}"
    if others:
        msg += "; then " + "; ".join(f"rank {f.rank}: {f.text}" for f in others)
    if stopped:
        msg += f"; rank(s) {', '.join(map(str, stopped))} still running were terminated"
    msg += (f". The run stopped after {elapsed:.1f} s: when one rank fails every rank ends (the "
            f"failed ranks' tracebacks, and the terminated ranks' stacks, are on stderr)")
    err = ParallelError(msg)
    err.failures = {f.rank: f.text for f in failures}
    err.first_rank = first.rank
    return err


class Workers:
    """Ranks 1 .. N-1 of a run whose rank 0 is the calling process (`spawn_workers`): a command
    line or server that keeps its terminal, signals and sockets, with the other ranks following
    it. `conns[i]` is a duplex pipe to rank i + 1 (the caller's protocol); `join()` waits for
    them to end (then terminates what is left) and raises a ParallelError naming a rank that
    failed."""

    def __init__(self, procs, conns, results, devices):
        self.procs, self.conns, self._results, self.devices = procs, conns, results, devices

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def join(self, timeout_s: float = EXIT_WAIT_S) -> list:
        """The workers' results (rank order) once they exited; ParallelError naming the first
        that failed or did not end within timeout_s (it is terminated)."""
        failures, out = [], []
        deadline = time.monotonic() + timeout_s
        for i, p in enumerate(self.procs):
            p.join(max(0.0, deadline - time.monotonic()))
            msg = _poll(self._results[i])
            if p.is_alive():
                p.terminate()
                p.join(5.0)
                failures.append(RankFailure(i + 1, self.devices[i + 1], f"did not end within "
                                            f"{timeout_s:g} s", RAISED, time.monotonic()))
            elif msg is None or msg[0] != "ok":
                text = msg[2] if msg and msg[0] == "error" else _ended(p)
                failures.append(RankFailure(i + 1, self.devices[i + 1], text, RAISED,
                                            time.monotonic()))
            else:
                out.append(msg[1])
        for c in self.conns + self._results:
            c.close()
        if failures:
            raise _report(failures, [], len(self.devices), 0.0)
        return out

    def terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()


def spawn_workers(fn: Callable, devices: Sequence, *args, timeout_s: float = DEFAULT_TIMEOUT_S,
                  master_addr: str = "127.0.0.1"):
    """Start ranks 1 .. N-1 (rank i on devices[i]), each running fn(group, conn, *args) with conn
    its end of a duplex pipe to the caller, and join the group as rank 0 on devices[0] here.
    -> (rank 0's TPGroup, Workers). ParallelError when the group does not form (the workers are
    ended)."""
    devices = [str(d) for d in devices]
    world = len(devices)
    if world < 2:
        raise ParallelError(f"spawn_workers: {world} device(s); a run of workers needs two or more")
    _check_not_bootstrapping("spawn_workers")
    ctx = multiprocessing.get_context("spawn")
    port = free_port(master_addr)   # bound by this process right after the spawn: a short window
    procs, conns, results = [], [], []
    for rank, dev in enumerate(devices[1:], start=1):
        mine, theirs = ctx.Pipe(duplex=True)
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, name=f"dsv4-rank{rank}",
                        args=(fn, rank, world, dev, master_addr, port, timeout_s, send,
                              (theirs, *args)))
        procs.append(p)
        conns.append(mine)
        results.append(recv)
    workers = Workers(procs, conns, results, devices)
    for p in procs:
        p.start()
    disable_multicast()
    try:
        group = start(0, world, devices[0], master_addr=master_addr, master_port=port,
                      timeout_s=timeout_s)
    except BaseException:
        workers.terminate()
        raise
    return group, workers
