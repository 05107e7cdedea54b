"""Prefix reuse (dsv4/prefix_cache.py): which source serves each prompt and how many ids it reuses
(the live sequence with or without its pending token, a snapshot at a prompt's end or before its
last token, nothing), which snapshots a feed drops, and that every reuse gives what a fresh full
prefill gives: bit for bit where the pieces are the same, and to float32 noise (fake-quant off)
with equal greedy tokens wherever the top-2 margin exceeds that noise otherwise."""
import pytest
import torch

from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.session import Session, load_model
from dsv4.runtime.prefix_cache import PrefixCache
from dsv4.runtime.sampling import SamplingParams
from helpers import small_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("prefix"), "bf16")


def _session(path, speculative=0):
    m, ck = load_model(path, RuntimeConfig(max_seq_len=160, dtype=torch.float32,
                                           mtp=bool(speculative)))
    ck.close()
    m.head.mul_(30.0)                        # fewer near-ties in the random model
    return Session(m, SamplingParams(), speculative=speculative, per_request_sampling=True)


def _ids(seed, n):
    return torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _same_greedy(a, b, tol=1e-4):
    """Logits within float32 noise; tokens equal up to the first step whose top-2 margin is
    within that noise (past it a legitimate flip may change the rest)."""
    n = min(len(a.output_ids), len(b.output_ids))
    for i in range(n):
        la, lb = a.logits[i], b.logits[i]
        scale = lb.abs().max().item()
        assert (la - lb).abs().max().item() <= tol * scale, f"step {i}: logits differ"
        top2 = lb.topk(2).values
        if (top2[0] - top2[1]).item() <= 10 * tol * scale:
            return
        assert a.output_ids[i] == b.output_ids[i], f"step {i}"


def test_sources_counts_and_drops(ckpt, no_fake_quant):
    s = _session(ckpt)
    pc = PrefixCache(s, slots=3)
    fresh = Session(s.model, SamplingParams())      # shares the model: used between pc calls

    def serve(prompt, n=5, **kw):
        res, cached = pc.generate(prompt, n, keep_logits=True, **kw)
        return res, cached

    def full(prompt, n=5):
        r = fresh.generate(prompt, n, keep_logits=True)
        pc.forget()                                # the fresh run moved the shared state
        return r

    p1 = _ids(1, 23)
    r1, c = serve(p1, save_before_last=True)
    assert c == 0 and pc.plan(p1).source == "snapshot"
    ref1 = r1
    # an exact repeat: the snapshot at the prompt's end, nothing prefilled, the same bits
    r, c = serve(p1)
    assert c == len(p1) and r.output_ids == ref1.output_ids and torch.equal(r.logits, ref1.logits)
    # a completion that continues prompt + output: the live sequence, its pending token fed first
    p2 = p1 + r.output_ids + _ids(2, 6)
    assert pc.plan(p2).source == "live" and pc.plan(p2).feeds_pending
    r2, c = serve(p2)
    assert c == len(p1) + len(r.output_ids) - 1
    # the same turn after another reply: the snapshot at p1's end
    p3 = p1 + _ids(3, 4)
    assert pc.plan(p3).cached == len(p1) and pc.plan(p3).source == "snapshot"
    r3, c = serve(p3)
    assert c == len(p1)
    # a prompt that differs in p1's last token (a thinking follow-up): the snapshot before it;
    # feeding from there drops the snapshots past it (p1's end, p3's end)
    p4 = p1[:-1] + _ids(4, 5)
    r4, c = serve(p4)
    assert c == len(p1) - 1
    assert pc.plan(p1).cached == len(p1) - 1
    r5, c = serve(p4, use_cache=False)
    assert c == 0
    # each reuse == a fresh full prefill (fake-quant off: float32 noise between chunkings)
    for prompt, got in ((p2, r2), (p3, r3), (p4, r4), (p4, r5)):
        _same_greedy(got, full(prompt))


def test_pending_token_dropped_when_the_prompt_goes_elsewhere(ckpt, no_fake_quant):
    s = _session(ckpt)
    pc = PrefixCache(s, slots=0)                    # live reuse only
    p = _ids(5, 17)
    r, _ = pc.generate(p, 4)
    held = p + r.output_ids[:-1]
    other = next(t for t in range(5) if t != r.output_ids[-1])
    plan = pc.plan(held + [other, 7])
    assert plan.source == "live" and plan.cached == len(held) and not plan.feeds_pending
    got, c = pc.generate(held + [other, 7], 4, keep_logits=True)
    assert c == len(held)
    _same_greedy(got, Session(s.model, SamplingParams()).generate(held + [other, 7], 4,
                                                                  keep_logits=True))


def test_speculative_session_skips_a_live_state_the_mtp_block_did_not_follow(ckpt):
    s = _session(ckpt, speculative=1)
    pc = PrefixCache(s, slots=2)
    p = _ids(6, 15)
    r, _ = pc.generate(p, 4, speculative=False)        # plain steps: the MTP block stays behind
    nxt = p + r.output_ids + [3]
    plan = pc.plan(nxt)
    assert plan.source == "snapshot" and plan.cached == len(p)
    r2, c = pc.generate(nxt, 4)                         # speculates from the snapshot
    assert c == len(p)
    plan = pc.plan(nxt + r2.output_ids + [4])
    assert plan.source == "live"


def test_bad_requests_change_nothing(ckpt):
    s = _session(ckpt)
    pc = PrefixCache(s, slots=1)
    p = _ids(7, 9)
    pc.generate(p, 2)
    before = (list(pc.ids), s.length, s.pending, pc.plan(p).cached)
    with pytest.raises(ValueError, match="RuntimeConfig.max_seq_len"):
        pc.generate(p, 1000)
    with pytest.raises(ValueError, match="out of range"):
        pc.generate(p + [99999], 2)
    assert (list(pc.ids), s.length, s.pending, pc.plan(p).cached) == before
    with pytest.raises(ValueError, match="prefix-snapshots"):
        PrefixCache(s, slots=-1)
