"""What each rank runs in tests/dsv4/parallel/test_tp_model.py (module-level functions: the
launcher pickles them into spawned processes, which import this module from the test folder on
sys.path). One start-up of two gloo ranks runs every check and returns plain data."""
from __future__ import annotations

import types

import torch

import dsv4.model.attention as A
import dsv4.model.compressor as C
import dsv4.model.indexer as I
from dsv4.backend.options import Options
from dsv4.runtime.build import build_model
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import SamplingParams
from dsv4.runtime.session import Session
from dsv4.runtime.tp import load_rank
from dsv4.weights.checkpoint import open_checkpoint
from dsv4.weights.device_weights import DeviceWeights
from helpers import NearTies, disable_fake_quant

CAP = 64            # cache capacity of the runs
CHUNK = 8           # prefill chunk: the prompt goes through in pieces, as a long one would
N_NEW = 6           # decode steps after the prompt
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=5)


def runtime(rt_kw: dict | None = None) -> RuntimeConfig:
    return RuntimeConfig(max_seq_len=CAP, dtype=torch.float32, prefill_chunk=CHUNK,
                         **(rt_kw or {}))


def greedy_run(model, ids: torch.Tensor) -> dict:
    """Prefill ids, then N_NEW greedy decode steps (eager decode_step) -> the logits [1 + N_NEW,
    V] of the prompt's last token and of each step, and the tokens chosen."""
    out, toks = [model.prefill(ids)], []
    for p in range(ids.shape[0], ids.shape[0] + N_NEW):
        toks.append(int(out[-1].argmax()))
        out.append(model.decode_step(torch.tensor([toks[-1]]), torch.tensor([p])))
    return {"logits": torch.stack(out), "tokens": toks}


def session_tokens(model, ids: list) -> dict:
    """A plain Session on the model (eager): greedy and seeded-sampled tokens; whether closing a
    Session let go of the model's prefill chunk graphs (a stand-in put there after generate)."""
    got = {}
    for name, params in (("greedy", SamplingParams()), ("sampled", SAMPLED)):
        with Session(model, params, mode="eager") as s:
            got[name] = list(s.generate(ids, N_NEW).output_ids)
            model.prefill_graphs = held = object()
        got["graphs_released"] = model.prefill_graphs is not held
        model.prefill_graphs = None
    return got


def forced_logits(model, prompt: list, forced: list) -> dict:
    """The tokens `forced` after the prompt, through an eager Session, a graph Session and a
    second graph Session -> {eager, graph, graph2: logits [n, V] float32 on the CPU}."""
    got = {}
    for name, mode in (("eager", "eager"), ("graph", "graph"), ("graph2", "graph")):
        with Session(model, SamplingParams(), mode=mode) as s:
            r = s.generate(prompt, len(forced), force_ids=forced, keep_logits=True)
        got[name] = r.logits.cpu()
    return got


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


class RecordingSource:
    """A weight source that notes the progress switch Transformer.load gave its load_many."""

    def __init__(self, src):
        self.src, self.progress = src, "not called"

    def load_many(self, items, desc="load", progress=None, parts=None):
        self.progress = progress
        self.src.load_many(items, desc=desc, progress=progress, parts=parts)


def shard_checks(model, ckpt_dir) -> dict:
    """The rank's shard of an FP8 / FP4 model against the checkpoint: every destination holds
    exactly the part of its tensor that parts() names (whole where none), read whole here and
    cut; dequantized, the split weights equal the rows / columns of the whole weight."""
    from dsv4.model.linear import dequantize
    parts, bad, n_split = model.parts(), [], 0
    with open_checkpoint(ckpt_dir) as ck:
        for name, dst in model.tensors().items():
            full = ck.get(name)
            want = parts[name].take(full) if name in parts else full
            n_split += name in parts
            if not same_bits(dst, want.to(dst.dtype) if dst.dtype != want.dtype else want):
                bad.append(name)
        dense = {}
        attn, ffn = model.layers[1].attn, model.layers[1].ffn
        cases = {"wq_b": (attn.wq_b, "layers.1.attn.wq_b", 0),
                 "wo_a": (attn.wo_a, "layers.1.attn.wo_a", 0),
                 "wo_b": (attn.wo_b, "layers.1.attn.wo_b", 1),
                 "shared.w1": (ffn.shared["w1"], "layers.1.ffn.shared_experts.w1", 0),
                 "shared.w2": (ffn.shared["w2"], "layers.1.ffn.shared_experts.w2", 1)}
        for key, (lin, prefix, dim) in cases.items():
            whole = dequantize(lin.fmt, ck.get(prefix + ".weight"), ck.get(prefix + ".scale"),
                               torch.float32)
            a, b = lin.split[1:]
            dense[key] = torch.equal(lin.dense(torch.float32), whole.narrow(dim, a, b - a))
        e = torch.tensor([3])
        for w, dim in (("w1", 0), ("w2", 1)):
            p = f"layers.1.ffn.experts.3.{w}"
            whole = dequantize(ffn.experts.fmt, ck.get(p + ".weight"), ck.get(p + ".scale"),
                               torch.float32)
            a, b = ffn.experts.split
            dense[f"experts.{w}"] = torch.equal(ffn.experts.dense(w, e, torch.float32)[0],
                                                whole.narrow(dim, a, b - a))
        fp8_cfg = ck.config
    # random weights made on the device (benchmarks) give the shard a sliced load gives
    gen = build_model(fp8_cfg, model.rt, comm=model.tp.comm)
    src = RecordingSource(DeviceWeights(fp8_cfg, seed=0))
    gen.load(src)
    theirs = gen.tensors()
    synthetic = [n for n, t in model.tensors().items() if not same_bits(t, theirs[n])]
    return {"bad": bad, "n_split": n_split, "n": len(model.tensors()), "dense": dense,
            "synthetic": synthetic, "head_rows": model.head.shape[0], "progress": src.progress,
            "parts": {n: (p.dim, p.start, p.stop) for n, p in parts.items()
                      if n in ("head.weight", "layers.1.attn.attn_sink", "layers.1.attn.wo_b.scale",
                               "layers.1.ffn.experts.3.w2.weight",
                               "layers.1.ffn.experts.3.w2.scale")}}


def counted_prefill(model, ids: torch.Tensor) -> tuple:
    """model.prefill(ids) -> (its logits, {collective: calls}) over the rank's communicator."""
    comm, n = model.tp.comm, {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    for name in n:
        f = getattr(comm, name)
        setattr(comm, name, lambda *a, f=f, name=name, **k: (n.__setitem__(name, n[name] + 1),
                                                              f(*a, **k))[1])
    try:
        logits = model.prefill(ids)
    finally:
        for name in n:
            delattr(comm, name)
    return logits, n


def seq_checks(model, ids: torch.Tensor) -> dict:
    """A prompt of one chunk of CHUNK rows (even: its mHC split by rows over the ranks), the same
    with the split off (model.seq_parallel), and one of CHUNK - 1 rows (odd: not split) -> the
    collectives each called and the logits."""
    out = {"layers": model.cfg.n_layers,
           "indexers": sum(blk.attn.indexer is not None for blk in model.layers)}
    out["on"], out["on_n"] = counted_prefill(model, ids[:CHUNK])
    model.seq_parallel = False
    out["off"], out["off_n"] = counted_prefill(model, ids[:CHUNK])
    model.seq_parallel = True
    out["odd"], out["odd_n"] = counted_prefill(model, ids[:CHUNK - 1])
    return out


def tp_rank(group, bf16_dir: str, fp8_dir: str, prompt: list) -> dict:
    """Everything the TP tests ask of one rank, in one start-up: the bf16 model's logits and
    tokens (fake-quant off, float32: comparable to one process to float32 noise), a Session's
    tokens, the FP8 model's shard against the checkpoint and its logits (fake-quant on)."""
    torch.set_num_threads(1)         # two ranks on two cores: one thread each (no oversubscription)
    ties = NearTies().install(types.SimpleNamespace(setattr=setattr))
    res = {"rank": group.rank}
    model, ck = load_rank(group, bf16_dir, runtime())
    ck.close()
    res["rt"] = (model.rt.tp, tuple(map(str, model.rt.devices)))
    res["table"] = model.tp.comm.table()
    ids = torch.tensor(prompt)
    saved = [(m, n, getattr(m, n)) for m, n in ((A, "fp8_quant_dequant"), (C, "fp8_quant_dequant"),
                                                 (C, "fp4_quant_dequant"), (I, "fp4_quant_dequant"))]
    disable_fake_quant()
    res["greedy"] = greedy_run(model, ids)
    res["session"] = session_tokens(model, prompt)
    res["min_gap"] = ties.min_gap
    # the all-reduces of one decode step (dsv4.bench.tp counts two a layer)
    comm, calls = model.tp.comm, []
    reduce_ = comm.all_reduce
    comm.all_reduce = lambda x: (calls.append(x.dtype), reduce_(x))[1]
    model.decode_step(torch.tensor([prompt[-1]]), torch.tensor([len(prompt)]))
    del comm.all_reduce
    res["step_allreduces"] = (len(calls), model.cfg.n_layers)
    res["seq"] = seq_checks(model, ids)
    for m, n, f in saved:                            # fake-quant back on for the FP8 model
        setattr(m, n, f)
    fp8, ck = load_rank(group, fp8_dir, runtime())
    ck.close()
    res["fp8_logits"] = fp8.prefill(ids)
    res["shards"] = shard_checks(fp8, fp8_dir)
    model.tp.comm.close()
    fp8.tp.comm.close()
    return res


def parity_rank(group, ckpt_dir: str, dtype: str, prompt: list, forced: list) -> dict:
    """On a GPU rank (its memory poisoned first): the rank's shard of a parity checkpoint, the
    golden tokens forced after the prompt, eager, then graph mode twice (two Sessions, each
    capturing its own graphs) -> {rank, eager, graph, graph2: logits [n, V] float32 on the CPU,
    table: the all-reduce plan}."""
    from parallel_ranks import _poison
    _poison(group.device)
    rt = RuntimeConfig(max_seq_len=256, dtype=getattr(torch, dtype))
    model, ck = load_rank(group, ckpt_dir, rt)
    ck.close()
    out = {"rank": group.rank, "table": model.tp.comm.table(),
           **forced_logits(model, prompt, forced)}
    model.tp.comm.check()
    model.tp.comm.close()
    return out


def fuse_post_rank(group, ckpt_dir: str, prompt: list, forced: list) -> dict:
    """On a GPU rank (memory poisoned first): the rank's shard of an FP8 checkpoint in bfloat16,
    the tokens `forced` after the prompt, with each sublayer's all-reduce and the block's mHC
    post in one launch (Options.fuse_post) and without -> {rank, on / off: {eager, graph, graph2:
    logits [n, V] f32 on the CPU, bound: blocks with post_reduce, fused: the fused calls of one
    eager decode step}}."""
    from parallel_ranks import _poison
    _poison(group.device)
    out = {"rank": group.rank}
    for name, on in (("on", True), ("off", False)):
        rt = RuntimeConfig(max_seq_len=128, dtype=torch.bfloat16,
                           options=Options.from_env().replace(fuse_post=on))
        model, ck = load_rank(group, ckpt_dir, rt)
        ck.close()
        got = {"bound": sum(blk.post_reduce is not None for blk in model.layers)}
        comm, fused = model.tp.comm, []
        post_ = comm.all_reduce_post
        comm.all_reduce_post = lambda *t: (fused.append(post_(*t)), fused[-1])[1]
        dev = group.device
        model.prefill(torch.tensor(prompt, device=dev))
        model.decode_step(torch.tensor([forced[0]], device=dev),
                          torch.tensor([len(prompt)], device=dev))
        del comm.all_reduce_post
        got["fused"] = fused[-2 * model.cfg.n_layers:].count(True)
        model.reset()
        got.update(forced_logits(model, prompt, forced))
        model.tp.comm.check()
        model.tp.comm.close()
        out[name] = got
    return out


def prefill_graphs_rank(group, ckpt_dir: str, prompt: list, n_new: int) -> dict:
    """On a GPU rank (memory poisoned first): a graph Session built with prefill chunk graphs
    (RuntimeConfig.prefill_graphs 16: 8 + 4 rows of a 12-token prompt), and one without them that
    prefills the same pieces eagerly -> {rank, plan (every rank must have the same), replay_ms,
    released (the Session's close let its graphs go), with / without: the decoded ids and
    logits}."""
    import faulthandler
    import sys

    from parallel_ranks import _poison
    # should the group's teardown hang again: every rank's Python stack on stderr after 150 s
    faulthandler.dump_traceback_later(150, repeat=True, file=sys.stderr)
    _poison(group.device)
    out = {"rank": group.rank}
    for name, graphs in (("with", 16), ("without", 0)):
        rt = RuntimeConfig(max_seq_len=128, dtype=torch.bfloat16, prefill_graphs=graphs)
        model, ck = load_rank(group, ckpt_dir, rt)
        ck.close()
        with Session(model, SamplingParams(), mode="graph") as s:
            if graphs:
                pg = model.prefill_graphs
                out["plan"], out["replay_ms"] = pg.plan(len(prompt)), pg.replay_ms
                out["eager_ms"] = pg.eager_ms
                pg = None
                r = s.generate(prompt, n_new, keep_logits=True)
            else:
                s.prefill(prompt[:8])
                r = s.generate(prompt[8:], n_new, keep_logits=True, continue_sequence=True)
        if graphs:
            out["released"] = model.prefill_graphs is None
        out[name] = {"ids": r.output_ids, "logits": r.logits.cpu()}
        model.tp.comm.check()
        model.tp.comm.close()
    faulthandler.cancel_dump_traceback_later()
    return out


def two_shot_rank(group, ckpt_dir: str, prompt: list) -> dict:
    """On a GPU rank (memory poisoned first): the rank's shard prefilling a prompt in float32
    chunks of 256 rows ([256, dim] partials of 128 KB: the two-shot's, above the one-shot's
    64 KB) and decoding greedily, planned as the runtime plans it with the two-shot asked for
    (Options.two_shot; the chunks' sums through the all-reduce: sequence parallel off) and with
    NCCL forced -> {rank, planned / nccl: {logits, tokens, table}}."""
    from parallel_ranks import _poison
    if group.device.type == "cuda":
        _poison(group.device)
    out = {"rank": group.rank}
    for name, prefer in (("planned", None), ("nccl", "nccl")):
        rt = RuntimeConfig(max_seq_len=512, dtype=torch.float32, prefill_chunk=256,
                           options=Options.from_env().replace(two_shot=True,
                                                              seq_parallel=False))
        model, ck = load_rank(group, ckpt_dir, rt, prefer=prefer)
        ck.close()
        with Session(model, SamplingParams(), mode="eager") as s:
            r = s.generate(prompt, N_NEW, keep_logits=True)
        model.tp.comm.check()
        out[name] = {"logits": r.logits.cpu(), "tokens": list(r.output_ids),
                     "table": model.tp.comm.table()}
        model.tp.comm.close()
    return out
