"""Kernel-level profile of captured prefill chunks (dsv4.runtime.prefill_graphs) on random tokens.

Flash shapes, the first L layers, device-generated weights, one GPU: for each chunk size S the
replay time (median of 5, state reset between), the same replay on token id 0 repeated, and one
profiled replay's kernels by summed device time (torch.profiler). Writes prof.json to OUT.
Run: `L=30 SIZES=1,2,16,128 TOP=25 OUT=. python scripts/profile_prefill_chunks.py` (CUDA only;
DSV4_SPLIT_PROGRAMS changes the split-K target of the prefill GEMMs).
"""
import json
import os
import statistics
import time

import torch

from dsv4.bench.common import kernel_table
from dsv4.runtime.build import build_model
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.prefill_graphs import _ChunkGraphs
from dsv4.weights.device_weights import DeviceWeights
from dsv4.weights.presets import get_preset

L = int(os.environ.get("L", "30"))
sizes = [int(s) for s in os.environ.get("SIZES", "1,2,16,128").split(",")]
out = os.environ.get("OUT", ".")
cfg = get_preset("flash", L)
dev = torch.device("cuda:0")
model = build_model(cfg, RuntimeConfig(4352, torch.bfloat16, (dev,)))
t = time.perf_counter()
model.load(DeviceWeights(cfg, 0)); torch.cuda.synchronize()
print(f"load {time.perf_counter()-t:.1f}s", flush=True)
rep = {}
for S in sizes:
    t = time.perf_counter()
    with torch.inference_mode():
        c = _ChunkGraphs(model, S, "x")
    gib = sum(c.decoder.graph_bytes.values()) / 2**30
    print(f"S={S} built {time.perf_counter()-t:.1f}s eager {c.eager_ms:.1f} replay {c.replay_ms:.1f} "
          f"(random tokens); graph pool {gib:.2f} GiB, peak allocated "
          f"{torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB", flush=True)
    gen = torch.Generator().manual_seed(S)
    ids = torch.randint(0, cfg.vocab_size, (S,), generator=gen).to(dev)
    with torch.inference_mode():
        ms = []
        for i in range(5):
            model.reset()
            torch.cuda.synchronize()
            t = time.perf_counter()
            c.decoder.step(ids=ids, start=0)
            torch.cuda.synchronize()
            ms.append(1e3 * (time.perf_counter() - t))
        zms = []
        for i in range(3):
            torch.cuda.synchronize(); t = time.perf_counter()
            c.decoder.step(ids=torch.zeros_like(ids), start=0); torch.cuda.synchronize()
            zms.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter(); model.reset(); torch.cuda.synchronize(); rms = 1e3 * (time.perf_counter() - t)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            c.decoder.step(ids=ids, start=0)
            torch.cuda.synchronize()
    rows = kernel_table(prof, 90)
    tot = sum(r[2] for r in rows)
    print(f"S={S}: replay random {statistics.median(ms):.2f} ms {[round(m,1) for m in ms]}, zeros {statistics.median(zms):.2f}, reset {rms:.2f}; "
          f"profiled kernels {sum(r[1] for r in rows)}, device sum {tot:.2f} ms", flush=True)
    for r in rows[:int(os.environ.get("TOP", "25"))]:
        print(f"   {r[2]:9.3f} {r[1]:6d} {r[0]}")
    rep[S] = {"replay_random": ms, "replay_zero": zms, "reset_ms": rms, "rows": rows}
    del c
    torch.cuda.empty_cache()
json.dump(rep, open(os.path.join(out, "prof.json"), "w"), indent=1)
