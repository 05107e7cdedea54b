"""Fused mHC kernels (dsv4/kernels/decode/mhc.py) against the torch reference, and their decode rows against
one-row calls (bit for bit): Triton interpreter on the CPU (in a subprocess, since TRITON_INTERPRET
must be set before triton is imported) and CUDA."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO, input_seed, needs_interpreter

CHECK = textwrap.dedent("""
    import sys, torch
    from dsv4.kernels.decode import mhc as K
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    dev = sys.argv[2]
    for D in [int(d) for d in sys.argv[3].split(",")]:
        h = torch.randn(1, 4, D, generator=g).bfloat16().to(dev)
        fn = (torch.randn(24, 4 * D, generator=g) / (4 * D) ** 0.5).to(dev)
        scale = (0.5 + 0.1 * torch.randn(3, generator=g)).to(dev)
        base = (0.5 * torch.randn(24, generator=g)).to(dev)
        w = (1 + 0.1 * torch.randn(D, generator=g)).to(dev)
        x, post, comb = K.hc_pre_norm(h, fn, scale, base, w, 1e-6, 1e-6, 20)
        xr, pr, cr = K.hc_pre_norm_reference(h, fn, scale, base, w, 1e-6, 1e-6, 20)
        assert torch.isfinite(x.float()).all()
        assert (x.float() - xr.float()).abs().max() <= 2 ** -7 * xr.float().abs().max(), D
        assert torch.allclose(post, pr, atol=1e-5) and torch.allclose(comb, cr, atol=1e-5), D
        out = K.hc_post(x, h, post, comb)
        ref = K.hc_post_reference(x, h, post, comb)
        assert (out.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max(), D
        into = torch.full_like(h, float("nan"))
        assert K.hc_post(x, h, post, comb, out=into) is into and torch.equal(into, out), D
        for bad in (h, into[:, :2], into.float()):
            try:
                K.hc_post(x, h, post, comb, out=bad)
                raise AssertionError("hc_post accepted a bad out")
            except ValueError:
                pass
        # the attention's post with the FFN's partial mixes in one launch (hc_post_mix): the
        # streams of hc_post (its bits in the interpreter: the same expression), x / post / comb
        # within rounding of the two-launch path and of the reference; rows as one-row calls
        both, mixed = K.hc_post_mix(x, h, post, comb, fn)
        if sys.argv[4] == "1":
            assert torch.equal(both, out), D
        else:
            assert (both.float() - out.float()).abs().max() <= 2 ** -7 * out.float().abs().max()
        fx, fp, fc = K.hc_pre_norm(both, fn, scale, base, w, 1e-6, 1e-6, 20, mixed=mixed)
        for want in (K.hc_pre_norm(both, fn, scale, base, w, 1e-6, 1e-6, 20),
                     K.hc_pre_norm_reference(both, fn, scale, base, w, 1e-6, 1e-6, 20)):
            wx = want[0].float()
            assert (fx.float() - wx).abs().max() <= 2 ** -7 * wx.abs().max()
            assert torch.allclose(fp, want[1], atol=1e-5) and torch.allclose(fc, want[2], atol=1e-5)
        hs3 = torch.randn(3, 4, D, generator=g).bfloat16().to(dev)
        x3 = torch.randn(3, D, generator=g).bfloat16().to(dev)
        p3, c3 = post.expand(3, 4).contiguous(), comb.expand(3, 4, 4).contiguous()
        b3, m3 = K.hc_post_mix(x3, hs3, p3, c3, fn)
        r3 = K.hc_pre_norm(b3, fn, scale, base, w, 1e-6, 1e-6, 20, mixed=m3)
        for t in range(3):
            b1, m1 = K.hc_post_mix(x3[t:t + 1], hs3[t:t + 1], p3[t:t + 1], c3[t:t + 1], fn)
            assert torch.equal(b3[t:t + 1], b1) and torch.equal(m3[0][t:t + 1], m1[0]), D
            r1 = K.hc_pre_norm(b1, fn, scale, base, w, 1e-6, 1e-6, 20, mixed=m1)
            assert all(torch.equal(a[t:t + 1], b) for a, b in zip(r3, r1)), D
        fh = (torch.randn(4, 4 * D, generator=g) / (4 * D) ** 0.5).to(dev)
        y = K.hc_head_norm(h, fh, scale[:1], base[:4], w, 1e-6, 1e-6)
        yr = K.hc_head_norm_reference(h, fh, scale[:1], base[:4], w, 1e-6, 1e-6)
        assert (y.float() - yr.float()).abs().max() <= 2 ** -7 * yr.float().abs().max(), D
        # deterministic: same inputs, bit-identical outputs
        assert torch.equal(K.hc_pre_norm(h, fn, scale, base, w, 1e-6, 1e-6, 20)[0], x)
        # decode rows (the speculative verify rows): row t of a 3-row call == its one-row call
        hs = torch.randn(3, 4, D, generator=g).bfloat16().to(dev)
        xs, ps, cs = K.hc_pre_norm(hs, fn, scale, base, w, 1e-6, 1e-6, 20)
        outs = K.hc_post(xs, hs, ps, cs)
        ys = K.hc_head_norm(hs, fh, scale[:1], base[:4], w, 1e-6, 1e-6)
        for t in range(3):
            one = K.hc_pre_norm(hs[t:t + 1], fn, scale, base, w, 1e-6, 1e-6, 20)
            assert all(torch.equal(a[t:t + 1], b) for a, b in zip((xs, ps, cs), one)), D
            assert torch.equal(outs[t:t + 1], K.hc_post(*one[:1], hs[t:t + 1], *one[1:])), D
            assert torch.equal(ys[t:t + 1], K.hc_head_norm(hs[t:t + 1], fh, scale[:1], base[:4],
                                                           w, 1e-6, 1e-6)), D
    print("ok")
""")


def _run(dev, dims, interp):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if interp:
        env["TRITON_INTERPRET"] = "1"
    seed = str(input_seed(1))
    p = subprocess.run([sys.executable, "-c", CHECK, seed, dev, dims, "1" if interp else "0"],
                       env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


@needs_interpreter
def test_mhc_kernels_interpreter():
    _run("cpu", "256,384", interp=True)


@pytest.mark.cuda
def test_mhc_kernels_cuda_real_shapes():
    _run("cuda", "128,256,4096,7168", interp=False)


@pytest.mark.cuda
def test_block_decode_fused_vs_torch_mhc():
    """Block.decode takes the fused mHC kernels where the backend has them: bf16 activations,
    hc_mult * dim a multiple of 256 (and one row per call: Block.decode); not float32 ones."""
    from dsv4.backend.decision import resolve
    from dsv4.weights.presets import TINY
    assert TINY.hc_mult * TINY.dim % 256 == 0
    assert resolve("cuda", torch.bfloat16, TINY).mhc_decode
    assert not resolve("cuda", torch.float32, TINY).mhc_decode
    assert not resolve("cuda", torch.bfloat16, TINY.replace(hc_mult=1)).mhc_decode   # 128


def _compiled(fn) -> int:
    """Binaries Triton holds for JIT function `fn` (every device; the kernel cache comes first)."""
    return sum(len(c[0]) for c in fn.device_caches.values())


@pytest.mark.cuda
def test_sinkhorn_branch_in_capture(monkeypatch):
    """Captured with an mHC branch on, hc_pre_norm launches x and the Sinkhorn separately (the
    Sinkhorn on the branch's side stream): the same bits as the eager two-program launch, and no
    binary compiled during capture (the eager warm-up compiled the one binary all launches use)."""
    from dsv4.backend import branches
    from dsv4.backend.decision import BRANCHES
    from dsv4.kernels.decode import mhc as K
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(3)
    D = 4096
    h = torch.randn(1, 4, D, generator=g, device=dev).bfloat16()
    fn = torch.randn(24, 4 * D, generator=g, device=dev) / (4 * D) ** 0.5
    scale = 0.5 + 0.1 * torch.randn(3, generator=g, device=dev)
    base = 0.5 * torch.randn(24, generator=g, device=dev)
    w = 1 + 0.1 * torch.randn(D, generator=g, device=dev)
    branches.prepare(dev)

    def step():
        br = branches.Branch(h, "mhc", frozenset(BRANCHES), lane=2, fork=False)
        out = K.hc_pre_norm(h, fn, scale, base, w, 1e-6, 1e-6, 20, br)
        on = br.on
        br.join()
        return out, on
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (want, on) = step()                      # warm-up: eager, one launch of two programs
    torch.cuda.current_stream().wait_stream(side)
    assert not on
    n = _compiled(K._pre_finish_kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, on = step()
    assert on, "the branch did not fork inside capture"
    assert _compiled(K._pre_finish_kernel) == n, "a binary was compiled during capture"
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
