"""Our two-shot all-reduce (csrc/allreduce.cu, the two-shot): the host side, for the large messages
of a tensor-parallel prefill (a chunk's [rows, 4096] partials: up to 32 MB in bf16). Each rank sums
the chunks it owns (chunk k: rank k % N) from every rank's part and pushes the sum back to every
rank, so it sends 2 (N - 1) / N of the message, where the one-shot sends N - 1 copies of all of it;
the arithmetic is the one-shot's (float32, rank order, rounded once). The buffer (receive and
result slots, flags), its IPC sharing, the status words, check() and close() are the one-shot's
host side (OneShotAllReduce); the layout and the launch are the two-shot kernel's.
"""
from __future__ import annotations

import ctypes

from ..errors import ParallelError
from ..kernels.cuda import lib as cuda_lib
from .group import TPGroup
from .oneshot import OneShotAllReduce

CHUNK_BYTES = 16384         # a chunk: 512 threads of two 16-byte vectors; 32 MB = 2048 chunks
CTAS = 128                  # the fixed grid (2 CTAs an SM fit: 64 SMs hold it at once)


class TwoShotAllReduce(OneShotAllReduce):
    """out = the sum over the ranks of x (float32 / bf16 / fp16, x.nbytes a multiple of 16 and
    <= max_bytes); x, out contiguous (out may be x); capture-safe: one kernel of `ctas` CTAs on
    the current stream, fixed buffers, the epochs on the device. All ranks must make the same
    calls in the same order, from one stream at a time."""
    name = "twoshot"
    # every element summed in float32 from the exact values, in rank order, rounded once (by the
    # chunk's owner, whose bits every rank copies): the one-shot's arithmetic, the same bits
    sums_in_float32 = True

    def __init__(self, group: TPGroup, max_bytes: int, chunk_bytes: int = CHUNK_BYTES,
                 ctas: int = CTAS, pdl: bool = False, timeout_s: float | None = None):
        self.ctas = ctas            # the layout's epochs: set before the buffer is sized
        super().__init__(group, max_bytes, chunk_bytes, pdl=pdl, timeout_s=timeout_s)

    def _buffer_bytes(self, lib) -> int:
        return lib.dsv4_ar2_buffer_bytes(self.cap, self.chunk, self.ctas, self.group.world_size)

    def supports_post(self, *tensors) -> bool:
        """Never: the two-shot's kernel has no mHC post (AllReduce.post: the caller reduces,
        then posts)."""
        return False

    def _launch(self, x, out) -> None:
        cuda_lib.allreduce2(self.lib, self.peers, self.group.world_size, self.group.rank, x, out,
                            self.cap, self.chunk, self.ctas, self.timeout_ns,
                            self.status_dev.value, self.pdl)

    def check(self) -> None:
        """Raise ParallelError if a call so far timed out waiting for a rank (reads host-mapped
        words: no sync; call it after the stream's work is known to be done)."""
        if not self.status_host.value:
            return
        words = (ctypes.c_int * 4).from_address(self.status_host.value)
        kind, rank, epoch, cta = words[0], words[1], words[2], words[3]
        if not kind:
            return
        # kind 1: rank's part of a chunk this rank sums never came; kind 2: the sums of a chunk
        # rank owns never came (rank itself may have been waiting for another, late, rank)
        what = (f"waited {self.timeout_s:g} s for rank {rank}" if kind == 1 else
                f"waited {2 * self.timeout_s:g} s for rank {rank}'s sums")
        who = f"Rank {rank}" if kind == 1 else f"Rank {rank}, or a rank it waited for,"
        raise ParallelError(
            f"{self.group.describe()}: the two-shot all-reduce {what} (epoch {epoch}, CTA {cta}) "
            f"and gave up; its output is NaN. {who} died, stalled, or made a different sequence "
            f"of all-reduces; the run cannot go on")

    def describe(self) -> str:
        return (f"csrc/allreduce.cu (two-shot), {self.group.world_size} ranks, "
                f"<= {size_text(self.cap)}, {self.chunk >> 10} KB chunks on {self.ctas} CTAs")


def size_text(nbytes: int) -> str:
    """A message size as the tables print it: whole MB, else KB."""
    return f"{nbytes >> 20} MB" if nbytes % (1 << 20) == 0 else f"{nbytes >> 10} KB"
