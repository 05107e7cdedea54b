"""A transformers model driven through graphs/ (examples/hf_decoder.py): on the CPU, greedy tokens
equal the library's own generate() for 64 new tokens (Llama, Qwen2, Mixtral, Qwen2-MoE) with logits
inside the tolerance its own two eager paths meet; prefill == token-by-token steps; a new sequence
reuses the cache; no host sync in a step; debug mode watches the model's cache; the refusals. On a
GPU: graph == eager bit for bit, graph tokens == generate() tokens, and a two-GPU split."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers",
                    reason="transformers is not installed (the 'dev' extra brings it)")
from examples import hf_decoder as hd  # noqa: E402 - after the skip

if not hd.transformers_supported():
    pytest.skip(f"transformers {hd.transformers.__version__} installed; examples/hf_decoder.py "
                "needs >= 5.24, < 6 (the 'dev' extra)", allow_module_level=True)

from graphs import DebugPointerError, find_host_syncs  # noqa: E402

PROMPT = [7, 21, 300, 42, 5, 99, 12]
N_NEW = 64
FAMILIES = ["llama", "qwen2", "mixtral", "qwen2_moe"]
# float32 reassociation allowance, scaled to the logits: the library's own static-cache and
# dynamic-cache generate() differ by ~5e-7 here (max |logit| ~1.5), 30x inside it
RTOL_OF_MAX = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Tiny matrices: a second intra-op thread only adds synchronisation (5x slower on a shared
    2-core machine). Reference and embedding run under the same setting; restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def reference(model, prompt, n, **kw):
    """transformers' own greedy generate(): (new ids, their logits [n, v] f32 on the CPU)."""
    out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False,
                         max_new_tokens=n, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().cpu()


def assert_same_greedy(tokens, logits, ref_tokens, ref_logits, rel=RTOL_OF_MAX):
    """Same tokens, logits within rel * max|logit|, and the equality is not luck: at every step the
    reference's top-1/top-2 margin is > 10x that tolerance, so any run within it (on any machine)
    picks the same token."""
    tol = rel * float(ref_logits.abs().max())
    top2 = ref_logits.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]                                   # [n]
    assert float(margin.min()) > 10 * tol, (
        f"the reference's smallest top-1/top-2 margin {float(margin.min()):.3g} (step "
        f"{int(margin.argmin())}) is not decisive against the tolerance {tol:.3g}: pick a "
        "wider init or another seed; this test must not pass by luck")
    if tokens != ref_tokens:
        t = next(i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)
        diff = float((logits[t] - ref_logits[t]).abs().max())
        pytest.fail(f"tokens differ first at step {t}: {tokens[t]} vs {ref_tokens[t]} (reference "
                    f"margin {float(margin[t]):.3g}, max |logit diff| there {diff:.3g})")
    diff = float((logits - ref_logits).abs().max())
    assert diff <= tol, f"max |logit diff| {diff:.3g} > tolerance {tol:.3g}"
    assert len(set(tokens)) > 3, f"decode looks stuck: {tokens}"


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_segments_give_generate_tokens(family):
    model = hd.build_model(family)
    ref_tokens, ref_logits = reference(model, PROMPT, N_NEW)
    lib_tokens, lib_logits = reference(model, PROMPT, N_NEW, cache_implementation="static")
    assert_same_greedy(lib_tokens, lib_logits, ref_tokens, ref_logits)   # the library vs itself
    with hd.HFGraphDecoder(model, max_seq_len=96, mode="eager") as dec:
        assert dec.decoder.mode == "eager" and dec.decoder.n_graphs == 0
        assert list(dec.decoder.placement) == ["embed", "layer0", "layer1", "layer2", "head"]
        tokens, logits = dec.generate(PROMPT, N_NEW)
    assert len(tokens) == N_NEW and logits.shape == (N_NEW, model.config.vocab_size)
    assert_same_greedy(tokens, logits, ref_tokens, ref_logits)


def test_steps_equal_prefill_and_a_new_sequence_reuses_the_cache():
    """The step's `pos` input addresses the cache: on a cache holding another sequence, feeding the
    prompt token by token from position 0 (host values, no prefill) gives a fresh prefill's
    logits, and a new sequence gives what a fresh decoder gives (rows past it are never read)."""
    model = hd.build_model("llama")
    with hd.HFGraphDecoder(model, max_seq_len=64, mode="eager") as fresh:
        expected_prefill = fresh.prefill(PROMPT)
        expected = fresh.generate(PROMPT[2:], 20)
    with hd.HFGraphDecoder(model, max_seq_len=64, mode="eager") as dec:
        dec.generate([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 30)   # rows 0..38 hold another sequence
        for p, tok in enumerate(PROMPT):
            out = dec.decoder.step(token=tok, pos=p)
        torch.testing.assert_close(out["logits"][0], expected_prefill, rtol=0, atol=1e-5)
        assert int(dec.pos[0]) == len(PROMPT)
        again = dec.generate(PROMPT[2:], 20)
    assert again[0] == expected[0]
    torch.testing.assert_close(again[1], expected[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen2_moe"])
def test_decode_step_has_no_host_sync(family, monkeypatch):
    """Capture-readiness on the CPU: no op of a step syncs (graphs.find_host_syncs, the profiler's
    view, C++ included) and no Python code reads a tensor value."""
    with hd.HFGraphDecoder(hd.build_model(family), max_seq_len=64, mode="eager") as dec:
        dec.prefill(PROMPT)
        assert find_host_syncs(dec.decoder.eager_step) == []

        def boom(*a, **k):
            raise AssertionError("host sync in the decode step")
        for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "cpu",
                     "numpy"):
            monkeypatch.setattr(torch.Tensor, name, boom)
        monkeypatch.setattr(torch, "nonzero", boom)
        for _ in range(4):
            dec.decoder.step()
        dec.decoder.step(token=5, pos=30)
        monkeypatch.undo()
        assert int(dec.pos[0]) == 31


def test_the_libraries_eager_experts_would_not_capture():
    """Why check_supported refuses experts_implementation='eager' in graph mode: its step syncs."""
    model = hd.build_model("mixtral", experts_implementation="eager")
    with hd.HFGraphDecoder(model, max_seq_len=64, mode="eager") as dec:
        dec.prefill(PROMPT)
        found = find_host_syncs(dec.decoder.eager_step)
    assert any(f.startswith("aten::nonzero") for f in found), found


def test_debug_mode_watches_the_models_cache():
    """The layer segments list the StaticCache tensors where they live (LiveBuffers): the cache
    rebinding one (as offloading or re-initialisation do) is reported before the next step."""
    with hd.HFGraphDecoder(hd.build_model("llama"), max_seq_len=64, mode="eager",
                           debug=True) as dec:
        dec.generate(PROMPT, 4)
        layer = dec.cache.layers[1]
        layer.keys = layer.keys.clone()
        with pytest.raises(DebugPointerError, match=r"layer1\.reads\[k1\]"):
            dec.decoder.step()


def test_refusals_name_the_problem_the_fix_and_the_escape_hatch():
    m = hd.build_model("llama")
    m.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="flex_attention.*set_attn_implementation.*escape hatch"):
        hd.check_supported(m, graph=False)
    m = hd.build_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                 "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="'dynamic'.*host.*Fix.*escape hatch"):
        hd.check_supported(m, graph=False)
    m = hd.build_model("mixtral", experts_implementation="eager")
    hd.check_supported(m, graph=False)                 # eager steps may branch on the host
    with pytest.raises(ValueError, match="'eager'.*batched_mm.*mode='eager'"):
        hd.check_supported(m, graph=True)
    m = hd.build_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer.*sliding_window=None.*escape"):
        hd.HFGraphDecoder(m, max_seq_len=64, mode="eager")
    with pytest.raises(ValueError, match="max_seq_len=32"):
        with hd.HFGraphDecoder(hd.build_model("llama"), max_seq_len=32, mode="eager") as dec:
            dec.generate(PROMPT, 30)


def test_an_unsupported_transformers_is_refused(monkeypatch):
    """Older versions take the layer's cache under another name: without the check the steps
    would attend to the current token only (seen on an image with an older transformers)."""
    assert hd.transformers_supported("5.24.0") and hd.transformers_supported("5.30.0.dev0")
    assert not hd.transformers_supported("4.57.1") and not hd.transformers_supported("6.0.0")
    m = hd.build_model("llama")
    monkeypatch.setattr(hd.transformers, "__version__", "4.57.1")
    with pytest.raises(ValueError, match="transformers 4.57.1.*>= 5.24.*pip install.*escape"):
        hd.check_supported(m, graph=False)


# ------------------------------------------------------------------------------------- GPU
def _gpu_model(family, dtype=torch.float32, **overrides):
    """Initialised on the CPU (the weights whose margins the CPU tests check), then moved."""
    return hd.build_model(family, **overrides).to(device="cuda:0", dtype=dtype)


def _gpu_run(family, mode, granularity="segment", dtype=torch.float32):
    with hd.HFGraphDecoder(_gpu_model(family, dtype), max_seq_len=128, mode=mode,
                           granularity=granularity) as dec:
        assert dec.decoder.mode == mode and dec.decoder.devices == [torch.device("cuda:0")]
        if mode == "graph":
            assert dec.decoder.n_graphs == (5 if granularity == "segment" else 1)
        return dec.generate(PROMPT, N_NEW)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("granularity", ["segment", "device"])
def test_gpu_graph_equals_eager_bitwise_and_generate(family, granularity):
    e_tok, e_log = _gpu_run(family, "eager")
    g_tok, g_log = _gpu_run(family, "graph", granularity=granularity)
    assert g_tok == e_tok and torch.equal(g_log, e_log)          # same GPU: bit for bit
    ref_tokens, ref_logits = reference(_gpu_model(family), PROMPT, N_NEW)
    assert_same_greedy(g_tok, g_log, ref_tokens, ref_logits)


@pytest.mark.cuda
def test_gpu_bf16_graph_equals_eager_bitwise():
    e = _gpu_run("qwen2", "eager", dtype=torch.bfloat16)
    g = _gpu_run("qwen2", "graph", dtype=torch.bfloat16)
    assert g[0] == e[0] and torch.equal(g[1], e[1])


@pytest.mark.cuda
def test_gpu_capture_and_replay_without_host_sync():
    """Warm-up, capture and replay under sync_debug_mode("error"); building the StaticCache
    (a blocking copy of its counter to the GPU) and the eager prefill stay outside."""
    dec = hd.HFGraphDecoder(_gpu_model("mixtral"), max_seq_len=128, mode="graph", capture=False)
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        dec.decoder.allocate(), dec.decoder.warmup(), dec.decoder.capture()
        torch.cuda.set_sync_debug_mode(prev)
        dec.prefill(PROMPT)
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(8):
            dec.decoder.step()
        dec.decoder.step(token=5, pos=40)            # host values: pinned staging, no sync
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert int(dec.pos[0]) == 41 and torch.isfinite(dec.logits).all()
    dec.close()


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("granularity", ["segment", "device"])
def test_two_gpu_split_graph_equals_split_eager_and_generate(granularity):
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    model = _gpu_model("mixtral", num_hidden_layers=4, seed=2)    # margins checked decisive
    ref_tokens, ref_logits = reference(model, PROMPT, N_NEW)          # one GPU, the library's own
    out = {}
    for mode in ("eager", "graph"):
        with hd.HFGraphDecoder(model, max_seq_len=128, placement=[d0, d0, d1, d1], mode=mode,
                               granularity=granularity) as dec:
            assert dec.decoder.devices == [d0, d1]
            if mode == "graph":          # device: cuda:0 embed+layers, cuda:1 layers, cuda:0 head
                assert dec.decoder.n_graphs == (6 if granularity == "segment" else 3)
            cross = {h.name for b in dec.decoder.plan.before for h in b if h.cross_device}
            assert cross == {"h", "pos", "cos", "sin", "mask"}
            out[mode] = dec.generate(PROMPT, N_NEW)
    assert out["graph"][0] == out["eager"][0] and torch.equal(out["graph"][1], out["eager"][1])
    assert_same_greedy(*out["graph"], ref_tokens, ref_logits)


def test_bench_runs_on_the_cpu_and_reports_every_path():
    """examples/hf_bench.py on a tiny model (the GPU run is the lead's): a number for each path
    that runs here, and the reason for each that does not."""
    from examples import hf_bench
    row = hf_bench.bench("tiny", device="cpu", dtype="float32", prompt_len=8, new_tokens=4,
                         repeats=1)
    ms = row["ms_per_token"]
    assert set(ms) == {"hf_generate_dynamic", "hf_generate_static_eager",
                       "hf_forward_static_eager", "graphs_eager", "hf_compile_static"}
    # numbers only: 4 tokens on a shared CPU time noise (a difference of two runs may be < 0)
    assert all(isinstance(v, float) and math.isfinite(v) for k, v in ms.items()
               if k != "hf_compile_static")
    assert ms["hf_compile_static"] is None and "accelerators" in row["notes"]["hf_compile_static"]
    assert row["notes"]["graphs_eager_first_32_tokens_equal_generate"] is True
    assert row["device"] == "cpu" and row["transformers"]


def test_embedding_doc_walks_through_the_example():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "EMBEDDING.md").read_text()
    section = doc.split("## A model you did not write: `transformers`", 1)[1]
    for phrase in ("python -m examples.hf_decoder", "HFGraphDecoder", "StaticCache",
                   "cumulative_length", "LiveBuffers", "find_host_syncs", "batched_mm",
                   "python -m examples.hf_bench", "generate()"):
        assert phrase in section, phrase
    for name in ("embed", "layer{l}", "head"):             # the segment table
        assert f"| `{name}` |" in section, name
