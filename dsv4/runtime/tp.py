"""Tensor-parallel runs: one process a device (torch.distributed: NCCL on GPUs, gloo on the CPU),
each holding its rank's shard of every layer (dsv4.model.sharding) and running the same steps as
the others: the same prefill, the same decode loop (a plain Session, unchanged), the same logits
on every rank (the head's all-gather), hence the same sampled token. Rank 0 is the one that
talks to the user. Start the ranks with `launch_generate` (our launcher: dsv4.parallel.launch)
or, under torchrun, call dsv4.parallel.start_from_env and then `load_rank` in each process.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Sequence

import torch

from ..errors import ParallelError
from ..parallel import Communicator, launch
from ..parallel.group import DEFAULT_TIMEOUT_S, TPGroup
from .build import load_model
from .config import RuntimeConfig
from .sampling import SamplingParams
from .session import Session


def cpu_share(world: int) -> int:
    """Threads for one of `world` CPU ranks on this host: its share of the usable cores (more
    threads than cores make every op wait on the others: tens of times slower)."""
    return max(1, len(os.sched_getaffinity(0)) // world)


def rank_runtime(rt: RuntimeConfig, group: TPGroup) -> RuntimeConfig:
    """rt for one rank of `group`: its one device, tp = the world size (the other knobs as
    given, the same on every rank)."""
    return replace(rt, devices=(group.device,), tp=group.world_size)


def load_rank(group: TPGroup, ckpt_dir, rt: RuntimeConfig, progress: bool | None = None,
              prefer: str | None = None):
    """This rank's model: the all-reduce planned over the group (prefer: force an
    implementation, dsv4.parallel.plan_allreduce), the checkpoint opened and validated (the
    full shapes), the rank's shard built and loaded, reading only its slices of the split
    tensors. Collective: every rank calls it. -> (model, checkpoint); model.tp.comm is the
    communicator (close it after the rank's last step)."""
    comm = Communicator.plan(group, prefer=prefer)
    return load_model(ckpt_dir, rank_runtime(rt, group), progress=progress, comm=comm)


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
