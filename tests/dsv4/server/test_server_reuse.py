"""Prefix reuse through the server: a second chat turn after an answer that ended at EOS, a
completion whose prompt extends the previous one, a regenerate, a thinking-mode follow-up whose
re-encode drops the earlier reasoning: each reports the ids it reused in
usage.prompt_tokens_details.cached_tokens and gives the tokens a fresh full prefill gives.

Where the arithmetic allows the comparison: a bf16-weight checkpoint of the tiny model (the real
vocabulary, for the tokenizer) at float32 with the KV fake-quant off (tests/dsv4/server/
serve_exact.py), so that prefilling in other pieces moves logits by float32 noise only; the
reference runs in this process with the same numerics, gives the logits' top-2 margins, and a
token is compared only while every margin so far exceeds that noise.
"""
import pytest
import torch

from serving import REPO, ServerProcess, openai_client, require_serve_packages

require_serve_packages()

from dsv4.text.chat import EOS, THINK_END  # noqa: E402
from dsv4.runtime.config import RuntimeConfig  # noqa: E402
from dsv4.runtime.session import Session, load_model  # noqa: E402
from dsv4.weights.presets import TINY  # noqa: E402
from dsv4.runtime.sampling import SamplingParams  # noqa: E402
from dsv4.text.tokenizer import build_prompt_ids, load_tokenizer  # noqa: E402
from helpers import disable_fake_quant  # noqa: E402

CAP, TOL = 512, 1e-4
DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"     # the server's and the reference's
LAUNCHER = REPO / "tests" / "dsv4" / "server" / "serve_exact.py"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from dsv4.weights.synthetic import write_checkpoint
    return write_checkpoint(TINY, tmp_path_factory.mktemp("exact") / "tiny-bf16", weights="bf16",
                            seed=0, shards=2)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("exact-server") / "server.log"
    srv = ServerProcess(["--ckpt", ckpt, "--device", DEVICE, "--dtype", "float32",
                         "--max-seq-len", CAP,
                         "--allow-force-ids", "--log-level", "warning"], launcher=LAUNCHER,
                        log=log)
    yield srv
    assert srv.stop() == 0, srv.stderr_tail()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def reference(ckpt):
    """fresh(prompt_ids, n) -> (greedy tokens, the top-2 margin / scale of each step), from a full
    prefill in this process with the server's numerics."""
    mp = pytest.MonkeyPatch()
    disable_fake_quant(mp.setattr)
    m, ck = load_model(ckpt, RuntimeConfig(max_seq_len=CAP, dtype=torch.float32,
                                           devices=(DEVICE,)))
    ck.close()
    s = Session(m, SamplingParams())
    memo = {}

    def fresh(ids, n):
        if (tuple(ids), n) not in memo:
            r = s.generate(ids, n, eos_id=1, keep_logits=True)
            top2 = r.logits.topk(2, dim=-1).values
            margins = ((top2[:, 0] - top2[:, 1]) / r.logits.abs().amax(-1)).tolist()
            memo[tuple(ids), n] = r.output_ids, margins
        return memo[tuple(ids), n]
    yield fresh
    mp.undo()


def _same_tokens(got, want):
    """got == the reference's tokens up to (and including) the first step whose top-2 margin is
    within float32 noise between chunkings (past it a legitimate flip may change the rest)."""
    ids, margins = want
    for i, (g, w, mg) in enumerate(zip(got, ids, margins)):
        assert g == w, f"step {i}: {g} != {w} (margin {mg:.2e})"
        if mg <= 10 * TOL:
            return
    assert len(got) == len(ids), (got, ids)


def _chat(client, messages, n, thinking=False, **extra):
    body = {"return_token_ids": True, **extra}
    if thinking:
        body["chat_template_kwargs"] = {"thinking": True}
    r = client.chat.completions.create(model="tiny-bf16", messages=messages, max_tokens=n,
                                       temperature=0, extra_body=body)
    d = r.model_dump()
    cached = r.usage.prompt_tokens_details.cached_tokens
    return d["choices"][0]["token_ids"], d["prompt_token_ids"], cached


def test_second_chat_turn_after_an_eos_reads_only_the_new_turn(client, tok, reference):
    u1 = [{"role": "user", "content": "Name a fruit."}]
    answer = tok.encode("A pear.")
    ids1, p1, c = _chat(client, u1, len(answer) + 1, force_ids=answer + [tok.eos_id])
    assert ids1 == answer + [tok.eos_id]
    turn2 = u1 + [{"role": "assistant", "content": "A pear."},
                  {"role": "user", "content": "And a colour?"}]
    got, p2, cached = _chat(client, turn2, 5)
    assert p2[:len(p1) + len(answer) + 1] == p1 + answer + [tok.eos_id]
    assert cached == len(p1) + len(answer)          # all but the EOS, fed with the new turn
    _same_tokens(got, reference(p2, 5))
    again, _, cached = _chat(client, turn2, 5, use_cache=False)
    assert cached == 0 and again == reference(p2, 5)[0]    # the same pieces: the same bits


def test_completion_extending_the_previous_one_and_a_regenerate(client, tok, reference):
    p1 = [tok.bos_id] + tok.encode("Once upon a time")
    r1 = client.completions.create(model="tiny-bf16", prompt=p1, max_tokens=4, temperature=0,
                                   extra_body={"return_token_ids": True})
    out1 = r1.model_dump()["choices"][0]["token_ids"]
    _same_tokens(out1, reference(p1, 4))
    p2 = p1 + out1 + tok.encode(" there was")
    r2 = client.completions.create(model="tiny-bf16", prompt=p2, max_tokens=4, temperature=0,
                                   extra_body={"return_token_ids": True})
    # the live sequence: the prompt and every output token but the last, which p2 feeds next
    assert r2.usage.prompt_tokens_details.cached_tokens == len(p1) + len(out1) - 1
    _same_tokens(r2.model_dump()["choices"][0]["token_ids"], reference(p2, 4))
    r3 = client.completions.create(model="tiny-bf16", prompt=p2, max_tokens=4, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert r3.usage.prompt_tokens_details.cached_tokens == len(p2)     # the prompt's snapshot
    assert r3.model_dump()["choices"][0]["token_ids"] == \
        r2.model_dump()["choices"][0]["token_ids"]


def test_thinking_follow_up_resumes_before_the_think_tag(client, tok, reference):
    u1 = [{"role": "user", "content": "Two plus two?"}]
    forced = tok.encode("Add them") + [tok.token_to_id(THINK_END)] + tok.encode("Four.") + \
        [tok.eos_id]
    _, p1, _ = _chat(client, u1, len(forced), thinking=True, force_ids=forced)
    turn2 = u1 + [{"role": "assistant", "content": "Four.", "reasoning_content": "Add them"},
                  {"role": "user", "content": "Times three?"}]
    got, p2, cached = _chat(client, turn2, 4, thinking=True)
    want = build_prompt_ids(tok, messages=turn2, thinking=True)
    assert p2 == want and p2[:len(p1) - 1] == p1[:-1] and p2[len(p1) - 1] != p1[-1]
    assert cached == len(p1) - 1                    # "<think>" became "</think>": from before it
    _same_tokens(got, reference(p2, 4))


def test_use_cache_false_prefills_everything(client):
    msgs = [{"role": "user", "content": "Hello."}]
    _chat(client, msgs, 2)
    _, _, cached = _chat(client, msgs, 2)
    assert cached > 0
    _, _, cached = _chat(client, msgs, 2, use_cache=False)
    assert cached == 0


def test_eos_text_is_never_in_content(client, tok):
    r = client.chat.completions.create(
        model="tiny-bf16", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        extra_body={"force_ids": tok.encode("Bye.") + [tok.eos_id]})
    assert r.choices[0].message.content == "Bye." and EOS not in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
