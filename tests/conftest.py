"""Shared fixtures: the ../shared data folder (skip when absent) and CUDA gating."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DSV4_SHARED", REPO.parent / "shared"))


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
