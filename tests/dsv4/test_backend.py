"""dsv4.backend on the CPU: the switches read once from the environment (Options.from_env), the
decision per device (resolve) and per model (its config), the table the CLI reports, and a model
that hands its backend to every layer and swaps it on request (Transformer.use_options)."""
from __future__ import annotations

import pytest
import torch

from dsv4.backend import decision as backend
from dsv4.backend.decision import BRANCHES, Options, resolve
from dsv4.weights.device_weights import DeviceWeights
from dsv4.model.transformer import Transformer
from dsv4.weights.presets import TINY
from dsv4.runtime.config import RuntimeConfig

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
                          "TRITON_INTERPRET": "1"})
    assert (o.kernels, o.prefill_kernels, o.cuda_kernels, o.cuda_lib, o.pdl) == \
        ("0", False, False, "/x/lib.so", False)
    assert o.overlap == {"moe"} and o.prefill_mma == (("fp4", "fp8"), ("fp8", "bf16"))
    assert (o.prefill_cublas, o.split_programs, o.interpret) == (False, 128, True)
    # anything but "0" leaves a switch on (as before: DSV4_PDL=yes is on)
    assert Options.from_env({"DSV4_PDL": "yes", "DSV4_KERNELS": "interpret"}).pdl
    assert Options.from_env({"DSV4_OVERLAP": "0"}).overlap == frozenset()


def test_cpu_and_meta_take_torch_everywhere():
    for dev in ("cpu", "meta"):
        be = resolve(dev, torch.bfloat16, TINY, Options())
        assert not be.kernels and be.prefill == "torch" and be.branches == frozenset()
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
    assert be.kernels and be.prefill == "triton" and be.cuda == "ok" and be.pdl
    assert be.branches == frozenset(BRANCHES) and t["launch.branches"] == "attn,mhc,moe"
    for op in ("decode.mhc", "decode.attention", "decode.compressor", "decode.indexer",
               "decode.linear_bf16", "decode.head", "speculative.journal"):
        assert t[op] == "triton", op
    for op in ("decode.indexer_topk", "decode.linear_fp8", "decode.wo_a", "decode.moe_route",
               "decode.moe_experts", "decode.moe_shared"):
        assert t[op] == "cuda", op
    for op in ("prefill.mhc", "prefill.attention", "prefill.compressor", "prefill.indexer",
               "prefill.linear", "prefill.wo_a", "prefill.moe"):
        assert t[op] == "triton", op
    # the switches, each decided here
    assert resolve("cuda:0", options=Options(cuda_kernels=False)).table()["decode.linear_fp8"] \
        == "triton"
    assert not resolve("cuda:0", options=Options(pdl=False)).pdl
    assert resolve("cuda:0", options=Options(overlap=frozenset({"moe"}))).branches == {"moe"}
    off = resolve("cuda:0", torch.bfloat16, TINY, Options(kernels="0")).table()
    assert all(v in ("torch", "-") for k, v in off.items() if k.startswith(("decode.", "prefill.")))
    f32 = resolve("cuda:0", torch.float32, TINY, Options())
    assert f32.kernels and not f32.fused_decode and not f32.rows and not f32.mhc_decode
    assert f32.table()["decode.head"] == "triton"       # the head GEMV takes float32 rows too


def test_model_decisions_follow_the_config(gpu):
    be = resolve("cuda:0", torch.bfloat16, TINY.replace(hc_mult=1), Options())
    assert not be.mhc_decode and be.mhc_prefill         # hc_mult * dim = 128: % 64, not % 256
    assert be.fused_decode and be.moe_decode and be.wo_a_gemv
    assert be.gemm_fits("fp8", 256) and not be.gemm_fits("fp8", 192) and be.gemm_fits("bf16", 64)
    assert not resolve("cuda:0").fused_decode           # no config: no sublayer decisions


def test_transformer_hands_its_backend_to_every_layer():
    rt = RuntimeConfig(max_seq_len=64, options=Options())
    m = Transformer(TINY.replace(vocab_size=512), rt)
    assert m.options is rt.options and set(m.ops_on) == {torch.device("cpu")}
    ops = m.ops
    for blk in m.layers:
        parts = [blk, blk.attn, blk.ffn, *blk.weights()]
        assert all(getattr(p, "ops", ops) is ops for p in parts)
    assert m.backend_table()["decode.mhc"] == "torch"
    m.use_options(Options(pdl=False))
    assert m.ops is not ops and m.options.pdl is False
    for blk in m.layers:
        for p in [blk, blk.attn, blk.ffn, *blk.weights()]:
            assert getattr(p, "ops", m.ops) is m.ops
    with pytest.raises(Exception, match="options"):
        RuntimeConfig(options={"pdl": False})


def test_environment_read_once_at_construction(monkeypatch):
    """The model reads the switches when it is built, not while it runs."""
    monkeypatch.setenv("DSV4_PDL", "0")
    m = Transformer(TINY.replace(vocab_size=512), RuntimeConfig(max_seq_len=64))
    assert m.options.pdl is False
    monkeypatch.setattr(Options, "from_env", classmethod(lambda cls, env=None: pytest.fail(
        "the environment was read again")))
    m.load(DeviceWeights(m.cfg, 0))
    m.prefill(torch.tensor([1, 2, 3]))
    m.decode_step(torch.tensor([4]), torch.tensor([3]))
