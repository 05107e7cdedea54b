"""Whether a tensor-parallel step's all-reduces wait for a late rank (skew) or take their time once
every rank is there: from each rank's kernel events of the same profiled step, put on one clock,
the k-th all-reduce of every rank paired and timed against the moments the ranks reached it.

Kineto times the kernels of processes on one host on the host's clock (to about a microsecond),
so rank 0's and rank 1's kernels compare. A rank *arrives* at a call when its input is ready: the
end of its latest-ending kernel that started before the all-reduce kernel and ended before it
(with PDL the all-reduce starts before its predecessor ends and spins in its wait, so its own start
is not the arrival); the all-reduce's start where no kernel precedes it. The early rank then
*waits* (last arrival - its own) and the call *after* the last arrival is its own latency.
All times in microseconds.
"""
from __future__ import annotations

import re
import statistics

# our one-shot / two-shot kernels (allreduce_*_kernel), symmetric memory's (one_shot_all_reduce_*)
# and NCCL's (ncclDevKernel_AllReduce_*, or a generic ncclDevKernel_*): any name with "allreduce",
# "all_reduce" or "nccl", except those naming another collective (the head's all-gather)
ALLREDUCE_NAMES = re.compile(r"^(?!.*(gather|scatter|broadcast|sendrecv)).*(all_?reduce|nccl)",
                             re.IGNORECASE)
NO_CALLS = "no all-reduce kernels in the traces"
# a prefill chunk split by rows (sequence parallel) has no all-reduce in its layers: each sublayer
# all-gathers its input rows and reduce-scatters its partial sums; its calls are every collective
# of every rank (the head's all-gather of logits too), point-to-point and broadcasts left out
COLLECTIVE_NAMES = re.compile(
    r"^(?!.*(broadcast|sendrecv)).*(all_?reduce|reduce_?scatter|all_?gather|nccl)", re.IGNORECASE)
ALLREDUCE, COLLECTIVES = "all-reduce", "collectives"


def on_one_clock(origins_ns: list[int], ranks: list[list[tuple]]) -> list[list[tuple]]:
    """Each rank's events [(start, end, name)], in us after its own profile's start
    (origins_ns[r], ns on the host clock), -> the same in us after rank 0's start. The origins
    are subtracted as integers: us since the epoch in a float would keep only ~0.25 us."""
    out = []
    for origin, events in zip(origins_ns, ranks, strict=True):
        shift = (origin - origins_ns[0]) / 1e3
        out.append([(s + shift, e + shift, name) for s, e, name in events])
    return out


def arrival(events: list[tuple], start: float, end: float) -> float:
    """When a rank's input to the all-reduce kernel [start, end) was ready: the end of the
    latest-ending kernel of `events` that started before `start` and ended before `end`;
    `start` where there is none."""
    ends = [e for s, e, _ in events if s < start and e < end]
    return max(ends, default=start)


def analyze(ranks: list[list[tuple]], what: str = ALLREDUCE) -> dict:
    """ranks[r] = rank r's kernel events [(start, end, name)] of one profiled step, every rank on
    one clock (on_one_clock) -> per all-reduce call (the k-th of every rank paired): `calls`,
    `skew_us` {median, mean} (latest arrival - earliest), `after_us` {median, mean} over ranks
    and calls (own end - latest arrival, at least 0), `wait_us` [rank r's mean of latest arrival
    - own], `kernel_us` {median, mean} (the all-reduce kernels' own durations, as the timeline
    sees them), `last_to_arrive` [calls where rank r arrived last], `ties` (calls with no skew),
    `skew_us_per_call`. No all-reduce kernel: `calls` 0 and `note`. ValueError where the ranks
    have different numbers of all-reduce calls. what=COLLECTIVES: every collective call
    (COLLECTIVE_NAMES), for a prefill split by rows; the result says which in `what`."""
    names = {ALLREDUCE: ALLREDUCE_NAMES, COLLECTIVES: COLLECTIVE_NAMES}[what]
    none = {"calls": 0, "what": what, "note": NO_CALLS if what == ALLREDUCE else
            "no collective kernels in the traces"}
    if not ranks:
        return none
    mine = [sorted(ev for ev in evs if names.search(ev[2])) for evs in ranks]
    counts = [len(m) for m in mine]
    if len(set(counts)) > 1:
        raise ValueError(
            f"{what.rstrip('s')} calls differ across ranks (" +
            ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts)) +
            "): the k-th calls cannot be paired. Are these every rank's events of the same "
            f"profiled step? Kernels that match {names.pattern} (dsv4/bench/comm_skew.py) but "
            "are not a collective of every rank break the pairing too")
    n = counts[0]
    if n == 0:
        return none
    world = len(ranks)
    skews, afters, kernels = [], [], []
    waits = [[] for _ in range(world)]
    last = [0] * world
    ties = 0
    for k in range(n):
        calls = [m[k] for m in mine]
        arr = [arrival(evs, s, e) for evs, (s, e, _) in zip(ranks, calls)]
        latest = max(arr)
        skews.append(latest - min(arr))
        if skews[-1] == 0:
            ties += 1
        else:
            last[arr.index(latest)] += 1
        for r, (s, e, _) in enumerate(calls):
            waits[r].append(latest - arr[r])
            afters.append(max(e - latest, 0.0))
            kernels.append(e - s)
    return {"calls": n, "what": what, "skew_us": _median_mean(skews),
            "after_us": _median_mean(afters),
            "wait_us": [statistics.fmean(w) for w in waits], "kernel_us": _median_mean(kernels),
            "last_to_arrive": last, "ties": ties,
            "skew_us_per_call": [round(x, 2) for x in skews]}


def _median_mean(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs)}


def format_line(sk: dict) -> str:
    """One log line: the calls, their skew, their time after the last arrival, each rank's wait
    and who arrived last; the note or the refusal where there is no comparison."""
    head = f"{sk.get('what', ALLREDUCE)} across ranks"
    if "error" in sk:
        return f"{head}: not compared: {sk['error']}"
    if not sk["calls"]:
        return f"{head}: {sk['note']}"
    sw, af = sk["skew_us"], sk["after_us"]
    waits = " / ".join(f"r{r} {w:.1f}" for r, w in enumerate(sk["wait_us"]))
    last = ", ".join(f"r{r} {c}" for r, c in enumerate(sk["last_to_arrive"]))
    tied = f", tied {sk['ties']}" if sk["ties"] else ""
    return (f"{head}: {sk['calls']} calls, kernel median "
            f"{sk['kernel_us']['median']:.1f} us, skew median {sw['median']:.1f} us (mean "
            f"{sw['mean']:.1f}), after the last arrival {af['median']:.1f} us, waits {waits} us, "
            f"last to arrive: {last}{tied}")
