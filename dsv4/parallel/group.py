"""The process group of a tensor-parallel run: this process's rank, the world size, its device and
the torch.distributed group over them (NCCL on CUDA, gloo on the CPU), started from the
environment torchrun sets (`start_from_env`) or from our launcher's arguments (`start`). Every
process it starts keeps NVLink multicast off (MULTICAST_OFF), and every wait has a timeout: a rank
that does not join, dies or stalls ends the run with a ParallelError naming the rank, not a hang.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DeviceError, ParallelError

# NVLink multicast (NVLS) off in every process of a run, set before any NCCL / symmetric-memory
# initialization: a program that creates multicast objects can put a shared host's GPUs out of
# service for a day, and the batch-1 collectives here do not need it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
# seconds any rank waits for the others (group start, each collective, the one-shot kernel's flag
# wait): long enough for ranks that load weights or capture graphs at different speeds
DEFAULT_TIMEOUT_S = 300.0
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FIX = ("every rank must be started with the same world size and master address / port; see the "
       "other ranks' errors for the one that failed")


class Unavailable(Exception):
    """A collective's implementation cannot serve this group: the reason, agreed by every rank
    (raised by an implementation's constructor, caught by the plan: never leaves the package)."""


def disable_multicast(environ=None) -> None:
    """Write MULTICAST_OFF into `environ` (default os.environ), overriding other values."""
    (os.environ if environ is None else environ).update(MULTICAST_OFF)


@dataclass(frozen=True)
class TPGroup:
    """One rank of a tensor-parallel run. `pg` is the torch.distributed group of all ranks (None
    once closed)."""
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    pg: Any = field(compare=False, repr=False)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} ({self.device}, {self.backend})"

    def failed(self, what: str, cause: BaseException | str) -> ParallelError:
        """The ParallelError of a collective `what` that failed here with `cause`."""
        return ParallelError(
            f"{self.describe()}: {what} failed: {cause}. Another rank died, stalled past the "
            f"{self.timeout_s:g} s timeout or made a different sequence of collectives; the run "
            f"cannot go on (the launcher or torchrun names the rank that failed first)")

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order: host-side, for plan time, not capture."""
        out = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except RuntimeError as e:      # gloo raises RuntimeError, NCCL a DistError (one)
            raise self.failed("all_gather_object", e) from e
        return out

    def barrier(self) -> None:
        try:
            if self.device.type == "cuda":
                dist.barrier(group=self.pg, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.pg)
        except RuntimeError as e:
            raise self.failed("barrier", e) from e

    def close(self) -> None:
        """Meet the other ranks, destroy the process group and drop this object's reference to
        it, then wait (at most 30 s) until every rank has done the same before returning
        (collective: every rank calls it once done; a second call does nothing).
        destroy_process_group leaves the group's object alive while anything refers to it, and
        with it gloo's threads (a transport loop and the workers): held here they ran on until
        the interpreter's teardown, where gloo aborted now and then ("terminate called without
        an active exception"; two CPU ranks under torchrun on a loaded 2-core machine: 7 of 90
        runs). Dropping the last reference joins them here, while every peer is still up."""
        if self.pg is None or not dist.is_initialized():
            return
        store = dist.distributed_c10d._get_default_store()
        self.barrier()
        self._destroy()
        object.__setattr__(self, "pg", None)    # frozen otherwise: the group is gone now
        try:
            self._meet(store, "dsv4/closed")
            # then rank 0, which hosts the store where dsv4.parallel.launch formed the group,
            # stays until every rank is past its last call: a rank still polling a store whose
            # host had exited got "recvValue failed ... Connection was likely closed" with a
            # C++ stack on stderr (2x H200, nineteenth session); the others leave at once
            store.add("dsv4/left", 1)
            if self.rank == 0:
                self._meet(store, "dsv4/left", add=False)
        except RuntimeError:          # the store's host is gone: nothing left to wait for
            pass

    def _meet(self, store, key: str, add: bool = True) -> None:
        """Count this rank at `key` (add), then wait until every rank has (at most 30 s)."""
        if add:
            store.add(key, 1)
        t0 = time.monotonic()
        while (store.add(key, 0) < self.world_size
               and time.monotonic() - t0 < min(self.timeout_s, 30.0)):
            time.sleep(0.005)

    def _destroy(self) -> None:
        """destroy_process_group, waited for at most min(timeout_s, 60) s. NCCL's teardown
        waits until every CUDA graph that captured one of its collectives is destroyed: a graph
        kept alive (or only in a reference cycle) made it hang for good. Cycles are collected
        first; a teardown still stuck ends in a ParallelError that says so (its thread is left
        behind, a daemon)."""
        gc.collect()                           # graphs only a reference cycle still holds
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        failed: list = []

        def destroy():
            try:
                dist.destroy_process_group(self.pg)
            except BaseException as e:         # noqa: BLE001: reported by close's thread
                failed.append(e)
        t = threading.Thread(target=destroy, name="dsv4-destroy-group", daemon=True)
        t.start()
        wait = min(self.timeout_s, 60.0)
        t.join(wait)
        if t.is_alive():
            raise ParallelError(
                f"{self.describe()}: the process group did not tear down within {wait:g} s. "
                f"NCCL waits for every CUDA graph that captured one of its collectives to be "
                f"destroyed: close the Session (or drop the graphs, e.g. model.prefill_graphs = "
                f"None) before closing the group")
        if failed:
            raise self.failed("destroy_process_group", failed[0]) from failed[0]


def _device(device, rank: int) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"rank {rank}: device {dev} is not supported by the tensor-parallel "
                          f"mode; use cuda:N (one GPU a rank) or cpu")
    if dev.index is None:
        raise DeviceError(f"rank {rank}: device 'cuda' names no GPU; give each rank its own, e.g. "
                          f"cuda:0,cuda:1")
    if not torch.cuda.is_available():
        raise DeviceError(f"rank {rank}: {dev} asked, but this torch has no CUDA (a CPU-only build "
                          f"or no GPU visible); use cpu ranks or a CUDA machine")
    if dev.index >= torch.cuda.device_count():
        raise DeviceError(f"rank {rank}: {dev} asked, but only {torch.cuda.device_count()} GPU(s) "
                          f"are visible (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES')})")
    return dev


def _form(rank: int, world_size: int, device, timeout_s: float, where: str, **init) -> TPGroup:
    """init_process_group with the device's backend; `where` names the rendezvous in errors."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DeviceError(f"rank {rank} of world size {world_size}: expected 0 <= rank < "
                          f"world size")
    if not timeout_s > 0:
        raise DeviceError(f"timeout_s = {timeout_s}: expected a positive number of seconds")
    disable_multicast()
    dev = _device(device, rank)
    if dist.is_initialized():
        raise ParallelError(f"rank {rank}: a torch.distributed process group already exists in "
                            f"this process; start one tensor-parallel group per process")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        init["device_id"] = dev               # NCCL starts now: a missing rank fails here
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **init)
    except RuntimeError as e:                 # DistStoreError, DistNetworkError, gloo, NCCL
        raise ParallelError(
            f"rank {rank} of {world_size} ({dev}): the process group did not form within "
            f"{timeout_s:g} s at {where}: {e}. A rank did not start, died while starting, or was "
            f"given other settings; {FIX}") from e
    return TPGroup(rank, world_size, dev, float(timeout_s), dist.group.WORLD)


def start(rank: int, world_size: int, device, *, master_port: int, master_addr: str = "127.0.0.1",
          timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the run as `rank` on `device` (cuda:N: NCCL; cpu: gloo); rank 0 hosts the rendezvous
    store at master_addr:master_port. Waits at most timeout_s for the others (ParallelError)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DeviceError(f"rank {rank} of world size {world_size}: expected 0 <= rank < "
                          f"world size")
    where = f"{master_addr}:{master_port}"
    try:
        # rank 0 waits here for every other rank to connect; the others retry until rank 0 listens
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=True)
    except RuntimeError as e:
        who = (f"rank 0 waited {timeout_s:g} s at {where} for the other {world_size - 1} rank(s)"
               if rank == 0 else f"rank {rank} could not reach rank 0 at {where} within "
               f"{timeout_s:g} s")
        raise ParallelError(f"{who}: {e}. A rank did not start or died while starting; "
                            f"{FIX}") from e
    return _form(rank, world_size, device, timeout_s, where, store=store)


def start_from_env(device=None, timeout_s: float = DEFAULT_TIMEOUT_S, environ=None) -> TPGroup:
    """Join the run torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
    device: this rank's device, or a list of the host's devices indexed by LOCAL_RANK; default
    cuda:LOCAL_RANK where CUDA is available, else cpu."""
    env = os.environ if environ is None else environ
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise DeviceError(
            f"{', '.join(missing)} not set: this process was not started by torchrun. Start it "
            f"with `torchrun --nproc-per-node N ...`, or let dsv4 start one process per device "
            f"(dsv4.parallel.launch)")
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", env["RANK"]))
    except ValueError as e:
        raise DeviceError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from e
    if isinstance(device, (list, tuple)):
        if local >= len(device):
            raise DeviceError(f"LOCAL_RANK {local} but only {len(device)} device(s) given "
                              f"({','.join(map(str, device))}): give one device per process")
        device = device[local]
    elif device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    where = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']} (env://)"
    return _form(rank, world, device, timeout_s, where, init_method="env://")
