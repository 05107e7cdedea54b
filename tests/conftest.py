"""Shared fixtures: the ../shared data folder (skip when absent) and CUDA gating."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
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
def no_fake_quant(monkeypatch):
    """Fake-quant off: a 1e-7 difference can flip one e4m3/e2m1 rounding, which moves logits by
    ~1e-4; with it off, differently batched computations must agree to float32 noise."""
    from helpers import disable_fake_quant
    disable_fake_quant(monkeypatch.setattr)
