"""Structured output's host side (dsv4.server.structured) and OpenAI's words in the request schema,
without a server: a server without llguidance answers 400 naming it; a schema's matcher allows a
valid document token by token and then only EOS; the tools' grammar (tool_choice "required" / a
named function) allows the tool calls dsv4.text.chat renders and then only EOS, and refuses
another function or a second call where asked to; tool_choice's words; reasoning_effort's words
and their encoding efforts, thinking on by an effort, the temperature range."""
import json

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


@pytest.fixture(scope="module")
def compiler():
    """(tokenizer, its GrammarCompiler, a bitmask): the tokenizer's tables built once."""
    pytest.importorskip("llguidance", reason="structured output needs llguidance")
    import torch
    tok = load_tokenizer()
    return (tok, structured.GrammarCompiler(tok, tok.vocab_size),
            torch.zeros(-(-tok.vocab_size // 32), dtype=torch.int32))


def _allowed(con, tok, bitmask):
    con.fill(bitmask)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:tok.vocab_size]).tolist())


def test_a_schema_allows_a_valid_document_then_only_eos(compiler):
    tok, gc, bitmask = compiler
    con = structured.constraint_for(
        gc.compile({"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}),
        tok, thinking=False)
    for tid in tok.encode('{"color":"red","ok":true}'):
        assert tid in _allowed(con, tok, bitmask)
        con.accept(tid)
    assert _allowed(con, tok, bitmask) == {tok.eos_id} and con.rejected == 0
    fresh = structured.constraint_for(
        gc.compile({"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}),
        tok, thinking=False)
    for tid in tok.encode('{"color":"'):
        fresh.accept(tid)
    assert tok.encode("blue")[0] not in _allowed(fresh, tok, bitmask)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "at": {"$ref": "#/$defs/At"}},
    "required": ["city", "days"],
    "$defs": {"At": {"type": "object", "properties": {"hour": {"type": "integer"}}}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("name,parallel,calls", [
    (None, True, [("get_weather", {"city": "Paris </b> 2", "unit": "f", "days": 3,
                                   "at": {"hour": 9}}), ("ping", {})]),
    ("get_weather", False, [("get_weather", {"city": "Oslo", "days": 7})]),
    ("ping", False, [("ping", {})])])
def test_the_tools_grammar_allows_rendered_calls_then_only_eos(compiler, name, parallel, calls):
    from dsv4.text.chat import _render_tool_calls, parse_tool_calls
    tok, gc, bitmask = compiler
    con = structured.constraint_for(gc.compile_tools(TOOLS, name, parallel), tok,
                                    thinking=False, param="tool_choice")
    text = _render_tool_calls([{"function": {"name": n, "arguments": a}} for n, a in calls])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parse_tool_calls(text)] == calls
    for tid in tok.encode(text):
        assert tid in _allowed(con, tok, bitmask)
        con.accept(tid)
    assert _allowed(con, tok, bitmask) == {tok.eos_id} and con.rejected == 0


def test_the_tools_grammar_refuses_what_was_not_asked_for(compiler):
    tok, gc, bitmask = compiler
    head = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="'

    def takes(text, name, parallel=True):
        """Whether the grammar allows every token of text."""
        con = structured.constraint_for(gc.compile_tools(TOOLS, name, parallel), tok,
                                        thinking=False, param="tool_choice")
        for tid in tok.encode(text):
            if tid not in _allowed(con, tok, bitmask):
                return False
            con.accept(tid)
        return True
    assert takes(head + "ping", None) and not takes(head + "ping", "get_weather")
    second = head + 'ping">\n\n</｜DSML｜invoke>\n<｜DSML｜invoke name="ping'
    assert takes(second, None) and not takes(second, None, parallel=False)
    # a string value ends at its first closing tag; the grammar then wants the next line
    city = head + 'get_weather">\n<｜DSML｜parameter name="city" string="true">x</｜DSML｜parameter>'
    assert takes(city + "\n", "get_weather") and not takes(city + "y", "get_weather")
    # an enum's values are its only choices; JSON as the renderer writes it
    unit = city + '\n<｜DSML｜parameter name="unit" string="true">'
    assert takes(unit + "c", "get_weather") and not takes(unit + "k", "get_weather")
    days = city + '\n<｜DSML｜parameter name="days" string="false">'
    assert takes(days + "7</｜DSML｜parameter>\n", "get_weather")
    assert not takes(days + "9", "get_weather")


def test_tool_choice_words():
    named = {"type": "function", "function": {"name": "ping"}}
    assert ChatRequest(messages=MSGS, tools=TOOLS, tool_choice="required").forces_tool
    r = ChatRequest(messages=MSGS, tools=TOOLS, tool_choice=named)
    assert r.forces_tool and r.tool_name == "ping"
    assert not ChatRequest(messages=MSGS, tools=TOOLS, tool_choice="auto").forces_tool
    for kw, words in ((dict(tool_choice="required"), "no tools"),
                      (dict(tools=TOOLS, tool_choice="always"), "'always'"),
                      (dict(tools=TOOLS, tool_choice={"type": "function"}), "expected"),
                      (dict(tools=TOOLS, tool_choice={"type": "function",
                                                      "function": {"name": "pong"}}),
                       "not among the tools (get_weather, ping)"),
                      (dict(tools=TOOLS, tool_choice=named,
                            response_format={"type": "json_object"}), "give one of them")):
        with pytest.raises(ApiError, match=".") as e:
            ChatRequest(messages=MSGS, **kw)
        assert words in e.value.message and e.value.param == "tool_choice"


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
