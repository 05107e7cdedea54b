"""Structured output: a request's `response_format` (`json_object`, `json_schema`), or its
`tool_choice` `"required"` / a named function (the reply is DSV4 tool calls: tool_call_grammar),
as a grammar of llguidance (the `serve` extra), and its matcher as the decode loop's Constraint
(dsv4.runtime.grammar): before each step it writes the allowed next tokens into the token mask's
bitmask; each chosen token advances it.

Why llguidance: on the real DeepSeek-V4 vocabulary (129,280 ids) its mask costs the same per token
as xgrammar's (within 3%, llguidance ahead, on the same walk: scripts/bench_grammar.py, figures in
docs/SERVING.md), it compiles a schema 7-8x faster (1-9 ms against 10-70 ms, paid once per
request) and depends on nothing (xgrammar brings transformers, triton and its own FFI into the
serve extra). The grammar's JSON is compact (`{"a":1,"b":[2]}`: no free whitespace, so a model
cannot pad it forever) and ends with EOS once the document is complete.
"""
from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

from ..text.chat import DSML, INVOKE_CLOSE, THINK_END, TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN
from .schemas import ApiError

PACKAGE = "llguidance"
INSTALL = "pip install -e '.[serve]' (or pip install llguidance)"


def available() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


class GrammarCompiler:
    """The tokenizer's tables for llguidance, built on first use (a few seconds for 129,280
    tokens), and the grammar of each response_format. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tok, self.vocab_size = tokenizer, vocab_size
        self._lltok = None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._lltok is None:
                import llguidance
                self._lltok = llguidance.LLTokenizer(Path(self.tok.path).read_text(),
                                                     n_vocab=self.vocab_size,
                                                     eos_token=self.tok.eos_id)
            return self._lltok

    def compile(self, response_format: dict, param: str = "response_format"):
        """-> the grammar of a json_object / json_schema response_format (with the tokenizer's
        tables), or None for text; ApiError 400 for a format this server or the library
        refuses."""
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind not in ("json_object", "json_schema"):
            raise ApiError(400, f"{param}.type {kind!r}: expected 'text', 'json_object' or "
                                f"'json_schema'", f"{param}.type")
        if not available():
            raise ApiError(400, f"{param} {kind!r} needs the grammar library `{PACKAGE}`, which "
                                f"this server lacks: {INSTALL}, then restart the server", param)
        if kind == "json_object":
            schema = {"type": "object"}
        else:
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, f"{param}.json_schema.schema: give the JSON schema as an "
                                    f"object ({{'name': ..., 'schema': {{...}}}})",
                               f"{param}.json_schema")
        from llguidance import LLMatcher
        return self._build(lambda: LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}), param, "this JSON schema")

    def compile_tools(self, tools: list[dict], name: str | None, parallel: bool):
        """-> the grammar of a reply that is tool calls of `tools` (only the function `name` when
        given; one call unless parallel): tool_call_grammar. ApiError 400 where the library is
        missing or refuses a tool's parameter schema."""
        if not available():
            raise ApiError(400, f"tool_choice 'required' or a named function needs the grammar "
                                f"library `{PACKAGE}`, which this server lacks: {INSTALL}, then "
                                f"restart the server (or use tool_choice 'auto')", "tool_choice")
        from llguidance import LLMatcher
        return self._build(lambda: LLMatcher.grammar_from_lark(
            tool_call_grammar(tools, name, parallel)), "tool_choice",
            "the tools' parameter schemas")

    def _build(self, make, param: str, what: str):
        """(the tokenizer's tables, make()) once the library validates the grammar; else 400."""
        from llguidance import LLMatcher
        lltok = self._get()
        try:
            grammar = make()
            why = LLMatcher.validate_grammar(grammar, lltok)
        except Exception as e:          # the library's refusal: say which schema and why
            why = f"{type(e).__name__}: {e}"
        if why:
            raise ApiError(400, f"{param}: {PACKAGE} cannot compile {what} "
                                f"({why.strip().splitlines()[0]}); simplify the schema (what "
                                f"it supports: https://github.com/guidance-ai/llguidance/blob/"
                                f"main/docs/json_schema.md)", param)
        return lltok, grammar


# a non-string parameter's JSON as dsv4.text.chat renders it (the official encoder's
# json.dumps: ", " and ": ", no other whitespace)
JSON_AS_RENDERED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    """A Lark string literal of text."""
    return json.dumps(text, ensure_ascii=False)


def _choices(schema: dict) -> list | None:
    """A parameter schema's enum, or its const as the one choice (else None)."""
    return schema.get("enum", [schema["const"]] if "const" in schema else None)


def _is_string(schema: dict) -> bool:
    """A parameter DSV4 writes as is (string="true"): type "string", or an enum / const of
    strings only."""
    if schema.get("type") == "string":
        return True
    values = _choices(schema)
    return "type" not in schema and bool(values) and all(isinstance(v, str) for v in values)


def tool_call_grammar(tools: list[dict], name: str | None, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of a reply that is DSV4 tool calls and nothing
    else, as dsv4.text.chat renders them and parse_tool_calls reads them: a blank line and the
    tool-calls block, one invoke (or several, parallel) of the tools (of `name` only, when
    given), each invoke's parameters in its schema's order, the required ones always and the
    others optional; a string parameter (_is_string) as is with string="true" (an enum's or
    const's values the only choices; otherwise any text up to the parameter's closing tag), every
    other one as JSON valid for its schema, written as the renderer writes it (JSON_AS_RENDERED),
    with string="false" (the parameters' $defs carried into it, so that "#/$defs/..."
    references hold). A tool whose parameters name no properties takes none. The reply then
    ends (EOS)."""
    nl, close = "\n", f"</{DSML}parameter>"
    # any text up to the first closing tag (lazy: a value cannot run past it)
    rules = ["string_value[lazy]: /(?s:.*)" + close.replace("/", "\\/") + "/"]
    alts = []
    for i, t in enumerate(tools):
        f = t.get("function", t)
        if name is not None and f.get("name") != name:
            continue
        params = f.get("parameters") or {}
        props = params.get("properties") or {}
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        required = set(params.get("required") or ())
        items = []
        for key, sch in props.items():
            sch = sch if isinstance(sch, dict) else {}
            head = f'<{DSML}parameter name="{key}" '
            if _is_string(sch):
                values = _choices(sch)
                value = ("(" + " | ".join(_lit(v + close) for v in values) + ")" if values
                         else "string_value")
                item = _lit(head + 'string="true">') + " " + value
            else:
                sub = {**sch, **defs, "x-guidance": JSON_AS_RENDERED}
                item = (_lit(head + 'string="false">') +
                        f" %json {json.dumps(sub, ensure_ascii=False)} {_lit(close)}")
            items.append(f"({item} {_lit(nl)})" + ("" if key in required else "?"))
        if not required & set(props):   # no line at all: the renderer's empty body is one
            items.append(f"{_lit(nl)}?")  # more newline
        opener = f'<{DSML}invoke name="{f.get("name")}">' + nl
        rules.append(f"call{i}: {_lit(opener)} {' '.join(items)} {_lit(INVOKE_CLOSE)}")
        alts.append(f"call{i}")
    more = f" ({_lit(nl)} invoke)*" if parallel else ""
    # (the newline before the block's end a lexeme of its own, as before another invoke: the
    # lexer is greedy, so a literal "\n</...>" would shut out "\n<...invoke")
    return nl.join([f"start: {_lit(nl + nl + TOOL_CALLS_OPEN + nl)} invoke{more} "
                    f"{_lit(nl)} {_lit(TOOL_CALLS_CLOSE)}",
                    "invoke: " + " | ".join(alts)] + rules)


class GrammarConstraint:
    """A grammar's matcher as a Constraint. after: a token id that starts the constraint
    (thinking mode: "</think>"; the reasoning before it is free), or None. param: the request's
    field the grammar came from (its errors name it)."""

    def __init__(self, compiled, after: int | None = None, param: str = "response_format"):
        from llguidance import LLMatcher
        lltok, grammar = compiled
        self._m = LLMatcher(lltok, grammar)
        if self._m.is_error():
            raise ApiError(400, f"{param}: {PACKAGE} refused the grammar "
                                f"({self._m.get_error()})", param)
        self._waiting = after
        self.rejected = 0               # chosen tokens the matcher refused (never, if masked)

    def fill(self, bitmask) -> None:
        if self._waiting is not None:
            bitmask.fill_(-1)           # every token allowed until the trigger
            return
        from llguidance.torch import fill_next_token_bitmask
        fill_next_token_bitmask(self._m, bitmask.view(1, -1), 0)

    def accept(self, token: int) -> None:
        if self._waiting is not None:
            if token == self._waiting:
                self._waiting = None
            return
        if not self._m.is_stopped() and not self._m.consume_token(token):
            self.rejected += 1


def constraint_for(compiled, tokenizer, thinking: bool, param: str = "response_format"
                   ) -> GrammarConstraint | None:
    if compiled is None:
        return None
    return GrammarConstraint(compiled, tokenizer.token_to_id(THINK_END) if thinking else None,
                             param)
