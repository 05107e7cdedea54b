"""Shared test helpers: small synthetic checkpoints written once per session."""
from __future__ import annotations

from pathlib import Path

import torch

from dsv4.weights.presets import TINY, truncate_layers

# TINY's architecture (hash layer, window-only, ratio 4 + indexer, ratio 16, MTP) at vocab 2048
SMALL = TINY.replace(vocab_size=2048)
# SMALL's first three layers, one of each kind (SMALL's fourth is a second ratio-4 layer with the
# indexer) and the MTP block: for tests whose time is the model's steps
SMALL3 = truncate_layers(SMALL, 3)
_KINDS = (SMALL3.compress_ratios, SMALL3.n_hash_layers, SMALL3.n_mtp_layers)
assert _KINDS == ((0, 4, 16, 0), 1, 1), _KINDS        # ratios (the MTP block's last), hash, MTP


def small_checkpoint(root: Path, weights: str = "fp8", cfg=SMALL, seed: int = 0) -> Path:
    from dsv4.weights.synthetic import write_checkpoint
    out = root / f"small-{weights}-{seed}"
    if not (out / "config.json").exists():
        write_checkpoint(cfg, out, weights=weights, seed=seed, shards=2)
    return out


def once_per_run(tmp_path_factory, name: str, make):
    """make() -> a JSON-able value, computed once per test run and shared by every pytest-xdist
    worker (a module fixture runs again on each worker its tests land on): kept as name.json in
    the run's temporary root, which the workers share, made under a lock by the first worker
    that asks (the others wait for it). A failure is not kept: the next to ask tries again."""
    import fcntl
    import json
    import os
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                       # popen-gw<i>'s parent: this run's, shared
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return json.loads(path.read_text())
        value = make()
        path.write_text(json.dumps(value))
        return value


def disable_fake_quant(setattr_fn=setattr) -> None:
    """The KV fake-quant off (conftest's no_fake_quant; a test server's launcher): the FP8 / FP4
    roundings of the cached KV and index entries become identities."""
    import dsv4.model.attention as A
    import dsv4.model.compressor as C
    import dsv4.model.indexer as I
    ident = lambda x, block, out_dtype=None: x  # noqa: E731
    for mod, name in ((A, "fp8_quant_dequant"), (C, "fp8_quant_dequant"),
                      (C, "fp4_quant_dequant"), (I, "fp4_quant_dequant")):
        setattr_fn(mod, name, ident)


def live_state(m) -> list:
    """Every decode state buffer of m's main layers (clones), scratch rows excluded: the window
    ring, compressed / index entries and both compressors' block rows, stale rows included
    (prefill, decode and a speculative rewind must leave the same rows)."""
    out = []
    for blk, st in zip(m.layers, m.states):
        r = blk.ratio
        out.append(st.kv_cache[:-1] if r else st.kv_cache)
        if st.index_cache is not None:
            out.append(st.index_cache[:-1])
        for c in (st.compressor, st.index_compressor):
            if c is not None:
                out += [c.kv, c.score]
    return [t.clone() for t in out]


def assert_state_close(a, b, tol=1e-5):
    """Same shapes and -inf pattern; max abs error <= tol * max(|b|, 1) per buffer."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, i
        fin = torch.isfinite(y)
        assert torch.equal(fin, torch.isfinite(x)), f"state tensor {i}: -inf pattern differs"
        err = (x[fin] - y[fin]).abs().max().item() if fin.any() else 0.0
        scale = max(y[fin].abs().max().item(), 1.0) if fin.any() else 1.0
        assert err <= tol * scale, f"state tensor {i}: max abs error {err:.3g} (scale {scale:.3g})"


class NearTies:
    """The smallest relative gap, over every top-k selection made while it is installed, between
    the k-th best score and the best one left out: MoE routing (Tensor.topk over float scores)
    and the indexer's topk_lowest. Two differently batched float32 computations of the same
    thing differ by ~1e-6 of a value (chunked prefill's state on several CPUs, thread counts and
    vector widths), so where every gap is far above that they select the same entries on any
    machine, and exactness can be asserted of the rest. Exact ties of zeros or infinities (relu'd
    index scores, masked entries) are broken by a fixed rule and stay exact: they do not count.
    install() with a pytest monkeypatch; `min_gap` after the computation."""

    def __init__(self):
        self.min_gap = float("inf")

    def note(self, scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True) -> None:
        if not scores.is_floating_point() or not 0 < k < scores.shape[dim]:
            return
        v = scores.detach().float().sort(dim=dim, descending=largest).values
        a, b = v.narrow(dim, k - 1, 1), v.narrow(dim, k, 1)
        exact = (a == b) & ((a == 0) | a.isinf())
        gap = (a - b).abs() / torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
        gap = gap.masked_fill(exact | (a.isinf() & ~b.isinf()), float("inf"))
        self.min_gap = min(self.min_gap, float(gap.min()))

    def install(self, monkeypatch) -> "NearTies":
        import dsv4.model.indexer
        topk, lowest = torch.Tensor.topk, dsv4.model.indexer.topk_lowest

        def noted_topk(t, k, dim=-1, largest=True, sorted=True):
            self.note(t, k, dim, largest)
            return topk(t, k, dim=dim, largest=largest, sorted=sorted)

        def noted_lowest(scores, k):
            self.note(scores, k)
            return lowest(scores, k)
        monkeypatch.setattr(torch.Tensor, "topk", noted_topk)
        monkeypatch.setattr(dsv4.model.indexer, "topk_lowest", noted_lowest)
        return self


# The smallest top-k gap at which tests assert float32 agreement: ten times the noise measured
# between chunkings (<= 1e-6 of a value, 1 or 2 threads, AVX2 / AVX-512 / no vector kernels).
GAP = 1e-5


def run_main(main, args, argv0: list, env: dict | None = None):
    """A command's main(args) in this process, as its process would end: main's return value, or
    a SystemExit's code, is the exit status; stdout / stderr as it prints them; `env` set for the
    call, then put back. -> subprocess.CompletedProcess(argv0 + args, ...). For the runs whose
    status and printed lines are all a test reads (a subprocess adds ~4 s of imports to each);
    each command also runs as users run it, in a subprocess, in its own tests."""
    import contextlib
    import io
    import os
    import subprocess
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:
                rc = e.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess([*argv0, *args], rc, out.getvalue(), err.getvalue())
