"""Layer placement over GPUs: contiguous ranges balanced by weight bytes (checked on the CPU for the
real Flash / Pro tensor tables, including the 8-GPU Pro plan)."""
import itertools
import math
import random

import torch

from dsv4.weights.checkpoint import expected_tensor_table
from graphs import balanced_placement
from dsv4.weights.presets import FLASH, PRO

SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}


def table_bytes(cfg):
    layers, glob = [0] * cfg.n_layers, 0
    for name, (shape, dt) in expected_tensor_table(cfg).items():
        b = math.prod(shape) * SIZE[dt]
        if name.startswith("layers."):
            layers[int(name.split(".")[1])] += b
        elif not name.startswith("mtp."):
            glob += b
    return layers, glob


def loads(placement, layer_bytes, head, devices):
    per = {torch.device(d): 0 for d in devices}
    per[torch.device(devices[0])] += head
    for d, b in zip(placement, layer_bytes):
        per[d] += b
    return per


def contiguous(placement):
    idx = [p.index for p in placement]
    return idx == sorted(idx) and len(set(idx)) == max(idx) + 1


def best_max(layer_bytes, head, k):
    n, best = len(layer_bytes), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        parts = [sum(layer_bytes[a:b]) for a, b in zip(bounds, bounds[1:])]
        parts[0] += head
        best = min(best, max(parts))
    return best


def test_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(30):
        n, k = rng.randint(2, 9), rng.randint(2, 4)
        lb = [rng.randint(1, 100) for _ in range(n)]
        head = rng.randint(0, 80)
        devs = [f"cuda:{i}" for i in range(k)]
        p = balanced_placement(lb, devs, head)
        assert len(p) == n and contiguous(p)
        assert max(loads(p, lb, head, devs).values()) == best_max(lb, head, min(k, n))


def test_flash_on_two_gpus():
    lb, head = table_bytes(FLASH)
    p = balanced_placement(lb, ["cuda:0", "cuda:1"], head)
    per = loads(p, lb, head, ["cuda:0", "cuda:1"])
    assert contiguous(p) and sum(1 for d in p if d.index == 0) in (21, 22)
    assert max(per.values()) < 80 * 2 ** 30                  # each half fits an H200 (139 GiB)
    assert abs(per[torch.device("cuda:0")] - per[torch.device("cuda:1")]) < 4 * 2 ** 30


def test_pro_plan_on_eight_gpus():
    """The nvidia-h200-x8 plan for DeepSeek-V4-Pro (issue 8): 61 layers, one hand-off per GPU
    boundary (7), at most 8 layers (~103.5 GiB) per 139-GiB H200, head and embedding on cuda:0."""
    lb, head = table_bytes(PRO)
    devs = [f"cuda:{i}" for i in range(8)]
    p = balanced_placement(lb, devs, head)
    per = loads(p, lb, head, devs)
    assert contiguous(p) and len({d.index for d in p}) == 8
    handoffs = sum(1 for a, b in zip(p, p[1:]) if a != b)
    assert handoffs == 7
    lower = max((sum(lb) + head) / 8, max(lb))                # no placement can beat this
    assert max(per.values()) <= lower + max(lb)
    assert max(per.values()) < 110 * 2 ** 30
    assert max(sum(1 for d in p if d.index == i) for i in range(8)) == 8


def test_single_device_and_more_devices_than_layers():
    assert balanced_placement([5, 5], ["cpu"]) == [torch.device("cpu")] * 2
    p = balanced_placement([5, 5], ["cuda:0", "cuda:1", "cuda:2"])
    assert contiguous(p) and len(p) == 2
