"""Tensor-parallel communication: the layer between the model (above: it imports this) and the
kernels (below: csrc/allreduce.cu through dsv4.kernels.cuda). No CUDA graphs here; what is
captured is the caller's business, and every op here says whether it is capture-safe.

  group     the process group of a run: rank, world size, device (NCCL on CUDA, gloo on the
            CPU), started from torchrun's environment or by our launcher; multicast off; timeouts
  launch    one process per device (spawn), joined; the first failure ends every rank; or
            ranks 1 .. N-1 spawned with a pipe each while the caller is rank 0 (spawn_workers)
  allreduce the all-reduce, planned once: which implementation serves small messages (and, where
            asked, large ones)
  comm      the communicator a tensor-parallel model holds: the all-reduce and an all-gather
  nccl      torch.distributed.all_reduce (the fallback; gloo on the CPU)
  symm      PyTorch symmetric memory: one-shot / two-shot over peer loads (never multimem)
  oneshot   our one-shot kernel over peer memory (CUDA IPC buffers, device-side epochs)
  twoshot   our two-shot kernel over peer memory for large messages (prefill chunks): each rank
            sums the chunks it owns and sends the sums back; the one-shot's buffers and numerics

Tests: tests/dsv4/parallel/ (CPU: two gloo processes; GPUs: `multigpu`). Measure:
scripts/bench_comm.py.
"""
from .allreduce import IMPLEMENTATIONS, MAX_BYTES, PREFERENCE, AllReduce, plan_allreduce
from .comm import Communicator
from .group import (DEFAULT_TIMEOUT_S, MULTICAST_OFF, TPGroup, disable_multicast, start,
                    start_from_env)
from .launch import Workers, launch, spawn_workers

__all__ = ["AllReduce", "Communicator", "DEFAULT_TIMEOUT_S", "IMPLEMENTATIONS", "MAX_BYTES",
           "MULTICAST_OFF", "PREFERENCE", "TPGroup", "Workers", "disable_multicast", "launch", "plan_allreduce",
           "spawn_workers", "start", "start_from_env"]
