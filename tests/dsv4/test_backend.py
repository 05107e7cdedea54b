"""dsv4.backend on the CPU: the switches read once from the environment (Options.from_env), the
decision per device (resolve) and per model (its config), the table the CLI reports, and the
binding of every sublayer to one implementation (dsv4.backend.bind), again on request."""
from __future__ import annotations

import pytest
import torch

from dsv4.backend import decision as backend
from dsv4.backend.binding import bind, bind_block
from dsv4.backend.ops import Ops
from dsv4.backend.decision import BRANCHES, Options, resolve
from dsv4.backend.options import PREFETCH
from dsv4.backend.fused import attention as fused_attention
from dsv4.backend.fused.linear import KernelLinear
from dsv4.model.transformer import Transformer
from dsv4.runtime.build import build_model
from dsv4.runtime.config import RuntimeConfig
from dsv4.weights.device_weights import DeviceWeights
from dsv4.weights.presets import TINY

@pytest.fixture
def gpu(monkeypatch):
    """resolve() as on a GPU machine with triton and the CUDA C++ library (nothing launched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "_triton_importable", lambda: True)
    monkeypatch.setattr(backend, "_cuda_status", lambda device, path: "ok")


def test_options_from_env_as_the_runtime_read_them():
    assert Options.from_env({}) == Options()
    o = Options.from_env({"DSV4_KERNELS": "0", "DSV4_PREFILL_KERNELS": "0",
                          "DSV4_CUDA_KERNELS": "0", "DSV4_CUDA_LIB": "/x/lib.so", "DSV4_PDL": "0",
                          "DSV4_OVERLAP": "moe", "DSV4_PREFILL_MMA": "fp4=fp8, fp8 = bf16,bad=x",
                          "DSV4_PREFILL_CUBLAS": "0", "DSV4_SPLIT_PROGRAMS": "128",
                          "DSV4_HEAD_CUDA": "0", "DSV4_FUSE_MIX": "0",
                          "TRITON_INTERPRET": "1"})
    assert (o.kernels, o.prefill_kernels, o.cuda_kernels, o.cuda_lib, o.pdl) == \
        ("0", False, False, "/x/lib.so", False)
    assert o.overlap == {"moe"} and o.prefill_mma == (("fp4", "fp8"), ("fp8", "bf16"))
    assert (o.prefill_cublas, o.split_programs, o.interpret) == (False, 128, True)
    assert not o.head_cuda and Options.from_env({}).head_cuda
    assert not o.fuse_mix and Options.from_env({}).fuse_mix
    # anything but "0" leaves a switch on (as before: DSV4_PDL=yes is on)
    assert Options.from_env({"DSV4_PDL": "yes", "DSV4_KERNELS": "interpret"}).pdl
    assert Options.from_env({"DSV4_OVERLAP": "0"}).overlap == frozenset()
    # the L2 prefetch points and their launch
    assert Options.from_env({}).prefetch == frozenset()          # off unless asked
    assert Options.from_env({"DSV4_PREFETCH": "1"}).prefetch == frozenset(PREFETCH)
    p = Options.from_env({"DSV4_PREFETCH": "attn, ffn,bad", "DSV4_PREFETCH_CFG": "1,132,128,4096"})
    assert p.prefetch == {"attn", "ffn"} and p.prefetch_cfg == (1, 132, 128, 4096)
    assert Options.from_env({"DSV4_PREFETCH": "0"}).prefetch == frozenset()
    # the block's mHC post in the launch before it: on unless "0"
    assert Options.from_env({}).fuse_post is True
    assert Options.from_env({"DSV4_FUSE_POST": "0"}).fuse_post is False
    assert Options.from_env({"DSV4_FUSE_POST": "yes"}).fuse_post is True
    # the MTP block's drafts through the head's e4m3 copy: on unless "0"
    assert Options.from_env({}).draft_fp8 is True
    assert Options.from_env({"DSV4_DRAFT_FP8": "0"}).draft_fp8 is False


def test_cpu_and_meta_take_torch_everywhere():
    for dev in ("cpu", "meta"):
        be = resolve(dev, torch.bfloat16, TINY, Options())
        assert not be.kernels and be.prefill == "torch" and be.branches == frozenset()
        assert be.prefetch == frozenset() and be.table()["launch.prefetch"] == "none"
        table = be.table()
        assert all(v in ("torch", "-") for k, v in table.items() if k.startswith(("decode.",
                                                                                 "prefill.")))
        assert table["launch.pdl"] == "off" and table["cuda_cpp"] == "not a CUDA device"


def test_cpu_interpreter_runs_the_prefill_kernels(monkeypatch):
    monkeypatch.setattr(backend, "_triton_importable", lambda: True)
    be = resolve("cpu", torch.bfloat16, TINY, Options(kernels="interpret", interpret=True))
    assert be.prefill == "interpret" and be.rows and not be.kernels
    assert be.mhc_prefill and be.moe_prefill and be.wo_a_prefill and not be.fused_decode
    assert be.table()["prefill.linear"] == "interpret" and be.table()["decode.mhc"] == "torch"
    # not without the interpreter, not for float32 activations, not with the prefill switch off
    assert resolve("cpu", torch.bfloat16, TINY, Options(kernels="interpret")).prefill == "torch"
    assert resolve("cpu", torch.float32, TINY,
                   Options(kernels="interpret", interpret=True)).prefill == "torch"
    assert resolve("cpu", torch.bfloat16, TINY, Options(kernels="interpret", interpret=True,
                                                         prefill_kernels=False)).prefill == "torch"


def test_gpu_table(gpu):
    be = resolve("cuda:0", torch.bfloat16, TINY, Options())
    t = be.table()
    assert be.kernels and be.prefill == "triton" and be.gemv == "cuda" and be.pdl
    assert be.branches == frozenset(BRANCHES) and t["launch.branches"] == "attn,mhc,moe"
    assert be.prefetch == frozenset() and t["launch.prefetch"] == "none"
    be = resolve("cuda:0", torch.bfloat16, TINY, Options(prefetch=frozenset(PREFETCH)))
    assert be.table()["launch.prefetch"] == "attn,ffn,layer"
    for op in ("decode.mhc", "decode.attention", "decode.compressor", "decode.indexer",
               "decode.linear_bf16", "speculative.journal", "speculative.accept"):
        assert t[op] == "triton", op
    for op in ("decode.head", "decode.indexer_topk", "decode.linear_fp8", "decode.wo_a",
               "decode.moe_route", "decode.moe_experts", "decode.moe_shared", "prefill.moe_route"):
        assert t[op] == "cuda", op
    for op in ("prefill.mhc", "prefill.attention", "prefill.compressor", "prefill.indexer",
               "prefill.linear", "prefill.wo_a", "prefill.moe"):
        assert t[op] == "triton", op
    # the switches, each decided here
    assert resolve("cuda:0", options=Options(cuda_kernels=False)).table()["decode.linear_fp8"] \
        == "triton"
    assert resolve("cuda:0", options=Options(head_cuda=False)).table()["decode.head"] == "triton"
    assert not resolve("cuda:0", options=Options(pdl=False)).pdl
    assert resolve("cuda:0", options=Options(overlap=frozenset({"moe"}))).branches == {"moe"}
    off = resolve("cuda:0", torch.bfloat16, TINY, Options(kernels="0")).table()
    assert all(v in ("torch", "-") for k, v in off.items() if k.startswith(("decode.", "prefill.")))
    f32 = resolve("cuda:0", torch.float32, TINY, Options())
    assert f32.kernels and not f32.fused_decode and not f32.rows and not f32.mhc_decode
    assert f32.table()["decode.head"] == "cuda"         # the head GEMV takes float32 rows too


def test_model_decisions_follow_the_config(gpu):
    be = resolve("cuda:0", torch.bfloat16, TINY.replace(hc_mult=1), Options())
    assert not be.mhc_decode and be.mhc_prefill         # hc_mult * dim = 128: % 64, not % 256
    assert be.fused_decode and be.moe_decode and be.wo_a_gemv
    assert be.gemm_fits("fp8", 256) and not be.gemm_fits("fp8", 192) and be.gemm_fits("bf16", 64)
    assert not resolve("cuda:0").fused_decode           # no config: no sublayer decisions


def _bound(m) -> dict:
    """sublayer op -> whether it is bound to its torch reference, over every layer."""
    out = {}
    for blk in m.layers:
        a = blk.attn
        pairs = {"block.decode_rows": (blk.decode_rows, blk.decode_rows_reference),
                 "attn.decode_rows": (a.decode_rows, a.decode_rows_reference),
                 "attn.prefill": (a.prefill, a.prefill_reference),
                 "moe.decode_rows": (blk.ffn.decode_rows, blk.ffn.decode_rows_reference),
                 "moe.prefill_experts": (blk.ffn.prefill_experts,
                                         blk.ffn.prefill_experts_reference)}
        for c in (a.compressor, a.indexer and a.indexer.compressor):
            if c:
                pairs["compressor.decode"] = (c.decode, c.decode_reference)
                pairs["compressor.prefill"] = (c.prefill, c.prefill_reference)
        for lin in blk.weights()[:-1]:
            pairs["linear"] = (lin.forward, lin.reference)
        for k, (bound, ref) in pairs.items():
            out.setdefault(k, set()).add(bound == ref)
    return {k: v.pop() if len(v) == 1 else None for k, v in out.items()}


def test_build_binds_every_sublayer_once():
    """On the CPU every sublayer runs its torch reference; the binding reports its table and
    can be redone with other switches (captured steps keep what they were captured with)."""
    rt = RuntimeConfig(max_seq_len=64, options=Options())
    m = build_model(TINY.replace(vocab_size=512), rt)
    assert m.binding.options is rt.options and set(m.binding.ops_on) == {torch.device("cpu")}
    assert all(_bound(m).values()), _bound(m)
    assert m.binding.table()["decode.mhc"] == "torch"
    before = m.binding
    bind(m, Options(pdl=False))
    assert m.binding is not before and m.binding.options.pdl is False
    with pytest.raises(Exception, match="options"):
        RuntimeConfig(options={"pdl": False})


def test_a_transformer_alone_runs_the_reference():
    """A Transformer built without the runtime is the torch math (no binding, nothing read)."""
    m = Transformer(TINY.replace(vocab_size=512), RuntimeConfig(max_seq_len=64))
    assert m.binding is None and all(_bound(m).values())


def test_gpu_binding_takes_the_fused_paths(gpu):
    """As on a GPU with the kernels: each sublayer bound to its fused implementation once (the
    model's math never asks the backend again); DSV4_KERNELS=0 binds the references back."""
    m = Transformer(TINY.replace(vocab_size=512), RuntimeConfig(max_seq_len=64,
                                                                devices=("meta",)))
    be = resolve("cuda:0", torch.bfloat16, m.cfg, Options())   # a GPU's decision, bound by hand
    for blk in m.layers:
        bind_block(blk, Ops(be))
    bound = _bound(m)
    assert not any(bound.values()), bound
    assert all(isinstance(blk.attn.wq_a.forward, KernelLinear) for blk in m.layers)
    assert all(blk.attn.decode_rows.func is fused_attention.decode_rows for blk in m.layers)
    off = resolve("cuda:0", torch.bfloat16, m.cfg, Options(kernels="0"))
    for blk in m.layers:
        bind_block(blk, Ops(off))
    assert all(_bound(m).values())


def test_the_post_joins_the_launch_before_it_only_where_it_can(gpu):
    """DSV4_FUSE_POST (on by default) on the fused paths: a tensor-parallel block binds Block.post_reduce (each
    sublayer's all-reduce takes the block's mHC post; the sublayers then leave their outputs
    unreduced), a one-process block Block.post_in_down (the routed experts' down takes the FFN's
    post); neither without the switch or off the kernels."""
    from dsv4.backend.fused.moe import DecodeKernels
    from dsv4.model.block import Block
    from dsv4.model.sharding import TensorParallel
    from dsv4.weights.presets import TINY_TP
    cfg = TINY_TP.replace(vocab_size=512)
    tp = TensorParallel(0, 2)
    be = resolve("cuda:0", torch.bfloat16, tp.shapes(cfg), Options(fuse_post=True))
    blk = Block(cfg, 0, "meta", tp=tp)
    bind_block(blk, Ops(be))
    assert blk.post_reduce is tp and blk.tp is tp and not blk.post_in_down
    assert isinstance(blk.ffn.decode_rows, DecodeKernels)
    one = Block(cfg, 0, "meta")
    bind_block(one, Ops(resolve("cuda:0", torch.bfloat16, cfg, Options(fuse_post=True))))
    assert one.post_in_down and one.post_reduce is None
    for options, block_tp in ((Options(fuse_post=False), tp), (Options(fuse_post=False), None),
                              (Options(fuse_post=True, kernels="0"), tp),
                              (Options(fuse_post=True, kernels="0"), None)):
        b = Block(cfg, 0, "meta", tp=block_tp)
        shapes = block_tp.shapes(cfg) if block_tp else cfg
        bind_block(b, Ops(resolve("cuda:0", torch.bfloat16, shapes, options)))
        assert b.post_reduce is None and not b.post_in_down, options
    # a one-process model: no all-reduce to join
    assert Block(cfg, 0, "meta", tp=TensorParallel(0, 1)).tp is None


def test_environment_read_once_at_build(monkeypatch):
    """The switches are read when the model is built, not while it runs."""
    monkeypatch.setenv("DSV4_PDL", "0")
    m = build_model(TINY.replace(vocab_size=512), RuntimeConfig(max_seq_len=64))
    assert m.binding.options.pdl is False
    monkeypatch.setattr(Options, "from_env", classmethod(lambda cls, env=None: pytest.fail(
        "the environment was read again")))
    m.load(DeviceWeights(m.cfg, 0))
    m.prefill(torch.tensor([1, 2, 3]))
    m.decode_step(torch.tensor([4]), torch.tensor([3]))
