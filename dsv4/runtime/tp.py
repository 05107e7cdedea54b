"""Tensor-parallel runs: one process a device (torch.distributed: NCCL on GPUs, gloo on the CPU),
each holding its rank's shard of every layer (dsv4.model.sharding) and running the same steps as
the others: the same prefill, the same decode loop (a plain Session, unchanged), the same logits
on every rank (the head's all-gather), hence the same sampled token. Rank 0 is the one that
talks to the user; `open_session` makes this process rank 0 of a run whose other ranks follow its
`MirroredSession` (an interactive command keeps its terminal). Start the ranks with `launch_generate` (our launcher: dsv4.parallel.launch)
or, under torchrun, call dsv4.parallel.start_from_env and then `load_rank` in each process.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Sequence

import torch

from ..backend.decision import cuda_status
from ..backend.options import Options
from ..errors import ParallelError
from ..parallel import Communicator, launch
from ..parallel.group import DEFAULT_TIMEOUT_S, TPGroup
from ..parallel.allreduce import LARGE_BYTES_LIMIT, MAX_BYTES
from ..weights.checkpoint import open_checkpoint
from .build import build_model
from .config import RuntimeConfig, layer_placement
from .sampling import SamplingParams
from .session import Session


def cpu_share(world: int) -> int:
    """Threads for one of `world` CPU ranks on this host: its share of the usable cores (more
    threads than cores make every op wait on the others: tens of times slower), at most
    OMP_NUM_THREADS where that is set (a process's thread limit the caller chose, as torch
    takes it: the host shared with other work, a test worker's share)."""
    share = max(1, len(os.sched_getaffinity(0)) // world)
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return min(share, int(omp)) if omp.isdigit() and int(omp) > 0 else share


def rank_runtime(rt: RuntimeConfig, group: TPGroup) -> RuntimeConfig:
    """rt for one rank of `group`: its one device, tp = the world size (the other knobs as
    given, the same on every rank)."""
    return replace(rt, devices=(group.device,), tp=group.world_size)


def two_shot_bytes(group: TPGroup, rt: RuntimeConfig, cfg, opts: Options | None = None) -> int:
    """plan_allreduce's large_bytes for a rank: the largest prefill message (a chunk's
    [prefill_chunk, dim] partial in the activation dtype, up to LARGE_BYTES_LIMIT) on two CUDA
    ranks where the two-shot is asked for (`opts.two_shot`, DSV4_TWO_SHOT=1); 0 elsewhere, and by
    default. Alone in a graph our two-shot beats NCCL at every size timed (2x H100: 32 MB 128.1
    against NCCL bf16's 158.2 us), but inside a TP2 prefill it was slower: 8 Flash layers, 4,096
    tokens, one machine, TTFT 73.7 ms (64.6 launched without PDL) against NCCL bf16's 54.8
    (BENCHMARKS.md, sixteenth session; not yet explained). Four ranks keep NCCL's float32 route
    (the two-shot's 4-GPU tests have not run), gloo has no peer memory."""
    opts = opts if opts is not None else (rt.options if rt.options is not None
                                          else Options.from_env())
    if not opts.two_shot or group.device.type != "cuda" or group.world_size != 2:
        return 0
    n = rt.prefill_chunk * cfg.dim * rt.dtype.itemsize
    return min(n, LARGE_BYTES_LIMIT) if n > MAX_BYTES else 0


def rank_communicator(group: TPGroup, rt: RuntimeConfig, cfg, prefer: str | None = None
                      ) -> Communicator:
    """The rank's collectives planned over the group (collective: every rank calls it; prefer:
    force an implementation, dsv4.parallel.plan_allreduce), the all-reduce launched with PDL
    where the rank's kernels are (the backend's switch: rt.options, else the environment), the
    two-shot for a prefill chunk's messages where asked (two_shot_bytes, from the model's
    config `cfg`). A prebuilt CUDA C++ library (Options.cuda_lib, DSV4_CUDA_LIB) is the one the
    plan's kernels load, as the rank's backend would: the plan comes first, and a load without
    it built the library again on every rank (a minute of a fresh machine)."""
    opts = rt.options if rt.options is not None else Options.from_env()
    if opts.cuda_lib and group.device.type == "cuda":
        cuda_status(group.device, opts)    # the first load of this architecture
    return Communicator.plan(group, prefer=prefer, pdl=opts.pdl,
                             large_bytes=two_shot_bytes(group, rt, cfg, opts))


def load_rank(group: TPGroup, ckpt_dir, rt: RuntimeConfig, progress: bool | None = None,
              prefer: str | None = None):
    """This rank's model: its runtime checked (rank_runtime, before the plan allocates the
    peer buffers that a refusal would leave behind), the checkpoint opened and validated (the
    full shapes), the all-reduce planned over the group (rank_communicator), the rank's shard
    built and loaded, reading only its slices of the split tensors. Collective: every rank
    calls it. -> (model, checkpoint); model.tp.comm is the communicator (close it after the
    rank's last step)."""
    rt = rank_runtime(rt, group)
    ckpt = open_checkpoint(ckpt_dir)
    try:
        comm = rank_communicator(group, rt, ckpt.config, prefer)
        model = build_model(ckpt.config, rt, layer_placement(ckpt, rt.devices), comm)
        model.load(ckpt, progress=progress)
    except BaseException:
        ckpt.close()
        raise
    return model, ckpt


def generate_rank(group: TPGroup, ckpt_dir, rt: RuntimeConfig, prompt_ids: Sequence[int],
                  max_new_tokens: int, params: SamplingParams, mode: str = "auto",
                  eos_id: int | None = None) -> dict:
    """One rank's part of a generation (a module-level function: the launcher runs it in each
    rank's process): load the shard, prefill and decode with a Session, as one process would.
    -> {rank, output_ids, finish_reason, load_s, generate_s} (every rank's ids are the same)."""
    if group.device.type == "cpu":   # CPU ranks share the host's cores: each takes its share
        torch.set_num_threads(cpu_share(group.world_size))
    t0 = time.perf_counter()
    model, ckpt = load_rank(group, ckpt_dir, rt)
    ckpt.close()
    t1 = time.perf_counter()
    with Session(model, params, mode=mode) as session:
        res = session.generate(list(prompt_ids), max_new_tokens, eos_id=eos_id)
    model.tp.comm.check()
    model.tp.comm.close()
    return {"rank": group.rank, "output_ids": list(res.output_ids),
            "finish_reason": res.finish_reason, "load_s": t1 - t0,
            "generate_s": time.perf_counter() - t1}


def launch_generate(devices: Sequence[str], ckpt_dir, rt: RuntimeConfig,
                    prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams,
                    mode: str = "auto", eos_id: int | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """A generation over one process per device (rank i on devices[i]; len(devices) = the
    tensor-parallel degree) -> rank 0's result of generate_rank. ParallelError when a rank
    fails (naming it) or, which would be a bug, when the ranks' tokens differ."""
    got = launch(generate_rank, list(devices), str(ckpt_dir), rt, list(prompt_ids),
                 max_new_tokens, params, mode, eos_id, timeout_s=timeout_s)
    ids = [r["output_ids"] for r in got]
    if any(i != ids[0] for i in ids):
        raise ParallelError(f"the ranks generated different tokens ({ids}): their logits must "
                            f"be the same bits on every rank; report this as a bug")
    return got[0]


# ---- a Session driven from rank 0 (dsv4 chat / serve --parallel tp) ------------------------------

class MirroredSession:
    """Rank 0's Session of a tensor-parallel run whose other ranks follow it (`follow_rank`): each
    call that changes the state (reset, prefill, score, generate, new_snapshot, save, restore,
    setting `pending`) goes down a pipe to every follower with the same arguments before it runs
    here, so every rank makes the same steps and collectives. Callbacks run here only: after
    each token rank 0 sends its on_token decision (stop or go on) and the followers stop where it
    does; a token mask (structured output) is filled here and its bitmask sent for each token;
    log-probabilities are computed on every rank and reported here. Attributes (length, model,
    spec, ...) are rank 0's, the same on every rank."""

    def __init__(self, session: Session, group: TPGroup, workers):
        object.__setattr__(self, "_s", session)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "workers", workers)
        object.__setattr__(self, "_broken", None)     # why the ranks can no longer go on
        object.__setattr__(self, "_snaps", 0)

    def __getattr__(self, name):
        return getattr(self._s, name)

    def __setattr__(self, name, value):
        if name != "pending":
            raise AttributeError(f"MirroredSession: {name} is not set through the mirror")
        self._send(("set", ("pending", value), {}))
        self._s.pending = value

    def _send(self, msg) -> None:
        if self._broken:
            raise ParallelError(self._broken)
        try:
            for c in self.workers.conns:
                c.send(msg)
        except (BrokenPipeError, EOFError, OSError) as e:
            object.__setattr__(self, "_broken", f"a tensor-parallel rank is gone ({e}); the "
                                                f"run cannot go on: restart it")
            raise ParallelError(self._broken) from e

    def reset(self) -> None:
        self._send(("reset", (), {}))
        self._s.reset()

    def prefill(self, ids, continue_sequence: bool = False, progress: bool = False):
        self._send(("prefill", (list(ids),), {"continue_sequence": continue_sequence}))
        return self._s.prefill(ids, continue_sequence=continue_sequence, progress=progress)

    def score(self, ids):
        self._send(("score", (list(ids),), {}))
        return self._s.score(ids)

    def new_snapshot(self):
        """A snapshot here and its twin on every follower (by number)."""
        k = self._snaps
        object.__setattr__(self, "_snaps", k + 1)
        self._send(("snapshot", (k,), {}))
        snap = self._s.new_snapshot()
        snap.mirror_id = k
        return snap

    def save(self, snap) -> None:
        self._send(("save", (snap.mirror_id,), {}))
        self._s.save(snap)

    def restore(self, snap) -> None:
        self._send(("restore", (snap.mirror_id,), {}))
        self._s.restore(snap)

    def generate(self, prompt_ids, max_new_tokens: int, *, on_token=None, progress: bool = False,
                 on_logprobs=None, constraint=None, **kw):
        self._send(("generate", (list(prompt_ids), max_new_tokens),
                    dict(kw, _logprobs=on_logprobs is not None, _mask=constraint is not None)))
        if constraint is not None:
            constraint = _SentMask(constraint, self._send)

        def decide(tid: int):
            try:
                stop = on_token(tid) if on_token is not None else None
            except BaseException:
                self._send(True)       # the followers stop where rank 0 stopped
                raise
            self._send(bool(stop))
            return stop
        try:
            return self._s.generate(prompt_ids, max_new_tokens, on_token=decide,
                                    progress=progress, on_logprobs=on_logprobs,
                                    constraint=constraint, **kw)
        except KeyboardInterrupt:      # mid-step: the followers may be inside a collective
            object.__setattr__(self, "_broken", "a tensor-parallel generation was interrupted "
                               "mid-step; the ranks cannot resume together: restart the run")
            raise

    def close(self) -> None:
        """Close every rank's session and the group; the followers' failures are raised."""
        try:
            if not self._broken:
                self._send(("close", (), {}))
                self._s.close()
                self._s.model.tp.comm.close()
                self.group.close()
                self.workers.join()
        finally:
            self.workers.terminate()

    def __enter__(self) -> "MirroredSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SentMask:
    """Rank 0's token mask: the constraint's bitmask of each token, also sent to the followers."""

    def __init__(self, constraint, send):
        self.constraint, self.send = constraint, send

    def fill(self, bitmask: torch.Tensor) -> None:
        self.constraint.fill(bitmask)
        self.send(("mask", bitmask.numpy().tobytes()))

    def accept(self, token: int) -> None:
        self.constraint.accept(token)


class _ReceivedMask:
    """A follower's token mask: rank 0's bitmask of each token."""

    def __init__(self, conn):
        self.conn = conn

    def fill(self, bitmask: torch.Tensor) -> None:
        what, data = self.conn.recv()
        assert what == "mask", what
        bitmask.copy_(torch.frombuffer(bytearray(data), dtype=bitmask.dtype))

    def accept(self, token: int) -> None:
        pass


def follow_rank(group: TPGroup, conn, ckpt_dir, rt: RuntimeConfig, session_kw: dict) -> None:
    """A follower rank (1 .. N-1) of a MirroredSession (a module-level function: spawn_workers
    runs it): load its shard, build the same Session, then run what rank 0 sends until "close";
    each token waits for rank 0's decision. An error rank 0 also meets (the same inputs) is not
    this rank's to report: it goes on to the next call. Rank 0 gone (the pipe closed): exit."""
    from ..errors import UserInputError
    if group.device.type == "cpu":
        torch.set_num_threads(cpu_share(group.world_size))
    model, ckpt = load_rank(group, ckpt_dir, rt, progress=False)
    ckpt.close()
    s = Session(model, **session_kw)
    snaps = {}
    conn.send("ready")
    while True:
        try:
            name, args, kw = conn.recv()
        except EOFError:                  # rank 0 ended without closing: nothing to wait for
            os._exit(1)
        if name == "close":
            break
        if name == "set":
            setattr(s, *args)
            continue
        if name == "snapshot":
            snaps[args[0]] = s.new_snapshot()
            continue
        if name in ("save", "restore"):
            getattr(s, name)(snaps[args[0]])
            continue
        if name == "generate":
            kw = dict(kw)
            lp, mask = kw.pop("_logprobs"), kw.pop("_mask")
            kw["on_token"] = lambda tid: conn.recv()
            kw["on_logprobs"] = (lambda entry: None) if lp else None
            kw["constraint"] = _ReceivedMask(conn) if mask else None
        try:
            getattr(s, name)(*args, **kw)
        except UserInputError:
            pass
    s.close()
    model.tp.comm.close()


def open_session(devices: Sequence[str], ckpt_dir, rt: RuntimeConfig, session_kw: dict,
                 progress: bool | None = None) -> tuple[MirroredSession, float]:
    """A tensor-parallel Session driven from this process (rank 0 on devices[0]; the others
    spawned, following it) -> (MirroredSession, load seconds). session_kw: Session's keyword
    arguments (params, mode, granularity, speculative, ...)."""
    from ..parallel import spawn_workers
    t0 = time.perf_counter()
    group, workers = spawn_workers(follow_rank, devices, str(ckpt_dir), rt, session_kw)
    try:
        if group.device.type == "cpu":
            torch.set_num_threads(cpu_share(group.world_size))
        model, ckpt = load_rank(group, ckpt_dir, rt, progress=progress)
        ckpt.close()
        s = Session(model, **session_kw)
        for c in workers.conns:
            if c.recv() != "ready":
                raise ParallelError("a tensor-parallel rank did not get ready")
    except BaseException:
        workers.terminate()
        raise
    return MirroredSession(s, group, workers), time.perf_counter() - t0
