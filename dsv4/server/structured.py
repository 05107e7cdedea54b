"""Structured output: a request's `response_format` (`json_object`, `json_schema`) as a grammar
of llguidance (the `serve` extra), and its matcher as the decode loop's Constraint
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
import threading
from pathlib import Path

from ..text.chat import THINK_END
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
        lltok = self._get()
        try:
            grammar = LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
            why = LLMatcher.validate_grammar(grammar, lltok)
        except Exception as e:          # the library's refusal: say which schema and why
            why = f"{type(e).__name__}: {e}"
        if why:
            raise ApiError(400, f"{param}: {PACKAGE} cannot compile this JSON schema "
                                f"({why.strip().splitlines()[0]}); simplify the schema (what "
                                f"it supports: https://github.com/guidance-ai/llguidance/blob/"
                                f"main/docs/json_schema.md)", param)
        return lltok, grammar


class JsonConstraint:
    """A grammar's matcher as a Constraint. after: a token id that starts the constraint
    (thinking mode: "</think>"; the reasoning before it is free), or None."""

    def __init__(self, compiled, after: int | None = None):
        from llguidance import LLMatcher
        lltok, grammar = compiled
        self._m = LLMatcher(lltok, grammar)
        if self._m.is_error():
            raise ApiError(400, f"response_format: {PACKAGE} refused the grammar "
                                f"({self._m.get_error()})", "response_format")
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


def constraint_for(compiled, tokenizer, thinking: bool) -> JsonConstraint | None:
    if compiled is None:
        return None
    return JsonConstraint(compiled, tokenizer.token_to_id(THINK_END) if thinking else None)
