"""What real clients ask of the server beyond text (issue 47), through the official `openai`
client against a real server (the demo checkpoint, float32, KV fake-quant off): echo + logprobs
of a token-id prompt equal to the log-softmax of decode.py's teacher-forced logits
(--force-ids + --dump-logits); chat logprobs / top_logprobs, streamed and not; completions'
logprobs streamed with the echo first; json_schema output that parses and validates at
temperature 1 for several seeds, json_object, a refused schema; OpenAI's words (temperature
range, reasoning_effort, the prompt's param, content null for a cut reasoning); and
lm-evaluation-harness's local-completions model on a local task, when lm-eval is installed.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from serving import ServerProcess, openai_client, require_serve_packages

require_serve_packages()

import httpx  # noqa: E402
import openai  # noqa: E402

from dsv4.cli.decode import demo_checkpoint  # noqa: E402
from dsv4.text.tokenizer import load_tokenizer  # noqa: E402

CAP = 256
MODEL = "demo-tiny-v1"
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ckpt():
    return demo_checkpoint()


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(["--ckpt", ckpt, "--max-seq-len", CAP, "--dtype", "float32",
                         "--log-level", "warning"],
                        launcher=Path(__file__).parent / "serve_exact.py", log=log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _cli_logprobs(ckpt, ids, tmp_path, monkeypatch, capsys):
    """decode.py's teacher-forced logits of ids (prompt ids[0], forced ids[1:]) as log-softmax
    rows [n - 1, V]: row i predicts ids[i + 1]. In this process, fake-quant off as the server."""
    from helpers import disable_fake_quant

    from dsv4.cli.decode import main
    disable_fake_quant(monkeypatch.setattr)
    dump = tmp_path / "logits.npy"
    capsys.readouterr()
    assert main(["--ckpt", str(ckpt), "--prompt-ids", str(ids[0]), "--force-ids",
                 ",".join(map(str, ids[1:])), "--dump-logits", str(dump), "--dtype", "float32",
                 "--max-seq-len", str(CAP), "--json"]) == 0
    capsys.readouterr()
    logits = np.load(dump).astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)


def test_echo_logprobs_equal_the_cli_teacher_forced_logits(client, ckpt, tok, tmp_path,
                                                           monkeypatch, capsys):
    ids = [tok.bos_id] + tok.encode("The sea is calm and blue tonight")
    ref = _cli_logprobs(ckpt, ids, tmp_path, monkeypatch, capsys)
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=5, max_tokens=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and r.usage.completion_tokens == 0
    got = np.array(lp.token_logprobs[1:])
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert 5 <= len(top) <= 6                      # the top 5, and the prompt's own token
        best = np.sort(ref[i])[::-1][:5]
        np.testing.assert_allclose(sorted(top.values(), reverse=True)[:5], best, atol=2e-4)
    assert lp.text_offset == sorted(lp.text_offset) and r.choices[0].text.startswith("The sea")
    # lm-evaluation-harness's request: the prompt's entries are the same, one generated token
    r1 = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                   temperature=0)
    lp1 = r1.choices[0].logprobs
    assert len(lp1.token_logprobs) == len(ids) + 1
    np.testing.assert_allclose(lp1.token_logprobs[1:-1], got, atol=1e-6)
    last = lp1.token_logprobs[-1]                      # greedy: the best of its distribution
    assert last == pytest.approx(max(lp1.top_logprobs[-1].values()), abs=1e-6)


def test_echo_of_a_text_prompt_and_plain_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", echo=True, max_tokens=2,
                                  temperature=0)
    assert r.choices[0].text.startswith("Hello there") and r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt="Hello there", logprobs=3, max_tokens=3,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens and None not in lp.token_logprobs
    assert "".join(lp.tokens).startswith(r.choices[0].text[:1])


def test_completion_logprobs_stream_echo_first(client, tok):
    ids = [tok.bos_id] + tok.encode("One two three")
    full = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2,
                                     max_tokens=3, temperature=0)
    chunks = [c for c in client.completions.create(model=MODEL, prompt=ids, echo=True,
                                                   logprobs=2, max_tokens=3, temperature=0,
                                                   stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for lp in lps for t in lp.token_logprobs] == full.choices[0].logprobs.token_logprobs
    assert [o for lp in lps for o in lp.text_offset] == full.choices[0].logprobs.text_offset


def test_chat_logprobs_and_top_logprobs_streamed_and_not(client):
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3,
                                       extra_body={"skip_special_tokens": False})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        vals = [t.logprob for t in e.top_logprobs]
        assert vals == sorted(vals, reverse=True)
        assert e.logprob == pytest.approx(vals[0], abs=1e-6)     # greedy: its own best
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content or "")
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            stream=True,
                                            extra_body={"skip_special_tokens": False})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    no_top = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                            logprobs=True)
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_parses_and_validates_at_temperature_1(client, seed):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A colour as JSON."}],
        max_tokens=40, temperature=1, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) == {"color", "ok"} and doc["color"] in ("red", "green", "blue")
    assert isinstance(doc["ok"], bool)


def test_json_object_and_refusals(client, server):
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=6, temperature=1,
                                  seed=4, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")
    bad = {"type": "json_schema",
           "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
               "a": {"type": "nonsense"}}}}}
    for fmt, words in ((bad, ["cannot compile", "nonsense"]), ({"type": "xml"}, ["xml"]),
                       ({"type": "json_schema", "json_schema": {"name": "x"}}, ["schema"])):
        got = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "response_format": fmt})
        assert got.status_code == 400, got.text
        for w in words:
            assert w in got.json()["error"]["message"]
        assert got.json()["error"]["param"].startswith("response_format")
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("path,body,param,words", [
    ("chat", {"temperature": 3}, "temperature", ["0..2"]),
    ("chat", {"top_logprobs": 2}, "top_logprobs", ["logprobs = true"]),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", ["0..20"]),
    ("chat", {"reasoning_effort": "low", "chat_template_kwargs": {"thinking": False}},
     "reasoning_effort", ["thinking"]),
    ("completions", {"prompt": "x " * 300}, "prompt", ["context length is 256"]),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs", ["0..20"]),
    ("completions", {"prompt": [[1, 2], [3, 4]]}, "prompt", ["batch", "one by one"]),
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", [">= 0"]),
])
def test_openai_ranges_and_words(server, path, body, param, words):
    if path == "chat":
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(f"{server.url}/v1/{path.replace('chat', 'chat/completions')}", json=body,
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    for w in words:
        assert w in err["message"], (w, err["message"])


def test_reasoning_effort_turns_thinking_on_and_a_cut_reasoning_has_null_content(client):
    msgs = [{"role": "user", "content": "Think."}]
    for effort in ("low", "medium", "high", "max"):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                           temperature=0, reasoning_effort=effort)
        m = r.choices[0].message.model_dump()
        # random weights never close the reasoning in 2 tokens: all of it is reasoning
        assert m["reasoning_content"] and m["content"] is None, m
        assert r.choices[0].finish_reason == "length"
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert plain.choices[0].message.model_dump()["reasoning_content"] is None


def test_lm_evaluation_harness_loglikelihoods_equal_the_cli(server, ckpt, tok, tmp_path,
                                                            monkeypatch, capsys):
    """lm-eval's local-completions model (echo, logprobs=1, max_tokens=1, token ids) on a local
    two-document task: its log-likelihoods equal decode.py's teacher-forced ones."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")
    pytest.importorskip("transformers", reason="lm-eval's tokenizer needs transformers")
    for name in ("aiohttp", "tenacity", "requests"):
        pytest.importorskip(name, reason=f"lm-eval's API models need {name} "
                                         f"(pip install 'lm-eval[api]')")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.api.instance import Instance
    tdir = tmp_path / "tok"
    tdir.mkdir()
    (tdir / "tokenizer.json").write_text(Path(tok.path).read_text())
    (tdir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.id_to_token(tok.bos_id),
        "eos_token": tok.id_to_token(tok.eos_id)}))
    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=MODEL,
                             tokenizer=str(tdir), tokenizer_backend="huggingface",
                             tokenized_requests=True, batch_size=1, max_retries=1)
    docs = [("The sea is", " calm"), ("Two plus two is", " four")]
    reqs = [Instance("loglikelihood", {}, doc, i) for i, doc in enumerate(docs)]
    got = lm.loglikelihood(reqs)
    for (ctx, cont), (ll, _greedy) in zip(docs, got):
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)        # the ids lm-eval sends
        ids = ctx_ids + cont_ids
        ref = _cli_logprobs(ckpt, ids, tmp_path, monkeypatch, capsys)
        want = sum(ref[len(ctx_ids) - 1 + j, t] for j, t in enumerate(cont_ids))
        assert ll == pytest.approx(want, abs=5e-4)
