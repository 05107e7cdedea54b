"""Structured output's host side (dsv4.server.structured) and OpenAI's words in the request schema,
without a server: a server without llguidance answers 400 naming it; a schema's matcher allows a
valid document token by token and then only EOS; reasoning_effort's words and their encoding
efforts, thinking on by an effort, the temperature range."""
import numpy as np
import pytest

pytest.importorskip("pydantic", reason="the server tests need pydantic (pip install -e '.[dev]')")

from pydantic import ValidationError  # noqa: E402

from dsv4.server import structured  # noqa: E402
from dsv4.server.schemas import ApiError, ChatRequest  # noqa: E402
from dsv4.text.tokenizer import load_tokenizer  # noqa: E402

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


def test_without_the_library_a_request_gets_400_naming_it(monkeypatch):
    monkeypatch.setattr(structured, "available", lambda: False)
    gc = structured.GrammarCompiler(None, 10)
    assert gc.compile({"type": "text"}) is None
    with pytest.raises(ApiError) as e:
        gc.compile({"type": "json_object"})
    assert e.value.status == 400 and "llguidance" in e.value.message
    assert "pip install" in e.value.message


def test_a_schema_allows_a_valid_document_then_only_eos():
    pytest.importorskip("llguidance", reason="structured output needs llguidance")
    import torch
    tok = load_tokenizer()
    gc = structured.GrammarCompiler(tok, tok.vocab_size)
    con = structured.constraint_for(
        gc.compile({"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}),
        tok, thinking=False)
    bitmask = torch.zeros(-(-tok.vocab_size // 32), dtype=torch.int32)

    def allowed():
        con.fill(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits[:tok.vocab_size]).tolist())
    for tid in tok.encode('{"color":"red","ok":true}'):
        ok = allowed()
        assert tid in ok
        con.accept(tid)
    assert allowed() == {tok.eos_id} and con.rejected == 0
    fresh = structured.constraint_for(
        gc.compile({"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}),
        tok, thinking=False)
    for tid in tok.encode('{"color":"'):
        fresh.accept(tid)
    fresh.fill(bitmask)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    assert not bits[tok.encode("blue")[0]]


def test_reasoning_effort_words_and_the_temperature_range():
    for word, enc in (("low", "high"), ("medium", "high"), ("high", "high"), ("max", "max")):
        r = ChatRequest(messages=MSGS, reasoning_effort=word)
        assert r.thinking and r.encoding_effort == enc
        kw = ChatRequest(messages=MSGS, chat_template_kwargs={"reasoning_effort": word})
        assert kw.thinking and kw.encoding_effort == enc
    assert not ChatRequest(messages=MSGS).thinking
    assert ChatRequest(messages=MSGS, chat_template_kwargs={"thinking": True}).thinking
    with pytest.raises(ApiError, match="thinking is false"):
        ChatRequest(messages=MSGS, reasoning_effort="low",
                    chat_template_kwargs={"thinking": False})
    with pytest.raises(ValidationError, match="0..2"):
        ChatRequest(messages=MSGS, temperature=2.5)
    assert ChatRequest(messages=MSGS, temperature=2).temperature == 2
    with pytest.raises(ValidationError):
        ChatRequest(messages=MSGS, reasoning_effort="extreme")
