"""What a decode token reads and what a benchmark run needs: the bytes per token by component
(the byte floor's numerator), per-layer weight / state sizes of a model on the meta device, and
the memory check that refuses a run before any weight is generated (naming the fixes).
"""
from __future__ import annotations

import torch

from graphs import balanced_placement

from ..errors import DeviceError
from ..model.transformer import Transformer

GIB = 2**30
ATTN_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")


def _nb(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def token_bytes(model: Transformer, context: int) -> dict[str, int]:
    """Bytes one decode token at position `context` reads, by component, from the model's tensors.

    Per layer: attention linears (+ scales), norms/sink, mHC, compressor, indexer, router (gate +
    bias, or the token's tid2eid row), k/E of the expert bank, the shared expert; KV: window rows
    min(W, L+1), compressed rows visible at L ((L+1)//r; ratio 4: min(topk, (L+1)//4) attended
    plus all (L+1)//4 index-cache rows). Plus the LM head, one embedding row, final norm, hc_head.
    """
    cfg, L = model.cfg, context
    k = cfg.n_activated_experts
    out = dict.fromkeys(("attention", "routed_experts", "shared_expert", "compressor", "indexer",
                         "mhc", "router", "norms", "head", "embed_row", "final_norm_hc_head",
                         "kv_window", "kv_compressed", "index_cache"), 0)
    for blk, st in zip(model.layers, model.states):
        a, f, r = blk.attn, blk.ffn, blk.ratio
        out["attention"] += sum(_nb(*getattr(a, n).tensors("").values()) for n in ATTN_LINEARS)
        out["norms"] += _nb(blk.attn_norm, blk.ffn_norm, a.q_norm, a.kv_norm, a.attn_sink)
        out["mhc"] += _nb(*blk.hc.values())
        if a.compressor is not None:
            out["compressor"] += _nb(*a.compressor.tensors("").values())
        if a.indexer is not None:
            out["indexer"] += _nb(*a.indexer.tensors("").values())
        out["router"] += _nb(*f.gate.tensors("").values()) + (
            k * f.tid2eid.element_size() if f.hash else _nb(f.bias))
        bank = f.experts
        stack = [getattr(bank, n) for n in ("w1", "w1_scale", "w2", "w2_scale", "w3", "w3_scale")]
        out["routed_experts"] += _nb(*(t for t in stack if t is not None)) * k // bank.n_experts
        out["shared_expert"] += sum(_nb(*lin.tensors("").values()) for lin in f.shared.values())
        row = st.kv_cache.shape[1] * st.kv_cache.element_size()
        out["kv_window"] += min(cfg.window_size, L + 1) * row
        visible = (L + 1) // r if r else 0
        if r == 4:
            out["kv_compressed"] += min(cfg.index_topk, visible) * row
            out["index_cache"] += visible * st.index_cache.shape[1] * st.index_cache.element_size()
        elif r:
            out["kv_compressed"] += visible * row
    out["head"] = _nb(model.head)
    out["embed_row"] = model.embed.shape[1] * model.embed.element_size()
    out["final_norm_hc_head"] = _nb(model.norm, *model.hc_head.values())
    return out


def rank_token_bytes(cfg, tp: int, context: int, dtype: torch.dtype = torch.bfloat16
                     ) -> dict[str, int]:
    """token_bytes of one rank of a tensor-parallel run over `tp` ranks (rank 0's shard, built
    on the meta device from the shapes; every rank reads as much, the head's last rank up to one
    pad row less): each rank reads its heads' wq_b / wo_a / wo_b, its inter slice of the k
    experts and of the shared expert and its vocabulary rows of the head; the replicated rest
    (wq_a, wkv, compressors, indexer, gate, mHC, norms, KV) whole. tp = 1: one process."""
    from ..runtime.config import RuntimeConfig
    meta = Transformer(cfg, RuntimeConfig(context + 1, dtype, ("meta",), tp=tp))
    return token_bytes(meta, context)


def tp_floor_table(cfg, degrees, context: int, copy_tb_s: float | None = None) -> list[dict]:
    """Per degree tp: the bytes each rank reads per decode token (`bytes_per_rank`, its
    `by_component`), the part of them every rank reads whole (`replicated` = R, from one
    process's T1 = R + S and a rank's Ttp = R + S / tp) and, given a copy bandwidth in TB/s, the
    byte floor in ms (the ranks read at once: a rank's bytes over one GPU's bandwidth; the
    collectives not counted)."""
    t1 = sum(rank_token_bytes(cfg, 1, context).values())
    rows = []
    for tp in degrees:
        b = rank_token_bytes(cfg, tp, context)
        total = sum(b.values())
        split = (t1 - total) * tp // (tp - 1) if tp > 1 else 0
        row = {"tp": tp, "bytes_per_rank": total, "replicated": t1 - split, "by_component": b}
        if copy_tb_s:
            row["floor_ms"] = total / (copy_tb_s * 1e12) * 1e3
        rows.append(row)
    return rows


# ---- memory -----------------------------------------------------------------------------------

DEQUANT_FP4 = 21   # peak bytes per value while dequantizing FP4: uint8 + 2 x int64 codes + float32
DEQUANT_FP8 = 10   # FP8: float32 copy, float32 product, the activation-dtype result

def layer_sizes(meta: Transformer) -> dict:
    """Per-layer weight / state bytes and largest float32 master DeviceWeights makes (FP4: two
    values per byte), the dequantized copies a CPU run keeps (`dense`, in the activation dtype),
    plus the globals (embed, head, norms), of a model on the meta device."""
    def master(ts):
        return max((t.numel() * (8 if t.dtype == torch.int8 else 4) for t in ts), default=0)
    glob = [meta.embed, meta.head, meta.norm, *meta.hc_head.values()]
    layers = [blk.tensors("").values() for blk in meta.layers]
    return {"weights": [_nb(*ts) for ts in layers], "master": [master(ts) for ts in layers],
            "dense": [dense_bytes(blk, meta.act)[0] for blk in meta.layers],
            "dequant": [dense_bytes(blk, meta.act)[1] for blk in meta.layers],
            "state": [st.nbytes() for st in meta.states], "global": _nb(*glob),
            "global_master": master(glob)}


def dense_bytes(blk, act: torch.dtype) -> tuple[int, int]:
    """(kept, transient) bytes of the dequantized weights a CPU model caches for block `blk`
    (Transformer keeps dense copies on the CPU, where op overhead dominates): every weight stored
    in another dtype than `act`, at `act`'s element size (an FP4 byte holds two values); and the
    peak temporaries of dequantizing the largest one (dsv4.weights.formats: FP4 goes through int64 codes
    and float32 values, ~DEQUANT_FP4 bytes per value; FP8 through float32, ~DEQUANT_FP8)."""
    size, kept, peak = torch.empty((), dtype=act).element_size(), 0, 0
    for w in blk.weights():
        for name in ("w1", "w2", "w3") if hasattr(w, "w1") else ("weight",):
            t = getattr(w, name)
            if t.dtype == act:
                continue
            n = t.numel() * (2 if t.dtype == torch.int8 else 1)
            kept += n * size
            peak = max(peak, n * (DEQUANT_FP4 if t.dtype == torch.int8 else DEQUANT_FP8))
    return kept, peak


def memory_estimate(sizes: dict, n_layers: int, devices, reserve: int):
    """(placement, {device: {weights, dense, state, reserve, total}}) for the first n_layers;
    reserve: per-device workspace on top of the largest float32 master generated there (on the
    CPU, or of the largest dequantization's temporaries if larger); dense: the CPU's dequantized
    copies."""
    placement = balanced_placement(sizes["weights"][:n_layers], devices, sizes["global"])
    est = {str(d): {"weights": 0, "dense": 0, "state": 0, "reserve": reserve} for d in devices}
    master = dict.fromkeys(est, 0)
    for l, d in enumerate(map(str, placement)):
        est[d]["weights"] += sizes["weights"][l]
        est[d]["state"] += sizes["state"][l]
        master[d] = max(master[d], sizes["master"][l])
        if torch.device(d).type == "cpu":       # the CPU keeps dequantized copies as well
            est[d]["dense"] += sizes["dense"][l]
            master[d] = max(master[d], sizes["dequant"][l])
    head = str(torch.device(devices[0]))
    est[head]["weights"] += sizes["global"]
    master[head] = max(master[head], sizes["global_master"])
    for d, e in est.items():
        e["reserve"] += master[d]
        e["total"] = e["weights"] + e["dense"] + e["state"] + e["reserve"]
    return placement, est


def free_memory(device: torch.device) -> int | None:
    """Free bytes on `device` for this process, None if unknown. CUDA: the driver's free count plus
    what this process's caching allocator holds unused (its own earlier tensors, freed: the next
    allocations take it first); CPU: MemAvailable."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(meta: Transformer, n_layers: int, devices, reserve: int, capacity: int):
    """Placement and estimate for the run; DeviceError naming the device and the fixes when the
    estimate exceeds the free memory of any device."""
    sizes = layer_sizes(meta)
    placement, est = memory_estimate(sizes, n_layers, devices, reserve)
    free = {str(d): free_memory(torch.device(d)) for d in devices}
    over = [d for d, e in est.items() if free[d] is not None and e["total"] > free[d]]
    if not over:
        return placement, est
    fits = 0
    for n in range(n_layers, 0, -1):
        _, e_n = memory_estimate(sizes, n, devices, reserve)
        if all(free[d] is None or e["total"] <= free[d] for d, e in e_n.items()):
            fits = n
            break
    d, e = over[0], est[over[0]]
    more = (f"--layers {fits} (the most that fit here)" if fits else
            "fewer --layers (not even one layer fits)")
    cpu = torch.device(d).type == "cpu"
    dense = (f" + dequantized copies {e['dense'] / GIB:.1f}" if e["dense"] else "")
    temps = "dequantization" if cpu else "weight generation"
    raise DeviceError(
        f"{d} needs an estimated {e['total'] / GIB:.1f} GiB (weights {e['weights'] / GIB:.1f}"
        f"{dense} + state {e['state'] / GIB:.2f} at capacity {capacity} + reserve "
        f"{e['reserve'] / GIB:.1f}: --reserve-gib {reserve / GIB:g} and the largest {temps}'s "
        f"temporaries) but has {free[d] / GIB:.1f} GiB "
        f"{'host memory available (MemAvailable)' if cpu else 'free'}. Fix: {more}, more "
        f"devices (--device cuda:0,cuda:1), or a smaller --context; escape hatch: --reserve-gib 0")
