"""`dsv4 bench --parallel tp`: the decode benchmark of a tensor-parallel model, one process a
device (dsv4.parallel.launch), each rank its shard of the preset on device-generated weights
(the same shard a sliced checkpoint load gives), the state filled to the context, then the same
eager / graph steps timed on every rank (the all-reduces keep them in lockstep). Reported: rank
0's ms per token (and every rank's), each rank's bytes per token and byte floor at its measured
copy bandwidth, the head/embed share and the extrapolation to the preset's full depth as in the
one-process benchmark (dsv4.bench.decode), the all-reduce plan and the communication a layer;
with --prefill the time to first token of each prompt length (every rank prefilling it), and
with --prefill-profile (CUDA) one profiled prefill a rank (the ranks start it together): rank 0's
kernels by device time; with --trace PREFIX each rank's profiled graph step as a Chrome trace,
PREFIX-rank<r>-graph-<granularity>.json, and the ranks' all-reduce calls of that step compared on
the host's clock (dsv4.bench.comm_skew); with both, the profiled prefill's too
(PREFIX-rank<r>-prefill<n>.json, its collective calls compared: `collective_skew` of the prefill
row: a chunk split by rows all-gathers and reduce-scatters where an unsplit one all-reduces);
with --speculative (every rank's MTP block built) the speculative mechanism's measurements
(dsv4.bench.speculative: verify T = 1..4, the speculative step, end to end with an oracle
drafting), every rank running the same sessions: rank 0's figures, every rank's verify times;
with --layer-kernels (CUDA) every rank the same layers' ops alone and whole (layer_kernels), rank
0's shard reported; with --prefill-graphs N (CUDA) every rank's prefill chunk graphs, built
together and planned alike (dsv4.runtime.prefill_graphs.agreed_ms): each prompt's TTFT through
them and as eager chunks only.
"""
from __future__ import annotations

import time

import torch

from ..errors import DeviceError, InputError
from ..runtime.config import DTYPES, RuntimeConfig, resolve_tp_devices
from ..weights.presets import get_preset
from . import MIN_STEPS
from . import comm_skew
from . import prefill as bench_prefill
from . import speculative as bench_spec
from .common import _log, _versions, copy_bandwidth, fill_state
from .decode import EXTRAPOLATION, _plan, checked_capacity, measure, title_line
from .memory import token_bytes

ALLREDUCES_PER_LAYER = 2    # attention's output and the MoE's (dsv4.model.sharding.reduce)


def run(args, command: str = "") -> dict:
    """The benchmark for parsed `args` with --parallel tp; the report (JSON-ready)."""
    from ..model.sharding import split_problems
    from ..parallel import launch
    devices = resolve_tp_devices(args.device)
    on_cuda = devices[0].startswith("cuda")
    modes, grans, lengths, notes = _plan(args, on_cuda)
    if args.prefill_kernels == "off":
        raise InputError("--prefill-kernels off with --parallel tp: not measured in tensor-"
                         "parallel mode yet; run it in one process (--parallel pipeline)")
    if args.layer_kernels and not on_cuda:
        raise DeviceError("--layer-kernels needs CUDA devices")
    if args.prefill_graphs and not on_cuda:
        raise InputError(f"--prefill-graphs {args.prefill_graphs}: chunk graphs are CUDA graphs, "
                         f"the ranks are on {','.join(devices)}; use --prefill-graphs 0")
    profile = bool(args.prefill_profile and lengths and on_cuda)
    if args.prefill_profile and lengths and not on_cuda:
        notes.append("--prefill-profile: a CUDA profile; not taken on the CPU")
    full, cfg = get_preset(args.preset), get_preset(args.preset, args.layers)
    problems = split_problems(cfg, len(devices))
    if problems:
        raise InputError(f"--parallel tp --device {','.join(devices)}: --preset {args.preset} "
                         f"cannot be split over {len(devices)} ranks: {'; '.join(problems)}")
    spec_len = [bench_spec.PROMPT + args.spec_tokens + 2] if args.speculative else []
    job = {"cfg": cfg, "full": full, "capacity": checked_capacity(args, cfg, lengths + spec_len),
           "context": args.context, "steps": args.steps,
           "warmup": args.warmup, "seed": args.seed, "dtype": args.dtype, "modes": modes,
           "grans": grans, "kernels": not args.no_kernels, "lengths": lengths,
           "prefill_reps": args.prefill_reps, "prefill_chunk": args.prefill_chunk,
           "prefill_profile": profile, "prefill_graphs": args.prefill_graphs, "trace": args.trace,
           "speculative": bool(args.speculative), "spec_tokens": args.spec_tokens,
           "layer_kernels": args.layer_kernels, "layer_rows": args.layer_rows}
    t0 = time.perf_counter()
    ranks = launch(_rank, devices, job)
    r0 = ranks[0]
    runs = r0["runs"]
    for i, r in enumerate(runs):
        r["ratio_to_floor"] = r["ms_per_token"] / r0["floor_ms"] if r0["floor_ms"] else None
        r["extrapolated_ms"] = r["per_layer_ms"] * full.n_layers + r["head_embed_ms"]
        r["allreduce_skew"] = allreduce_skew([q["step_events"][i] for q in ranks],
                                             f"{r['mode']}/{r['granularity']}")
    for i, n in enumerate(lengths):   # --prefill-profile --trace: the prefill's collective calls
        profs = [q["prefill"][i].get("profile") for q in ranks]
        if all(p is not None and "events" in p for p in profs):
            ranks[0]["prefill"][i]["collective_skew"] = allreduce_skew(
                [{"events": p.pop("events"), "origin_ns": p.pop("origin_ns")} for p in profs],
                f"prefill {n}", comm_skew.COLLECTIVES)
    partial = cfg.n_layers < full.n_layers
    graph = next((r for r in runs if r["mode"] == "graph"), None)
    eager = next((r for r in runs if r["mode"] == "eager"), None)
    return {"preset": args.preset, "layers": cfg.n_layers, "full_layers": full.n_layers,
            "partial": partial, "parallel": "tp", "world": len(devices), "devices": devices,
            "context": args.context, "capacity": r0["capacity"], "steps": args.steps,
            "warmup": args.warmup, "dtype": args.dtype, "seed": args.seed, "mode": args.mode,
            "granularity": args.granularity,
            "eager_ms_per_token": eager["ms_per_token"] if eager else None,
            "graph_ms_per_token": graph["ms_per_token"] if graph else None,
            "bytes_per_token_per_rank": [r["bytes"] for r in ranks],
            "floor_ms_per_rank": [r["floor_ms"] for r in ranks],
            "copy_TBps_per_rank": [r["copy_TBps"] for r in ranks],
            "ms_per_token_per_rank": [[x["ms_per_token"] for x in r["runs"]] for r in ranks],
            "allreduce": r0["allreduce"], "runs": runs,
            "prefill_runs": _prefill_rows(ranks) if lengths else None,
            "prefill_chunk": r0["prefill_chunk"], "prefill_graphs": r0["prefill_graphs"],
            # the decode all-reduces: two a layer (attention's wo_b, the MoE's down), each of one
            # token's [dim] bf16 partial; their latency alone in a graph (the slowest rank's)
            "allreduce_us": (max(r["allreduce_us"] for r in ranks)
                             if r0["allreduce_us"] is not None else None),
            "allreduces_per_layer": ALLREDUCES_PER_LAYER,
            "extrapolated": {"method": EXTRAPOLATION, "layers": full.n_layers} if partial else None,
            **(_spec_report(ranks) if args.speculative else {}),
            # rank 0's shard: each op alone and the layer whole (its all-reduces wait for the
            # other ranks, which replay the same layer alike)
            "layer_kernels": r0["layer_kernels"],
            "load_s": r0["load_s"], "wall_s": time.perf_counter() - t0, **r0["versions"],
            "command": command, "valid": on_cuda and args.steps >= MIN_STEPS, "notes": notes}


def _rank(group, job: dict) -> dict:
    """One rank: its shard built and filled, the same measurements as every other rank."""
    from ..runtime.build import build_model
    from ..runtime.tp import cpu_share, rank_communicator, rank_runtime
    from ..weights.device_weights import DeviceWeights
    dev = group.device
    if dev.type == "cpu":
        torch.set_num_threads(cpu_share(group.world_size))
    cfg = job["cfg"]
    cap = job["capacity"]
    rt = rank_runtime(RuntimeConfig(cap, DTYPES[job["dtype"]], (str(dev),),
                                    mtp=job["speculative"]), group)
    comm = rank_communicator(group, rt, cfg)     # as the runtime's ranks
    model = build_model(cfg, rt, comm=comm)
    t0 = time.perf_counter()
    model.load(DeviceWeights(cfg, job["seed"]))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    load_s = time.perf_counter() - t0
    copy = copy_bandwidth(dev) if dev.type == "cuda" else None
    nbytes = sum(token_bytes(model, job["context"]).values())
    runs, steps = [], []
    for mode in job["modes"]:
        for g in job["grans"] if mode == "graph" else job["grans"][:1]:
            if group.rank == 0:
                _log(f"measuring {mode}" + (f"/{g}" if mode == "graph" else "") +
                     f" on {group.world_size} ranks")
            fill_state(model, job["context"], job["seed"])
            got = {} if job["trace"] else None     # the profiled step's kernels: comm_skew's
            runs.append(measure(model, mode, g, job["context"], job["steps"], job["warmup"],
                                job["seed"], kernels=job["kernels"] and mode == "graph",
                                trace=job["trace"] and f"{job['trace']}-rank{group.rank}",
                                log=_log if group.rank == 0 else lambda line: None,
                                meet=group.barrier, step_events=got))
            steps.append(got or None)
    prefill, pg = [], None
    if job["prefill_graphs"] and job["lengths"]:    # built by every rank together (agreed_ms)
        from ..runtime.prefill_graphs import PrefillGraphs
        if group.rank == 0:
            _log(f"capturing prefill chunk graphs up to {job['prefill_graphs']} tokens on "
                 f"{group.world_size} ranks")
        pg = model.prefill_graphs = PrefillGraphs(model, job["prefill_graphs"])
    for n in job["lengths"]:      # every rank the same prompts: the all-reduces keep them in step
        if group.rank == 0:
            _log(f"prefill {n} tokens on {group.world_size} ranks")
        r = bench_prefill.measure(model, n, job["prefill_reps"], job["seed"], job["prefill_chunk"])
        row = {k: r[k] for k in ("tokens", "ttft_ms", "spread_ms", "tok_per_s", "graphs",
                                 "eager_ttft_ms", "replay_ttft_ms", "host_issue_ms",
                                 "host_cpu_ms", "host_switches")}
        if job["prefill_profile"]:   # every rank profiles the same prefills (their collectives),
            # starting together (the group's barrier inside the profile); with --trace each rank's
            # trace and its kernels for comm_skew
            tr = job["trace"]
            row["profile"] = bench_prefill.profile(
                model, n, job["seed"], job["prefill_chunk"], meet=group.barrier,
                trace=tr and f"{tr}-rank{group.rank}-prefill{n}.json", events=bool(tr))
        prefill.append(row)
    graphs = None if pg is None else {"max_rows": pg.max_rows, "capture_s": pg.capture_s,
                                      "graph_bytes": pg.graph_bytes(),
                                      "built_replay_ms": pg.replay_ms,
                                      "built_eager_ms": pg.eager_ms}
    # released before the group closes: NCCL's teardown waits for every graph that captured one
    # of its collectives (a chunk's all-reduces past the one-shot's bytes)
    model.prefill_graphs = pg = None
    spec = None
    if job["speculative"]:        # every rank the same sessions and oracle: the same tokens
        graph = next((r for r in runs if r["mode"] == "graph"), None)
        spec = bench_spec.run(model, job["context"], job["seed"],
                              graph["ms_per_token"] if graph else None,
                              _log if group.rank == 0 else lambda line: None,
                              reps=min(bench_spec.REPS, job["steps"]), n_new=job["spec_tokens"])
    lks = None
    if job["layer_kernels"]:     # every rank the same replays: the layer's all-reduces meet
        from . import layer_kernels as lk
        fill_state(model, job["context"], job["seed"])
        lks = []
        for l in lk.representative_layers(model):
            if group.rank == 0:
                _log(f"layer {l}: each kernel alone, then the layer whole, on "
                     f"{group.world_size} ranks")
            group.barrier()
            lks.append(lk.layer_kernels(model, l, job["context"], copy, rows=job["layer_rows"]))
    ar_us = comm_latency_us(group, comm, cfg.dim) if dev.type == "cuda" else None
    comm.check()
    out = {"rank": group.rank, "runs": runs, "bytes": nbytes, "copy_TBps": copy,
           "allreduce_us": ar_us, "prefill": prefill, "prefill_graphs": graphs,
           "prefill_chunk": job["prefill_chunk"] or model.rt.prefill_chunk,
           "floor_ms": nbytes / (copy * 1e12) * 1e3 if copy else None, "capacity": cap,
           "load_s": load_s, "allreduce": comm.table(), "versions": _versions([dev]),
           "spec": spec, "step_events": steps, "layer_kernels": lks}
    comm.close()
    return out


def allreduce_skew(steps: list, name: str, what: str = comm_skew.ALLREDUCE) -> dict | None:
    """Every rank's profiled step of one run (measure's step_events: None where no step was
    profiled: --trace not given, eager, --no-kernels, the CPU) -> comm_skew's comparison of their
    all-reduce calls (`what`=COLLECTIVES: every collective's) (with `error` where the ranks'
    calls do not pair), logged as one line; None without every rank's step."""
    if any(s is None for s in steps):
        return None
    try:
        if any(s["origin_ns"] is None for s in steps):
            raise ValueError("this torch's profiler does not say when its trace started "
                             "(kineto_results.trace_start_ns): the ranks' clocks do not line up")
        sk = comm_skew.analyze(comm_skew.on_one_clock([s["origin_ns"] for s in steps],
                                                      [s["events"] for s in steps]), what)
    except ValueError as e:    # a diagnostic: the run's measurements stand without it
        sk = {"error": str(e), "what": what}
    _log(f"{name}: {comm_skew.format_line(sk)}")
    return sk


def _spec_report(ranks: list) -> dict:
    """--speculative: rank 0's measurements (dsv4.bench.speculative's keys), its verify times
    beside every rank's, and whether every rank decoded plain decoding's tokens."""
    r0 = ranks[0]["spec"]
    return {**r0, "spec_verify_ms_per_rank": [r["spec"]["spec_verify_ms"] for r in ranks],
            "spec_same_tokens": all(r["spec"]["spec_same_tokens"] for r in ranks)}


def _prefill_rows(ranks: list) -> list[dict]:
    """Each prompt length's prefill: rank 0's time to first token and tok/s, and every rank's
    TTFT (they finish together: each layer's all-reduces wait for the slowest) and host issue
    (measure's: wall, thread CPU, involuntary switches); with a profile, rank 0's (its top
    kernels) and every rank's device time and host issue time."""
    rows = []
    for i, r0 in enumerate(ranks[0]["prefill"]):
        row = {**r0, "ttft_ms_per_rank": [r["prefill"][i]["ttft_ms"] for r in ranks],
               "host_per_rank": [{k: r["prefill"][i][k] for k in
                                  ("host_issue_ms", "host_cpu_ms", "host_switches")}
                                 for r in ranks]}
        if "profile" in r0:
            row["profile_per_rank"] = [{k: r["prefill"][i]["profile"][k] for k in
                                        ("kernels", "device_ms", "host_issue_ms",
                                         "device_span_ms")} for r in ranks]
        rows.append(row)
    return rows


def comm_latency_us(group, comm, dim: int) -> float:
    """The latency of one decode all-reduce (a token's [dim] bf16 partial, as TensorParallel
    .reduce sends it) inside a CUDA graph of back-to-back all-reduces (bench_comm's method),
    through the rank's own planned all-reduce; the slowest rank's is reported."""
    from .comm import _graph_us
    x = torch.randn(dim, device=group.device).to(torch.bfloat16)
    return _graph_us(group, comm.allreduce, x, torch.empty_like(x), 20)


def format_table(rep: dict) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [title_line(rep, f"tensor parallel over {rep['world']}: {','.join(rep['devices'])}"),
             "bytes/token a rank " + ", ".join(f"{b / 1e9:.3f} GB" for b in
                                              rep["bytes_per_token_per_rank"]) +
             " | floor a rank " + ", ".join(f(x, ".3f") + " ms" for x in rep["floor_ms_per_rank"]),
             "all-reduce: " + ", ".join(f"{k} {v}" for k, v in rep["allreduce"].items()),
             ("communication a layer: -" if rep["allreduce_us"] is None else
              f"communication a layer: {rep['allreduces_per_layer']} all-reduces x "
              f"{rep['allreduce_us']:.2f} us = "
              f"{rep['allreduces_per_layer'] * rep['allreduce_us']:.2f} us (alone, in a graph)"),
             f"{'run':<16}{'ms/token':>10}{'min-max':>18}{'tok/s':>9}{'x floor':>9}"
             f"{'head+embed':>12}{'per layer':>11}" + (f"{'extrap. ms':>12}" if rep["partial"]
                                                       else "")]
    for r in rep["runs"]:
        name = r["mode"] + (f"/{r['granularity']}" if r["granularity"] else "")
        lo, hi = r["spread_ms"]
        lines.append(f"{name:<16}{r['ms_per_token']:>10.3f}{f'{lo:.3f}-{hi:.3f}':>18}"
                     f"{r['tokens_per_s']:>9.1f}{f(r['ratio_to_floor'], '.2f'):>9}"
                     f"{r['head_embed_ms']:>12.3f}{r['per_layer_ms']:>11.4f}" +
                     (f"{r['extrapolated_ms']:>12.3f}" if rep["partial"] else ""))
    pg = rep.get("prefill_graphs")
    if pg and rep["prefill_runs"]:
        lines.append(f"prefill chunk graphs 1..{pg['max_rows']} on every rank (rank 0: capture "
                     f"{pg['capture_s']:.1f} s, {pg['graph_bytes'] / 2**30:.2f} GiB; the plan's "
                     f"times of {pg['max_rows']} rows, the slowest rank's when built: replay "
                     f"{f(pg['built_replay_ms'].get(pg['max_rows']), '.1f')} / eager "
                     f"{f(pg['built_eager_ms'].get(pg['max_rows']), '.1f')} ms)")
    for p in rep["prefill_runs"] or []:
        lo, hi = p["spread_ms"]
        eager = (f"; eager chunks only {p['eager_ttft_ms']:.1f} ms"
                 if p.get("eager_ttft_ms") is not None else "")
        if p.get("replay_ttft_ms") is not None:
            eager += f"; chunk graphs only {p['replay_ttft_ms']:.1f} ms"
        lines.append(f"prefill {p['tokens']} tokens: TTFT {p['ttft_ms']:.1f} ms "
                     f"[{lo:.1f}-{hi:.1f}] ({p['tok_per_s']:.0f} tok/s; chunk "
                     f"{rep['prefill_chunk']}{'; replays chunk graphs' if p.get('graphs') else ''}"
                     f"{eager}), every rank: "
                     + ", ".join(f"{t:.1f}" for t in p["ttft_ms_per_rank"]) + " ms")
        if p.get("host_per_rank"):
            lines.append("  host issue of the plan's prefills (wall ms, the thread's CPU ms, "
                         "involuntary switches; medians): " + "; ".join(
                             f"rank {i}: {h['host_issue_ms']:.1f}, {h['host_cpu_ms']:.1f}, "
                             f"{f(h['host_switches'], '.0f')}"
                             for i, h in enumerate(p["host_per_rank"])))
        if "profile" in p:
            lines.append("  profile (one prefill a rank; kernels, their device ms, host issue ms, "
                         "device span ms): " + "; ".join(
                             f"rank {i}: {q['kernels']}, {q['device_ms']:.1f}, "
                             f"{q['host_issue_ms']:.1f}, {q['device_span_ms']:.1f}"
                             for i, q in enumerate(p["profile_per_rank"])))
            lines.append("  rank 0's kernels by device time:")
            lines += [f"  {ms:9.3f} ms {c:6d}x {name}" for name, c, ms in p["profile"]["top"]]
    if rep.get("layer_kernels"):
        from .layer_kernels import format_rows
        lines.append("rank 0's shard, each op alone and the layer whole:")
        for lk in rep["layer_kernels"]:
            lines += format_rows(lk)
    for n in rep["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)
