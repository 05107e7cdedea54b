"""Component math of the forward: mHC, RoPE, activation quant, Hadamard, sparse attention."""
import math

import torch

from dsv4.numerics.sparse import sparse_attention
from dsv4.weights.formats import FP8_MAX
from dsv4.numerics.mhc import hc_post, hc_pre, sinkhorn_split
from dsv4.weights.presets import TINY
from dsv4.numerics.quant import fp4_quant_dequant, fp8_quant_dequant, hadamard, hadamard_matrix
from dsv4.numerics.rope import apply_rope, cos_sin, rope_frequencies


def test_sinkhorn_split_is_doubly_stochastic_and_eps_placement():
    g = torch.Generator().manual_seed(0)
    mixes = torch.randn(5, 24, generator=g)
    scale, base = torch.rand(3, generator=g), torch.randn(24, generator=g)
    pre, post, comb = sinkhorn_split(mixes, scale, base, 4, 20, 1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-5)   # columns normalised last
    assert torch.allclose(comb.sum(-1), torch.ones(5, 4), atol=1e-3)
    assert torch.all(pre > 1e-6) and torch.all(pre < 1 + 1e-6)
    assert torch.all(post >= 0) and torch.all(post <= 2)
    # one iteration: softmax + eps then one column normalisation, exactly
    _, _, c1 = sinkhorn_split(mixes, scale, base, 4, 1, 1e-6)
    c = (mixes[:, 8:].view(5, 4, 4) * scale[2] + base[8:].view(4, 4)).softmax(-1) + 1e-6
    assert torch.equal(c1, c / (c.sum(-2, keepdim=True) + 1e-6))


def test_hc_post_comb_first_index_is_input_stream():
    x = torch.zeros(1, 3)
    res = torch.stack([torch.full((3,), float(i + 1)) for i in range(4)]).unsqueeze(0)   # [1,4,3]
    post = torch.zeros(1, 4)
    comb = torch.zeros(1, 4, 4)
    comb[0, 2, 0] = 1.0            # input stream 2 -> output stream 0
    out = hc_post(x, res, post, comb)
    assert out[0, 0].tolist() == [3.0, 3.0, 3.0] and out[0, 1].abs().sum() == 0


def test_hc_pre_weighted_sum_of_copies():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 4, 8, generator=g)
    fn, scale, base = torch.zeros(24, 32), torch.zeros(3), torch.zeros(24)
    x, post, comb = hc_pre(h, fn, scale, base, 1e-6, 1e-6, 20)
    # zero mixes: pre = sigmoid(0) + eps for every copy
    assert torch.allclose(x, h.sum(1) * (0.5 + 1e-6), atol=1e-6)
    assert torch.allclose(comb, torch.full((2, 4, 4), 0.25), atol=1e-5)


def test_rope_inverse_and_interleaved_pairs():
    cfg = TINY
    f = rope_frequencies(cfg, 4)
    pos = torch.tensor([0, 5, 100])
    x = torch.randn(3, 2, cfg.head_dim)
    y = apply_rope(x, cos_sin(pos, f))
    assert torch.equal(y[..., :64], x[..., :64])                        # nope dims untouched
    assert torch.allclose(y[0], x[0])                                   # position 0 is identity
    assert torch.allclose(apply_rope(y, cos_sin(pos, f), inverse=True), x, atol=1e-5)
    a, b = x[1, 0, 64], x[1, 0, 65]                                     # pair 0 rotates by 5*f0
    ang = 5 * f[0].item()
    assert math.isclose(y[1, 0, 64].item(), a * math.cos(ang) - b * math.sin(ang), rel_tol=1e-5)


def test_yarn_only_on_compressed_layers():
    f0, f4 = rope_frequencies(TINY, 0), rope_frequencies(TINY, 4)
    base0 = 1.0 / (TINY.rope_theta ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.equal(f0, base0)
    base4 = 1.0 / (TINY.compress_rope_theta ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.equal(f4[:1], base4[:1])                               # highest frequency kept
    assert torch.allclose(f4[-1], base4[-1] / TINY.rope_factor)         # low ones divided by factor


def test_fp8_act_quant_power_of_two_scales_and_exact_values():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=g) * 10
    y = fp8_quant_dequant(x, 128)
    blocks = y.view(4, 2, 128)
    amax = x.view(4, 2, 128).abs().amax(-1)
    s = torch.pow(2.0, torch.ceil(torch.log2(amax / FP8_MAX)))
    q = blocks / s[..., None]
    assert torch.equal(q, q.to(torch.float8_e4m3fn).float())           # on the e4m3 grid
    assert torch.equal(y.to(torch.bfloat16).float(), y)                # exact in bf16
    assert ((y - x).abs() <= s.repeat_interleave(128, -1).view(4, 256) * 16).all()
    z = fp8_quant_dequant(torch.zeros(1, 128), 128)                     # amax floor: no NaN
    assert torch.equal(z, torch.zeros(1, 128))


def test_fp4_act_quant_grid():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 64, generator=g)
    y = fp4_quant_dequant(x, 32)
    amax = x.view(2, 2, 32).abs().amax(-1)
    s = torch.pow(2.0, torch.ceil(torch.log2(amax / 6)))
    q = (y.view(2, 2, 32) / s[..., None]).abs()
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert torch.isin(q, grid).all()


def test_hadamard_orthonormal():
    h = hadamard_matrix(128)
    assert torch.equal(h @ h.t(), 128 * torch.eye(128))
    x = torch.randn(3, 128)
    y = hadamard(x, h)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(hadamard(y, h), x, atol=1e-5)                 # self-inverse


def _dense_reference(q, kv, idx, sink, scale):
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        sel = [j for j in idx[i].tolist() if j >= 0]
        k = kv[sel].double()
        for h in range(q.shape[1]):
            s = (k @ q[i, h].double()) * scale
            m = torch.maximum(s.max(), sink[h].double())
            p = torch.exp(s - m)
            out[i, h] = ((p @ k) / (p.sum() + torch.exp(sink[h].double() - m))).float()
    return out


def test_sparse_attention_matches_dense_reference_with_sink_and_masking():
    g = torch.Generator().manual_seed(5)
    q, kv = torch.randn(3, 4, 16, generator=g), torch.randn(10, 16, generator=g)
    idx = torch.tensor([[0, 3, -1, 7], [9, -1, -1, 2], [1, 1, 4, 5]])
    sink = torch.randn(4, generator=g)
    got = sparse_attention(q, kv, idx, sink, 0.25)
    assert torch.allclose(got, _dense_reference(q, kv, idx, sink, 0.25), atol=1e-5)
    # the sink adds mass to the denominator only: a huge sink drives the output to zero
    assert sparse_attention(q, kv, idx, torch.full((4,), 80.0), 0.25).abs().max() < 1e-20
    # bf16 path: probabilities rounded to bf16 for P.V, close to the float32 result
    got16 = sparse_attention(q.bfloat16(), kv.bfloat16(), idx, sink, 0.25)
    assert got16.dtype == torch.bfloat16 and torch.allclose(got16.float(), got, atol=3e-2)


def test_topk_lowest_breaks_ties_toward_the_lower_column():
    from dsv4.numerics.sparse import topk_lowest
    x = torch.tensor([[0.0, 1.0, -0.0, 1.0, 0.0, float("-inf"), 2.0, -3.0, -1e-30]])
    assert topk_lowest(x, 9).tolist() == [[6, 1, 3, 0, 2, 4, 8, 7, 5]]
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        for _ in range(50):
            y = (torch.randn(7, 50, generator=g) * 3).round().to(dt)     # many exact ties
            y[y.abs() > 4] = float("-inf")
            k = int(torch.randint(1, 51, (1,), generator=g))
            want = (y.float() + 0.0).sort(dim=-1, descending=True, stable=True).indices[..., :k]
            assert torch.equal(topk_lowest(y, k), want)
