"""Our one-shot all-reduce (csrc/allreduce.cu): the host side. Each rank cudaMallocs one buffer
(epochs, flags, two parities of data slots: the layout is the kernel's), shares it through a CUDA
IPC handle gathered over the group, maps every peer's, and then each call is one launch that
pushes this rank's message into every rank's slot, meets the others at flags in peer memory (an
epoch counter on the device keeps graph replays in step) and sums the slots in rank order.
A peer that does not arrive within the group's timeout: the kernel records it in host-mapped
status words and writes NaN; `check()` reads them (no sync) and raises a ParallelError naming it.
"""
from __future__ import annotations

import ctypes

import torch

from ..errors import ParallelError
from ..kernels.cuda import lib as cuda_lib
from .group import TPGroup, Unavailable

CHUNK_BYTES = 8192          # bytes a CTA: 512 threads of one 16-byte vector (a 4096-wide bf16 row)
MAX_RANKS = 8               # AR_MAX_RANKS of the kernel
DTYPES = tuple(cuda_lib.AR_DTYPES)


class OneShotAllReduce:
    """out = the sum over the ranks of x (float32 / bf16 / fp16, x.nbytes a multiple of 16 and
    <= max_bytes); x, out contiguous (out may be x); capture-safe: one kernel on the current
    stream, fixed buffers, the epochs on the device. All ranks must make the same calls in the
    same order, from one stream at a time."""
    name = "oneshot"
    # every element summed in float32 from the exact values, in rank order, rounded once to x's
    # dtype (csrc/allreduce.cu, step 5): a bf16 x gives the bits of its float32 copy's sum cast
    # back, which TensorParallel.reduce relies on to skip the two casts
    sums_in_float32 = True

    def __init__(self, group: TPGroup, max_bytes: int, chunk_bytes: int = CHUNK_BYTES,
                 pdl: bool = False, timeout_s: float | None = None):
        # PDL where asked and the device has it (sm_90+): the launch may start while the
        # kernel before it finishes; the kernel's first act is the PDL wait
        self.group = group
        self.pdl = bool(pdl) and group.device.type == "cuda" and \
            torch.cuda.get_device_capability(group.device) >= (9, 0)
        self.chunk = chunk_bytes
        self.cap = -(-max_bytes // chunk_bytes) * chunk_bytes     # whole CTAs
        self.max_bytes = self.cap
        self.timeout_s = group.timeout_s if timeout_s is None else timeout_s
        self.timeout_ns = int(self.timeout_s * 1e9)
        self.lib = cuda_lib.lib_for(group.device)
        dev, lib = group.device.index, self.lib
        self.own = ctypes.c_void_p()
        self.opened: list[ctypes.c_void_p] = []
        self.status_host = ctypes.c_void_p()
        self.status_dev = ctypes.c_void_p()
        # phase 1, local: the buffer, its handle, the status words; then every rank's outcome
        err, handle = None, None
        nbytes = self._buffer_bytes(lib) if lib is not None else 0
        if lib is None:
            err = f"the CUDA C++ library is unavailable ({cuda_lib.status(group.device)})"
        elif nbytes == 0:
            err = f"buffer sizes not supported (max_bytes {self.cap}, chunk {self.chunk})"
        else:
            hbuf = ctypes.create_string_buffer(lib.dsv4_ar_ipc_handle_bytes())
            code = lib.dsv4_ar_alloc(dev, nbytes, ctypes.byref(self.own), hbuf)
            if code == 0:
                code = lib.dsv4_ar_status_alloc(ctypes.byref(self.status_host),
                                                ctypes.byref(self.status_dev))
            if code != 0:
                err = f"allocation failed ({lib.dsv4_error_string(code).decode()})"
            else:
                handle = hbuf.raw
        got = group.all_gather_object((dev, handle, err))
        self._give_up_if(got, "allocating the buffer")
        # phase 2, local: map every peer's buffer (peer access over NVLink or PCIe)
        self.peers = (ctypes.c_void_p * group.world_size)()
        err = None
        for r, (pdev, phandle, _) in enumerate(got):
            if r == group.rank:
                self.peers[r] = self.own.value
                continue
            if pdev != dev and not torch.cuda.can_device_access_peer(dev, pdev):
                err = f"cuda:{dev} cannot access cuda:{pdev} (no peer access)"
                break
            ptr = ctypes.c_void_p()
            code = lib.dsv4_ar_open(dev, phandle, ctypes.byref(ptr))
            if code != 0:
                err = (f"opening rank {r}'s buffer (cuda:{pdev}) failed "
                       f"({lib.dsv4_error_string(code).decode()})")
                break
            self.opened.append(ptr)
            self.peers[r] = ptr.value
        self._give_up_if(group.all_gather_object((dev, None, err)), "mapping the peers' buffers")

    def _give_up_if(self, gathered, what: str) -> None:
        errs = [(r, e) for r, (_, _, e) in enumerate(gathered) if e]
        if errs:
            self._release()
            r, e = errs[0]
            raise Unavailable(f"rank {r}: {what}: {e}")

    def _buffer_bytes(self, lib) -> int:
        """Bytes of this rank's buffer (the kernel's layout; 0: sizes not supported)."""
        return lib.dsv4_ar_buffer_bytes(self.cap, self.chunk)

    @staticmethod
    def unavailable(group: TPGroup, max_bytes: int) -> str | None:
        """Why the kernel cannot serve this group, from what this rank sees (None: try it)."""
        if group.device.type != "cuda":
            return "not a CUDA device"
        if not 2 <= group.world_size <= MAX_RANKS:
            return f"world size {group.world_size} (the kernel takes 2..{MAX_RANKS})"
        status = cuda_lib.status(group.device)
        return None if status == "ok" else f"the CUDA C++ library: {status}"

    def supports(self, nbytes: int, dtype: torch.dtype) -> bool:
        return dtype in DTYPES and 0 < nbytes <= self.cap and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if x.data_ptr() % 16 or out.data_ptr() % 16:
            # a view at an odd offset (the same offset on every rank): through an aligned copy
            tmp = x.clone()
            self._launch(tmp, tmp)
            out.copy_(tmp)
            return
        self._launch(x, out)

    POST_DTYPES = (torch.float32, torch.bfloat16)
    POST_STREAMS = 4            # the mHC streams the kernel's post takes (hc_mult)

    def supports_post(self, x: torch.Tensor, res: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether `post` serves these tensors (x [rows, D], res and out [rows, 4, D] of x's
        dtype, post [rows, 4] and comb [rows, 4, 4] float32; all contiguous and 16-byte aligned,
        out apart from res): it goes by shapes, dtypes and addresses alone."""
        if x.dim() != 2 or x.dtype not in self.POST_DTYPES:
            return False
        T, D = x.shape
        C = self.POST_STREAMS
        shapes = (res.shape == (T, C, D) and out.shape == (T, C, D) and post.shape == (T, C)
                  and comb.shape == (T, C, C))
        kinds = (res.dtype == out.dtype == x.dtype and post.dtype == comb.dtype == torch.float32
                 and all(t.is_contiguous() and t.device == x.device
                         for t in (x, res, post, comb, out)))
        aligned = all(t.data_ptr() % 16 == 0 for t in (x, res, out))
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        apart = res.data_ptr() >= hi or res.data_ptr() + res.numel() * res.element_size() <= lo
        return (shapes and kinds and aligned and apart and (D * x.element_size()) % 16 == 0
                and self.supports(x.numel() * x.element_size(), x.dtype))

    def post(self, x: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             out: torch.Tensor) -> None:
        """out = hc_post(the sum over the ranks of x, res, post, comb) in one launch (x not
        written; the sum's bits those of a plain call; supports_post must hold). The same calls
        on every rank, in the order of the plain ones: both share the buffer and its epochs."""
        cuda_lib.allreduce_post(self.lib, self.peers, self.group.world_size, self.group.rank, x,
                                res, post, comb, out, self.cap, self.chunk, self.timeout_ns,
                                self.status_dev.value, self.pdl)

    def _launch(self, x, out) -> None:
        cuda_lib.allreduce(self.lib, self.peers, self.group.world_size, self.group.rank, x, out,
                           self.cap, self.chunk, self.timeout_ns, self.status_dev.value, self.pdl)

    def check(self) -> None:
        """Raise ParallelError if a call so far timed out waiting for a rank (reads host-mapped
        words: no sync; call it after the stream's work is known to be done)."""
        if not self.status_host.value:
            return
        words = (ctypes.c_int * 4).from_address(self.status_host.value)
        if words[0]:
            raise ParallelError(
                f"{self.group.describe()}: the one-shot all-reduce waited {self.timeout_s:g} s "
                f"for rank {words[1]} (epoch {words[2]}, CTA {words[3]}) and gave up; its output "
                f"is NaN. Rank {words[1]} died, stalled, or made a different sequence of "
                f"all-reduces; the run cannot go on")

    def close(self) -> None:
        """Unmap and free (collective: every rank's work on the buffers done first)."""
        torch.cuda.synchronize(self.group.device)
        self.group.barrier()
        self._release()

    def _release(self) -> None:
        lib, dev = self.lib, self.group.device.index
        if lib is None:
            return
        for ptr in self.opened:
            lib.dsv4_ar_close(dev, ptr)
        self.opened = []
        if self.own.value:
            lib.dsv4_ar_free(dev, self.own)
            self.own = ctypes.c_void_p()
        if self.status_host.value:
            lib.dsv4_ar_status_free(self.status_host)
            self.status_host = ctypes.c_void_p()

    def describe(self) -> str:
        return (f"csrc/allreduce.cu, {self.group.world_size} ranks, <= {self.cap >> 10} KB, "
                f"{self.chunk >> 10} KB a CTA")
