"""`dsv4 serve --parallel tp` on the CPU (two gloo ranks: this server is rank 0 and answers the
API, the other follows its session), through the official `openai` client: a greedy completion
gives the tokens `dsv4 decode --parallel tp` gives (the same split sums: the same bits on any
machine), again from the prefix cache, with log-probabilities; a streamed chat; structured output
(each token's mask sent to the follower) that parses and validates; a token-id prompt scored with
echo; SIGTERM ends both ranks with exit status 0."""
import json

import pytest

from serving import ServerProcess, openai_client, require_serve_packages

require_serve_packages()

from helpers import small_checkpoint  # noqa: E402

from dsv4.weights.presets import TINY_TP  # noqa: E402   (splits over two ranks)

MODEL = "small-bf16-0"
PROMPT = [5, 6, 7, 8, 9]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("serve-tp"), "bf16", cfg=TINY_TP)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(["--ckpt", ckpt, "--max-seq-len", 128, "--dtype", "float32",
                         "--parallel", "tp", "--device", "cpu,cpu", "--log-level", "warning"],
                        log=log, env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() == 0, srv.stderr_tail()


def test_tp_server_answers_as_tp_decode(server, ckpt):
    client = openai_client(server)
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                      logprobs=2)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                      logprobs=2)
    assert first.choices[0].text == again.choices[0].text
    lp = first.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(t) >= 1 for t in lp.top_logprobs)
    assert lp.token_logprobs == again.choices[0].logprobs.token_logprobs
    # `dsv4 decode --parallel tp` (its main in this process: it launches its two ranks; the CLI
    # as users run it is tests/test_cli_tp.py's)
    from test_cli import run_here
    d = run_here("--ckpt", str(ckpt), "--prompt-ids", ",".join(map(str, PROMPT)),
                 "--max-new-tokens", "5", "--dtype", "float32", "--parallel", "tp", "--device",
                 "cpu,cpu", "--json", env={"OMP_NUM_THREADS": "1"})
    assert d.returncode == 0, d.stderr
    out = json.loads(d.stdout)
    if out["finish_reason"] == "length":
        assert first.choices[0].text == out["text"]


def test_tp_server_streams_scores_and_masks(server):
    pytest.importorskip("llguidance", reason="structured output needs llguidance (the serve extra)")
    client = openai_client(server)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        stream=True) if c.choices]
    assert "".join(parts)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=20,
        temperature=1, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    e = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                  echo=True, logprobs=1)
    lp = e.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(PROMPT) + 1
