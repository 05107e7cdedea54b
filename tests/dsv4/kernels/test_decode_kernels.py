"""dsv4.kernels (FP8 / bf16 GEMV, routed FP4 experts) against the plain-torch references: the Triton
interpreter on the CPU (test_decode_kernels_interp.py in a subprocess), and CUDA at the real Flash / Pro
shapes, determinism, capture, and the Linear / MoE dispatch. Helpers here are shared with the
interpreter module. GPU: `python -m pytest tests/dsv4/kernels/test_decode_kernels.py -q -m cuda`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import input_seed, needs_interpreter
from dsv4 import kernels

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SEED = input_seed(20261124)     # printed on failure; DSV4_TEST_SEED=random: fresh inputs


def fresh_gen(device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(SEED)


def poisoned(*shape, dtype=torch.bfloat16, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def spiky_x(k: int, gen, dtype, device="cpu") -> torch.Tensor:
    """[1, k] activation with per-128 scales over 1e-3..1e3, one zero block, negative zeros,
    an outlier: exercises the amax floor, ties and the clamp of act_quant."""
    nb = k // 128
    scale = 10.0 ** (torch.rand(nb, 1, generator=gen, device=device) * 6 - 3)
    x = torch.randn(nb, 128, generator=gen, device=device) * scale
    if nb > 1:
        x[1] = 0.0
    x[0, ::3] = -0.0
    x[-1, 5] = 50 * scale[-1, 0]
    return x.reshape(1, k).to(dtype)


def fp8_weight(n: int, k: int, gen, gain: float = 1.0, device="cpu"):
    """Random e4m3 bytes (every finite code, subnormals included) + ue8m0 scales around 2^-9."""
    b = torch.randint(0, 256, (n, k), generator=gen, device=device, dtype=torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)                        # no NaN codes
    e = 118 + int(round(torch.tensor(gain).log2().item()))
    s = torch.randint(e - 2, e + 3, (n // 128, k // 128), generator=gen, device=device,
                      dtype=torch.uint8)
    return b.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def fp4_bank(E: int, inter: int, dim: int, gen, gain: float = 1.0, up: bool = True, device="cpu"):
    """Random routed experts: (w1, s1, w3, s3, w2, s2), packed e2m1 bytes + ue8m0 scales ~2^-4."""
    e = 123 + int(round(torch.tensor(gain).log2().item()))

    def one(n, kk):
        w = torch.randint(-128, 128, (E, n, kk // 2), generator=gen, device=device,
                          dtype=torch.int8)
        s = torch.randint(e - 2, e + 3, (E, n, kk // 32), generator=gen, device=device,
                          dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return w, s
    w1, s1 = one(inter, dim) if up else (None, None)
    w3, s3 = one(inter, dim) if up else (None, None)
    w2, s2 = (None, None) if up else one(dim, inter)
    return w1, s1, w3, s3, w2, s2


def _fp8_absdot(x, w, s, quant, group_k=None):
    """|x_q| @ |W|^T in float32: the scale of the rounding error of a float32 accumulation."""
    from dsv4.kernels.decode.fp8_linear import fp8_linear_reference
    wabs = (w.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    return fp8_linear_reference(x.abs(), wabs, s, quant_act=quant, group_k=group_k,
                                out_dtype=torch.float32).float()


def assert_close_bf16(y, ref, x=None, w=None, s=None, quant=True, group_k=None, absdot=None,
                      rtol=2 ** -7, min_equal=0.95):
    """bf16 results: no NaN (the output was poisoned), every element within one bf16 rounding
    (rtol) plus float32 summation error (1e-5 * |x||W|), and most bit-identical to the reference."""
    yf, rf = y.float(), ref.float()
    assert not yf.isnan().any(), f"unwritten / NaN outputs (seed {SEED})"
    if absdot is None and w is not None:
        absdot = _fp8_absdot(x, w, s, quant, group_k)
    bound = rtol * rf.abs() + (0.0 if absdot is None else 1e-5 * absdot) + 1e-30
    bad = (yf - rf).abs() > bound
    assert not bad.any(), (f"{int(bad.sum())} / {bad.numel()} outside tolerance (seed {SEED}); "
                           f"max err {(yf - rf).abs().max().item():.3g}")
    eq = (yf == rf).float().mean().item()
    assert eq >= min_equal, f"only {eq:.3f} bit-identical to the reference (seed {SEED})"


def _swiglu_err(g, u, adg, adu, limit, eps=1e-5):
    """The float32-summation part of the SwiGLU error bound, per output: g and u (exact, before the
    clamp) may each move by 1e-5 * |x||W| (adg / adu: |x| @ |W|^T) and then round to bf16 by up to
    one ulp, which silu(g) * u carries as |u| |silu'(g)| dg + |silu(g)| du; returned as `absdot`
    for assert_close_bf16 (which adds it times 1e-5), so where u nearly cancels the output is judged
    against what its inputs allow. The clamp caps g and u but not their summation error, which
    stays 1e-5 * |x||W| of the unclamped sums. eps: the sums' error per |x||W| where it is not
    1e-5 (the FP8 MMA's accumulation)."""
    if limit > 0:
        u, g = u.clamp(-limit, limit), g.clamp(max=limit)
    dg = eps * 1e5 * adg + 1e5 * 2 ** -8 * g.abs()
    du = eps * 1e5 * adu + 1e5 * 2 ** -8 * u.abs()
    sig = torch.sigmoid(g)
    dsilu = (sig * (1 + g * (1 - sig))).abs()
    return 2 * (u.abs() * dsilu * dg + (g * sig).abs() * du)


def swiglu_absdot(x, w1, s1, w3, s3, limit):
    """_swiglu_err of the FP8 SwiGLU (fp8_swiglu)."""
    from dsv4.kernels.decode.fp8_linear import fp8_linear_reference
    g = fp8_linear_reference(x, w1, s1).float()
    u = fp8_linear_reference(x, w3, s3).float()
    return _swiglu_err(g, u, _fp8_absdot(x, w1, s1, True), _fp8_absdot(x, w3, s3, True), limit)


def fp4_swiglu_absdot(x, idx, rw, w1, s1, w3, s3, limit, eps=1e-5):
    """_swiglu_err of the routed experts' up (fp4_experts_up), row j scaled by rw[j]: [k, inter]."""
    from dsv4.weights.formats import dequantize_fp4_weight
    from dsv4.numerics.quant import fp8_quant_dequant
    xq = fp8_quant_dequant(x.float().reshape(-1), 128).double()
    rows = []
    for j, e in enumerate(idx.tolist()):
        w1d = dequantize_fp4_weight(w1[e], s1[e], torch.float64)
        w3d = dequantize_fp4_weight(w3[e], s3[e], torch.float64)
        g, u = (w1d @ xq).float(), (w3d @ xq).float()
        adg, adu = (w1d.abs() @ xq.abs()).float(), (w3d.abs() @ xq.abs()).float()
        rows.append(rw[j].float().abs() * _swiglu_err(g, u, adg, adu, limit, eps))
    return torch.stack(rows)


def assert_close_f32(y, ref, x, w, s, quant, group_k=None):
    assert not y.isnan().any(), f"unwritten / NaN outputs (seed {SEED})"
    bound = 1e-5 * _fp8_absdot(x, w, s, quant, group_k) + 1e-30
    assert ((y - ref).abs() <= bound).all(), f"seed {SEED}"


# ---- CPU ----------------------------------------------------------------------------------------

def test_available_needs_cuda_and_the_switch(monkeypatch):
    """The kernels serve a CUDA device with triton, unless DSV4_KERNELS=0 (read by the backend)."""
    from dsv4.backend import decision as backend
    assert not backend.resolve("cpu").kernels
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)    # as on a GPU machine
    monkeypatch.setattr(backend, "_triton_importable", lambda: True)
    monkeypatch.setattr(backend, "_cuda_status", lambda *a: "ok")
    assert backend.resolve("cuda:0", options=backend.Options()).kernels
    off = backend.resolve("cuda:0", options=backend.Options.from_env({"DSV4_KERNELS": "0"}))
    assert not off.kernels and off.prefill == "torch" and off.cuda_status == "DSV4_KERNELS=0"


@pytest.mark.skipif(not kernels.triton_importable(), reason="triton is not installed")
def test_configs_fit_the_real_shapes():
    from dsv4.kernels.decode.bf16_linear import bf16_config
    from dsv4.kernels.decode.fp4_experts import down_config, up_config
    from dsv4.kernels.decode.fp8_linear import TUNED, fp8_config
    for n, k in [(1024, 4096), (512, 4096), (32768, 1024), (4096, 8192), (2048, 4096),
                 (4096, 2048), (1536, 7168), (512, 7168), (65536, 1536), (7168, 16384), (128, 128)]:
        for dual in (False, True):
            c = fp8_config(n, k, n, dual)
            assert 128 % c.bn == 0 and 1 <= c.nb <= 32, (n, k, c)
            if (n, k, n, dual) not in TUNED:    # measured configs may use fewer programs
                assert n // c.bn >= min(512, n), (n, k, c)
    c = fp8_config(8192, 4096, 1024)                       # grouped wo_a, G = 8
    assert 1024 % c.bn == 0
    for n, k in [(129280, 4096), (256, 4096), (64, 4096), (100, 384)]:
        assert bf16_config(n, k).nb >= 1
    for k, inter, dim in [(6, 2048, 4096), (6, 3072, 7168)]:
        assert inter % up_config(k, inter, dim).bn == 0
        assert dim % down_config(k, inter, dim).bn == 0


@needs_interpreter
def test_kernels_under_interpreter():
    """TRITON_INTERPRET must be set before triton is imported: run the cases in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(HERE / "test_decode_kernels_interp.py")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


def _aot_supported() -> bool:
    if not kernels.triton_importable():
        return False
    import importlib.util
    spec = importlib.util.find_spec("triton")
    root = Path(spec.origin).parent
    return (root / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _aot_supported(), reason="triton with its bundled ptxas is not installed")
def test_kernels_compile_for_sm90_without_spills():
    """Every launch the Flash and Pro decode makes compiles for sm_90 (no GPU needed) without
    register spills (a few stack bytes outside the loops are tolerated)."""
    from conftest import compile_here_or_apart
    from dsv4.kernels import aot
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    r = compile_here_or_apart(lambda: aot.main(["flash", "pro"]),
                              [sys.executable, "-m", "dsv4.kernels.aot", "flash", "pro"], env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 46, r.stdout
    for ln in lines:   # cuobjdump figures (absent when the tool is not bundled)
        res = dict(re.findall(r"'(\w+)': (\d+)", ln.split("warps=")[-1]))
        assert int(res.get("local", 0)) == 0 and int(res.get("stack", 0)) <= 16, f"spills: {ln}"


# ---- CUDA ---------------------------------------------------------------------------------------

FP8_SHAPES = {   # name: (N, K, G)
    "flash.wq_a": (1024, 4096, 1), "flash.wkv": (512, 4096, 1), "flash.wq_a+wkv": (1536, 4096, 1),
    "flash.wq_b": (32768, 1024, 1), "flash.wo_a": (8192, 4096, 8), "flash.wo_b": (4096, 8192, 1),
    "flash.shared.w1": (2048, 4096, 1), "flash.shared.w2": (4096, 2048, 1),
    "pro.wq_a": (1536, 7168, 1), "pro.wkv": (512, 7168, 1), "pro.wq_b": (65536, 1536, 1),
    "pro.wo_a": (16384, 4096, 16), "pro.wo_b": (7168, 16384, 1), "pro.shared.w1": (3072, 7168, 1),
    "pro.shared.w2": (7168, 3072, 1), "small": (128, 128, 1), "odd": (384, 640, 1),
    "odd.grouped": (768, 384, 3),
}
BF16_SHAPES = {"flash.gate": (256, 4096), "pro.gate": (384, 7168), "compressor": (1024, 4096),
               "indexer.compressor": (256, 4096), "weights_proj": (64, 4096),
               "flash.head": (129280, 4096), "pro.head": (129280, 7168), "odd": (100, 384),
               "one": (1, 128)}
EXPERTS = {"flash": (256, 2048, 4096), "pro": (384, 3072, 7168), "small": (16, 256, 384)}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(FP8_SHAPES))
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_fp8_linear_cuda(name, impl):
    """Both GPU implementations (Triton; CUDA C++ where it is available) against the reference:
    W8A8 and no act quant, bf16 and float32 activations, bf16 and float32 outputs; deterministic;
    Triton's hardware e4m3 cast equals its bit-path decode."""
    from dsv4.kernels.cuda import lib as cuda_cpp
    from dsv4.kernels.decode.fp8_linear import fp8_linear, fp8_linear_reference
    if impl == "cuda" and cuda_cpp.status("cuda") != "ok":
        pytest.skip(f"CUDA C++ kernels unavailable: {cuda_cpp.status('cuda')}")
    n, k, G = FP8_SHAPES[name]
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    w, s = fp8_weight(n, k, gen, device=dev)
    gk = k if G > 1 else None
    for quant in ((False,) if G > 1 else (True, False)):
        for xdt in (torch.bfloat16, torch.float32):
            x = spiky_x(k * G, gen, xdt, dev)
            y = fp8_linear(x, w, s, quant_act=quant, group_k=gk, out=poisoned(1, n, device=dev),
                           impl=impl, strict=True)
            ref = fp8_linear_reference(x, w, s, quant_act=quant, group_k=gk)
            assert_close_bf16(y, ref, x, w, s, quant, group_k=gk)
            again = fp8_linear(x, w, s, quant_act=quant, group_k=gk, impl=impl, strict=True)
            assert torch.equal(y, again), "not deterministic"
            if impl == "triton":
                bits = fp8_linear(x, w, s, quant_act=quant, group_k=gk, native=False)
                assert torch.equal(y, bits), "native e4m3 cast and the bit path disagree"
    x = spiky_x(k * G, gen, torch.bfloat16, dev)                   # float32 output
    y = fp8_linear(x, w, s, quant_act=G == 1, group_k=gk, out_dtype=torch.float32,
                   out=poisoned(1, n, dtype=torch.float32, device=dev), impl=impl, strict=True)
    ref = fp8_linear_reference(x, w, s, quant_act=G == 1, group_k=gk, out_dtype=torch.float32)
    assert_close_f32(y, ref, x, w, s, G == 1, group_k=gk)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["flash.shared.w1", "pro.shared.w1", "small"])
@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_fp8_swiglu_cuda(name, limit):
    """The Triton kernel on the GPU (the CUDA C++ one: test_cuda_kernels.py)."""
    from dsv4.kernels.decode.fp8_linear import fp8_swiglu, fp8_swiglu_reference
    n, k, _ = FP8_SHAPES[name]
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    (w1, s1), (w3, s3) = fp8_weight(n, k, gen, 8.0, dev), fp8_weight(n, k, gen, 8.0, dev)
    x = spiky_x(k, gen, torch.bfloat16, dev)
    a = fp8_swiglu(x, w1, s1, w3, s3, limit, out=poisoned(1, n, device=dev), impl="triton")
    assert_close_bf16(a, fp8_swiglu_reference(x, w1, s1, w3, s3, limit), rtol=2 ** -5,
                      min_equal=0.9, absdot=swiglu_absdot(x, w1, s1, w3, s3, limit))
    assert torch.equal(a, fp8_swiglu(x, w1, s1, w3, s3, limit, impl="triton"))


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(BF16_SHAPES))
def test_bf16_linear_cuda(name):
    from dsv4.kernels.decode.bf16_linear import bf16_linear, bf16_linear_reference
    n, k = BF16_SHAPES[name]
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    w = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).to(torch.bfloat16)
    xdt = torch.float32 if "head" in name else torch.bfloat16
    x = spiky_x(k, gen, xdt, dev)
    absdot = (w.double().abs() @ x.reshape(-1).double().abs()).reshape(1, -1).float()
    y = bf16_linear(x, w, out=poisoned(1, n, dtype=torch.float32, device=dev))
    ref = bf16_linear_reference(x, w)
    assert not y.isnan().any() and ((y - ref).abs() <= 1e-5 * absdot + 1e-30).all()
    assert torch.equal(y, bf16_linear(x, w)), "not deterministic"
    yb = bf16_linear(x, w, out_dtype=torch.bfloat16, out=poisoned(1, n, device=dev))
    assert_close_bf16(yb, bf16_linear_reference(x, w, out_dtype=torch.bfloat16), absdot=absdot)


@pytest.fixture(scope="module", params=list(EXPERTS))
def bank(request):
    E, inter, dim = EXPERTS[request.param]
    gen = fresh_gen("cuda")
    up = fp4_bank(E, inter, dim, gen, gain=4.0, device="cuda")
    down = fp4_bank(E, inter, dim, gen, up=False, device="cuda")
    yield request.param, (E, inter, dim), up[:4] + down[4:]
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_fp4_experts_cuda(bank, limit, impl):
    """Both implementations ("cuda": the CUDA C++ kernels where available)."""
    from dsv4.kernels.decode.fp4_experts import (fp4_experts_down, fp4_experts_down_reference,
                                          fp4_experts_up, fp4_experts_up_reference)
    _, (E, inter, dim), (w1, s1, w3, s3, w2, s2) = bank
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    k = 6
    idx = torch.cat((torch.randperm(E - 1, generator=gen, device=dev)[:k - 1],
                     torch.tensor([E - 1], device=dev))).sort().values   # the last expert: int64 offsets
    rw = torch.rand(k, generator=gen, device=dev) + 0.5
    x = spiky_x(dim, gen, torch.bfloat16, dev)
    a = fp4_experts_up(x, idx, rw, w1, s1, w3, s3, limit, out=poisoned(k, inter, device=dev),
                       impl=impl)
    a_ref = fp4_experts_up_reference(x, idx, rw, w1, s1, w3, s3, limit)
    # where g or u nearly cancel, float32 summation order moves the tiny result by ~eps * |x||W|
    # (of the sums before the clamp, which can be far above the clamped row's largest value); the
    # wgmma kernel's FP8 MMA does not sum a group in IEEE float32: its bound is 2^-12 of |x||W|
    # (test_cuda_kernels' wgmma test)
    from dsv4.kernels.cuda.experts import TUNED_CUDA_UP, up_wg_fits
    cfg = TUNED_CUDA_UP.get((k, inter, dim))
    wg = (impl == "cuda" and cfg is not None and cfg.wgmma
          and up_wg_fits(1, inter, dim, torch.cuda.get_device_capability(dev)))
    assert_close_bf16(a, a_ref, rtol=2 ** -5, min_equal=0.9,
                      absdot=fp4_swiglu_absdot(x, idx, rw, w1, s1, w3, s3, limit,
                                               eps=2 ** -12 if wg else 1e-5))
    assert torch.equal(a, fp4_experts_up(x, idx, rw, w1, s1, w3, s3, limit, impl=impl)), \
        "not deterministic"
    y = fp4_experts_down(a, idx, w2, s2, out=poisoned(1, dim, dtype=torch.float32, device=dev),
                         impl=impl)
    ref = fp4_experts_down_reference(a, idx, w2, s2)
    scale = sum(fp4_experts_down_reference(a[j:j + 1], idx[j:j + 1], w2, s2).abs()
                for j in range(k))
    assert not y.isnan().any() and ((y - ref).abs() <= 2 ** -7 * scale + 1e-30).all(), SEED
    assert (y == ref).float().mean() >= 0.8, SEED
    assert torch.equal(y, fp4_experts_down(a, idx, w2, s2, impl=impl)), "not deterministic"
    add = spiky_x(dim, gen, torch.bfloat16, dev)       # the shared expert's output, in the epilogue
    yb = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16, impl=impl)
    assert torch.equal(yb, (y + add.float()).to(torch.bfloat16))


def test_fp4_experts_down_refuses_a_post_it_cannot_take():
    """fp4_experts_down(post=...) checks the streams before any launch: bf16 res / streams of
    [rows, 4, D], float32 post / comb, out_dtype bf16, streams apart from res."""
    from dsv4.kernels.decode.fp4_experts import fp4_experts_down
    E, I, D, k = 8, 256, 256, 2
    w2 = torch.zeros(E, D, I // 2, dtype=torch.int8)
    s2 = torch.zeros(E, D, I // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    a, idx = torch.zeros(k, I, dtype=torch.bfloat16), torch.tensor([1, 5])
    res = torch.zeros(1, 4, D, dtype=torch.bfloat16)
    pw, comb = torch.zeros(1, 4), torch.zeros(1, 4, 4)
    for bad, kw in (((res, pw, comb, res), {}),                              # in place
                    ((res.float(), pw, comb, res.float()), {}),
                    ((res[:, :3], pw[:, :3], comb[:, :3, :3], res[:, :3].clone()), {}),
                    ((res, pw.double(), comb, torch.empty_like(res)), {}),
                    ((res, pw, comb, torch.empty_like(res)), {"out_dtype": torch.float32})):
        with pytest.raises(ValueError, match="post"):
            fp4_experts_down(a, idx, w2, s2, post=bad, **{"out_dtype": torch.bfloat16, **kw})


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_fp4_experts_down_takes_the_mhc_post(bank, impl):
    """fp4_experts_down(post=...) (DSV4_FUSE_POST on one GPU): the block's mHC post of down's
    bf16 output into the 4 streams, for 1 and 3 rows (the verify rows: the all-experts kernel),
    into poisoned memory: on the CUDA kernel within one bf16 rounding of hc_post of the plain
    output (its float order is the all-reduce post's: float64 of that output within the float32
    bound), deterministic; on Triton exactly hc_post of the plain output (a launch of its own)."""
    from dsv4.kernels.decode.fp4_experts import fp4_experts_down
    from dsv4.kernels.decode.mhc import hc_post
    _, (E, inter, dim), (w1, s1, w3, s3, w2, s2) = bank
    dev, gen, k, C = torch.device("cuda"), fresh_gen("cuda"), 6, 4
    for T in (1, 3):
        idx = torch.cat([torch.randperm(E, generator=gen, device=dev)[:k].sort().values
                         for _ in range(T)])
        a = (torch.randn(T * k, inter, generator=gen, device=dev) * 0.5).to(torch.bfloat16)
        add = spiky_x(dim, gen, torch.bfloat16, dev).repeat(T, 1)
        res = torch.randn(T, C, dim, generator=gen, device=dev).to(torch.bfloat16)
        pw = 2 * torch.rand(T, C, generator=gen, device=dev)
        comb = torch.rand(T, C, C, generator=gen, device=dev)
        y = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16, rows=T, impl=impl)
        via = hc_post(y.view(T, dim), res, pw, comb)
        streams = poisoned(T, C, dim, device=dev)
        got = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16, rows=T,
                               impl=impl, post=(res, pw, comb, streams))
        assert got is streams and not got.isnan().any(), (T, impl)
        if impl == "triton":
            assert torch.equal(got, via), T
            continue
        terms = (pw.double().unsqueeze(-1) * y.view(T, 1, dim).double(),
                 comb.double().unsqueeze(-1) * res.double().unsqueeze(-2))
        want, size = terms[0] + terms[1].sum(1), terms[0].abs() + terms[1].abs().sum(1)
        assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 8 * 2 ** -24 * size).all()
        assert ((got.double() - via.double()).abs()
                <= 2 ** -7 * via.double().abs() + 16 * 2 ** -24 * size).all()
        again = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16, rows=T,
                                 impl=impl, post=(res, pw, comb, torch.empty_like(res)))
        assert torch.equal(again, got), "not deterministic"
        print(T, "the Triton hc_post's bits:", bool(torch.equal(got, via)))


def flash_layer_steps():
    """A Flash-shaped ratio-4 layer (indexer + compressor; layer 2 of 3, seeded weights) on the
    GPU and 12 decode inputs -> (blk, run): run(graph, options) binds the layer with `options`
    and decodes the 12 steps (eager, or replayed from a CUDA graph captured after a warm-up) ->
    (outputs [12, 1, c, D], kv cache)."""
    from dsv4.backend import branches
    from dsv4.backend.binding import bind_block
    from dsv4.backend.ops import Ops
    from dsv4.model.block import Block
    from dsv4.model.state import LayerState
    from dsv4.numerics.quant import hadamard_matrix
    from dsv4.weights.device_weights import DeviceWeights
    from dsv4.weights.presets import get_preset
    cfg = get_preset("flash", n_layers=3)
    dev, layer = torch.device("cuda"), 2
    blk = Block(cfg, layer, dev, hadamard_matrix(cfg.index_head_dim, dev))
    src = DeviceWeights(cfg, seed=SEED)
    for name, t in blk.tensors(f"layers.{layer}").items():
        src.load_into(name, t)
    gen = fresh_gen("cuda")
    hs = [torch.randn(1, cfg.hc_mult, cfg.dim, generator=gen, device=dev).to(torch.bfloat16)
          for _ in range(12)]
    branches.prepare(dev)

    def run(graph: bool, options):
        bind_block(blk, Ops.for_device(dev, cfg=cfg, options=options))
        st = LayerState.allocate(cfg, cfg.ratio(layer), 256, torch.bfloat16, dev)
        h_in = hs[0].clone()
        pos, ids = torch.zeros(1, dtype=torch.int64, device=dev), torch.tensor([7], device=dev)
        step = lambda: blk.decode(h_in, ids, pos, st)        # noqa: E731
        outs = []
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            st.reset()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step()
        for p, h in enumerate(hs):
            h_in.copy_(h)
            pos.fill_(p)
            if graph:
                g.replay()
                outs.append(out.clone())
            else:
                outs.append(step().clone())
        return torch.stack(outs), st.kv_cache.clone()
    return blk, run


@pytest.mark.cuda
def test_the_fused_post_decodes_a_layer_as_graph_and_eager_alike():
    """DSV4_FUSE_POST (the default) on one GPU (the FFN's mHC post in the routed experts' down): a
    Flash-shaped ratio-4 layer decodes 12 steps with the same bits eager and from a CUDA graph
    (with the PDL and branch switches as decoding runs), and within bf16 roundings of the layer
    without it (the same kv cache: the post comes after the attention)."""
    from dsv4.backend.decision import Options
    blk, run = flash_layer_steps()
    with torch.inference_mode():
        eager, graph = run(False, Options(fuse_post=True)), run(True, Options(fuse_post=True))
        assert blk.post_in_down
        plain = run(False, Options(fuse_post=False))
        assert not blk.post_in_down
    assert torch.equal(eager[0], graph[0]) and torch.equal(eager[1], graph[1])
    assert torch.equal(eager[1], plain[1])
    a, b = eager[0].float(), plain[0].float()
    assert not a.isnan().any()
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
    assert rel < 1e-2, rel


@pytest.mark.cuda
def test_the_fused_mix_decodes_a_layer_as_graph_and_eager_alike():
    """DSV4_FUSE_MIX (the default) on one GPU (the attention's mHC post makes the FFN's partial
    mixes: hc_post_mix): a Flash-shaped ratio-4 layer decodes 12 steps with the same bits eager
    and from a CUDA graph, and within bf16 roundings of the layer without it (the same kv cache:
    the fusion comes after the attention)."""
    from dsv4.backend.decision import Options
    blk, run = flash_layer_steps()
    with torch.inference_mode():
        eager, graph = run(False, Options(fuse_mix=True)), run(True, Options(fuse_mix=True))
        plain = run(False, Options(fuse_mix=False))
    assert torch.equal(eager[0], graph[0]) and torch.equal(eager[1], graph[1])
    assert torch.equal(eager[1], plain[1])
    a, b = eager[0].float(), plain[0].float()
    assert not a.isnan().any() and not torch.equal(a, b)     # the fused path ran: other bits
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
    assert rel < 1e-2, rel


def capture_step(step, strict: bool = True):
    """Warm `step` up on a side stream (compiles, allocates), then capture it in a CUDA graph (under
    sync debug mode "error" when strict: any host sync raises); returns (graph, its outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error" if strict else "default")
    try:
        with torch.cuda.graph(g):
            outs = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return g, outs


@pytest.mark.cuda
def test_kernels_capture_in_a_cuda_graph():
    """Warm up (compile), capture, then replay on new inputs: the same results as eager calls."""
    from dsv4.kernels.decode.bf16_linear import bf16_linear
    from dsv4.kernels.decode.fp4_experts import fp4_experts_down, fp4_experts_up
    from dsv4.kernels.decode.fp8_linear import fp8_linear
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    w, s = fp8_weight(1024, 4096, gen, device=dev)
    hw = torch.randn(1000, 4096, generator=gen, device=dev).to(torch.bfloat16)
    w1, s1, w3, s3, _, _ = fp4_bank(16, 256, 4096, gen, device=dev)
    *_, w2, s2 = fp4_bank(16, 256, 4096, gen, up=False, device=dev)
    x = spiky_x(4096, gen, torch.bfloat16, dev)
    idx = torch.tensor([1, 4, 5, 9, 12, 15], device=dev)
    rw = torch.rand(6, generator=gen, device=dev)

    def step():
        a = fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 10.0)
        return (fp8_linear(x, w, s), bf16_linear(x, hw), fp4_experts_down(a, idx, w2, s2))
    g, outs = capture_step(step)
    x.copy_(spiky_x(4096, gen, torch.bfloat16, dev))
    idx.copy_(torch.tensor([0, 2, 3, 7, 8, 11], device=dev))
    g.replay()
    for got, want in zip(outs, step()):
        assert torch.equal(got, want)


def _fill_moe(cfg, layer_id, dev, ops=None):
    from dsv4.backend.binding import bind_moe
    from dsv4.model.moe import MoE
    from dsv4.weights.device_weights import DeviceWeights
    moe = MoE(cfg, layer_id, "fp8", cfg.expert_format, dev)
    if ops is not None:
        bind_moe(moe, ops)
    src = DeviceWeights(cfg, seed=SEED)
    for name, t in moe.tensors(f"layers.{layer_id}.ffn").items():
        src.load_into(name, t)
    return moe


@pytest.mark.cuda
def test_linear_and_moe_dispatch_match_the_torch_path():
    """The same weights with the backend's kernels and with DSV4_KERNELS=0 (the torch path):
    Linear and MoE.decode agree within rounding."""
    from dsv4.backend.binding import bind_moe
    from dsv4.backend.decision import Options
    from dsv4.backend.fused import linear as fused_linear
    from dsv4.backend.ops import Ops
    from dsv4.kernels.decode.fp8_linear import fp8_linear
    from dsv4.model.linear import Linear
    from dsv4.weights.presets import get_preset
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    cfg = get_preset("flash", n_layers=4)
    on = Ops.for_device(dev, cfg=cfg, options=Options())
    off = Ops.for_device(dev, cfg=cfg, options=Options.from_env({"DSV4_KERNELS": "0"}))
    lin = Linear(1024, 4096, "fp8", dev)
    lin.weight, lin.scale = fp8_weight(1024, 4096, gen, device=dev)
    gate = Linear(256, 4096, "bf16", dev)
    fused_linear.bind(lin, on)
    fused_linear.bind(gate, on)
    gate.weight = (torch.randn(256, 4096, generator=gen, device=dev) / 64).to(torch.bfloat16)
    x = torch.randn(1, 4096, generator=gen, device=dev).to(torch.bfloat16)
    y = lin(x, torch.bfloat16)
    assert torch.equal(y, fp8_linear(x, lin.weight, lin.scale)), "Linear did not use the kernel"
    g = gate(x, torch.float32)
    moes = [_fill_moe(cfg, layer, dev, on) for layer in (0, 3)]   # a hash layer and a scored one
    ids = torch.tensor([1234], device=dev)
    got = [m.decode(x, ids) for m in moes]
    fused_linear.bind(lin, off)                  # the same weights, the torch path
    fused_linear.bind(gate, off)
    assert_close_bf16(y, lin(x, torch.bfloat16), x, lin.weight, lin.scale, True, min_equal=0.9)
    gt = gate(x, torch.float32)
    assert ((g - gt).abs() <= 1e-5 * (gate.weight.float().abs() @ x.float().abs()[0])).all()
    for m, k in zip(moes, got):
        bind_moe(m, off)
        t = m.decode(x, ids)
        assert k.dtype == t.dtype == torch.bfloat16 and not k.isnan().any()
        rel = ((k.float() - t.float()).norm() / t.float().norm()).item()
        assert rel < 1e-2, f"MoE kernel path vs torch path: relative error {rel:.3g} (seed {SEED})"


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["flash", "pro"])
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_route_decode_cuda(preset, impl):
    """The routing kernels at the real expert counts (libdevice exp/log1p, IEEE sqrt/div; the
    Triton one and the default, the CUDA C++ one where available) pick the torch path's experts,
    in id order, with its weights to float32 rounding."""
    from dsv4.kernels.decode.route import route_decode, route_reference
    from dsv4.weights.presets import get_preset
    cfg = get_preset(preset)
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    tid2eid = torch.stack([torch.randperm(E, generator=gen, device=dev)[:k] for _ in range(64)])
    for trial in range(20):
        logits = torch.randn(1, E, generator=gen, device=dev) * 4
        bias = torch.randn(E, generator=gen, device=dev) * 0.05
        for func in ("sqrtsoftplus", "sigmoid", "softmax"):
            w, idx = route_decode(logits, k, func, cfg.route_scale, bias=bias, impl=impl)
            rw, ridx = route_reference(logits, k, func, cfg.route_scale, bias=bias)
            assert torch.equal(idx, ridx), (func, idx, ridx, SEED)
            assert torch.allclose(w, rw, rtol=1e-6, atol=0), (func, SEED)
        ids = torch.tensor([trial], device=dev)
        w, idx = route_decode(logits, k, cfg.score_func, cfg.route_scale, tid2eid=tid2eid, ids=ids,
                              impl=impl)
        rw, ridx = route_reference(logits, k, cfg.score_func, cfg.route_scale, tid2eid=tid2eid,
                                   ids=ids)
        assert torch.equal(idx, ridx) and torch.allclose(w, rw, rtol=1e-6, atol=0), SEED


@pytest.mark.cuda
def test_multi_matrix_launches_equal_separate_calls_cuda():
    """fp8_linear2 (wq_a + wkv) and bf16_linear_multi (compressor / indexer projections) at the
    Flash shapes: each output bit-identical to its own launch with the same config; the add
    epilogue equals the separate float32 add."""
    from dsv4.kernels.decode.bf16_linear import bf16_config, bf16_linear, bf16_linear_multi
    from dsv4.kernels.decode.fp8_linear import fp8_config, fp8_linear, fp8_linear2
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    (wa, sa), (wb, sb) = fp8_weight(1024, 4096, gen, device=dev), fp8_weight(512, 4096, gen,
                                                                              device=dev)
    x = spiky_x(4096, gen, torch.bfloat16, dev)
    cfg = fp8_config(1536, 4096, 1536)
    ya, yb = fp8_linear2(x, wa, sa, wb, sb, config=cfg)
    assert torch.equal(ya, fp8_linear(x, wa, sa, config=cfg))
    assert torch.equal(yb, fp8_linear(x, wb, sb, config=cfg))
    w2, s2 = fp8_weight(4096, 2048, gen, device=dev)
    a = spiky_x(2048, gen, torch.bfloat16, dev)
    add = torch.randn(1, 4096, generator=gen, device=dev)
    got = fp8_linear(a, w2, s2, add=add)                    # the add epilogue: Triton only
    assert torch.equal(got, (add + fp8_linear(a, w2, s2, impl="triton").float()
                             ).to(torch.bfloat16))
    ns = [1024, 1024, 256, 256, 64]
    ws = [(torch.randn(n, 4096, generator=gen, device=dev) / 64).to(torch.bfloat16) for n in ns]
    dts = [torch.float32] * 4 + [torch.bfloat16]
    bcfg = bf16_config(sum(ns), 4096)
    for y, w, dt in zip(bf16_linear_multi(x, ws, dts), ws, dts):
        assert torch.equal(y, bf16_linear(x, w, out_dtype=dt, config=bcfg))


@pytest.mark.cuda
def test_pdl_and_branches_change_no_bit():
    """Programmatic dependent launch, the captured parallel branches (dsv4.backend.branches) and
    the L2 prefetch of weights (dsv4.backend.fused.prefetch) only reorder launches or hint: a
    Flash-shaped layer's decode steps (eager and replayed from a CUDA graph) give the same bits
    with all on, and with DSV4_PDL=0 / DSV4_OVERLAP=0 / DSV4_PREFETCH=0 (the layer's backend
    resolved with those switches)."""
    from dsv4.backend.decision import Options
    from dsv4.kernels import common
    if not common.pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs sm_90+")
    _, steps = flash_layer_steps()
    run = lambda graph, **switches: steps(graph, Options.from_env(switches))   # noqa: E731
    with torch.inference_mode():
        on = [run(False, DSV4_PREFETCH="1"), run(True, DSV4_PREFETCH="1")]
        no_branch = run(True, DSV4_OVERLAP="0", DSV4_PREFETCH="1")
        no_prefetch = run(True, DSV4_PREFETCH="0")
        off = [run(graph, DSV4_OVERLAP="0", DSV4_PDL="0", DSV4_PREFETCH="0")
               for graph in (False, True)]
    names = ["eager", "graph", "graph without branches", "graph without prefetch"]
    for name, a, b in zip(names, on + [no_branch, no_prefetch], off + [off[1], off[1]]):
        for what, u, v in zip(("outputs", "kv cache"), a, b):
            assert torch.equal(u, v), (f"{name}: {what} differ from DSV4_PDL=0 / DSV4_OVERLAP=0 / "
                                       f"DSV4_PREFETCH=0")


@pytest.mark.cuda
def test_argmax_rows_cuda():
    """The greedy pick's kernel gives torch's argmax on the GPU (the first of ties, the first NaN,
    bf16, Flash's vocabulary), in a CUDA graph too; sampling's first_argmax takes it where the
    Triton kernels may run."""
    from dsv4.kernels.decode.argmax import argmax_reference, argmax_rows
    from dsv4.runtime import sampling
    g = fresh_gen("cuda")
    rows = [torch.randn(129280, generator=g, device="cuda"),
            torch.randn(4, 129280, generator=g, device="cuda").to(torch.bfloat16),
            torch.full((2, 70000), float("-inf"), device="cuda")]
    x = torch.randn(3, 129280, generator=g, device="cuda")
    x[0, [7, 129279]] = 50.0
    x[1, [40000, 90000]] = float("nan")
    x[2, [8191, 8192, 16384]] = float("inf")
    rows.append(x)
    for x in rows:
        assert torch.equal(argmax_rows(x), argmax_reference(x)), (x.shape, x.dtype)
        assert torch.equal(sampling.first_argmax(x), argmax_reference(x))
    assert sampling._kernel_ops(x.device, os.environ.get("DSV4_KERNELS")) is not None
    logits = torch.randn(129280, device="cuda")
    out = argmax_rows(logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(logits)
    for _ in range(3):
        logits.copy_(torch.randn(129280, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, argmax_reference(logits))
