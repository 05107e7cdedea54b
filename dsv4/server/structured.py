"""Structured output: a request's `response_format` (`json_object`, `json_schema`) as a grammar
of xgrammar (the `serve` extra), and its matcher as the decode loop's Constraint
(dsv4.runtime.grammar): before each step it writes the allowed next tokens into the token mask's
bitmask; each chosen token advances it.

Why xgrammar: on the real DeepSeek-V4 vocabulary (129,280 ids) it fills a mask in about 0.1 ms a
token on a CPU core against llguidance's 0.15-0.17 ms (scripts/bench_grammar.py; figures in
docs/SERVING.md); that cost is paid on every token, a schema's compilation once per request
(xgrammar caches compiled schemas). The grammar's JSON is compact (no free whitespace between
tokens: a model cannot pad it forever) and ends with EOS once the document is complete.
"""
from __future__ import annotations

import importlib.util
import json
import re
import threading

from ..text.chat import THINK_END
from .schemas import ApiError

PACKAGE = "xgrammar"
INSTALL = "pip install -e '.[serve]' (or pip install xgrammar)"


def available() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


class GrammarCompiler:
    """The tokenizer's tables for xgrammar, built on first use (a few seconds for 129,280
    tokens), and a compile of each response_format. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tok, self.vocab_size = tokenizer, vocab_size
        self._compiler = None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                vocab = self.tok.vocab_list()
                vocab += [""] * (self.vocab_size - len(vocab))    # ids the tokenizer lacks
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL,
                                         vocab_size=self.vocab_size,
                                         stop_token_ids=[self.tok.eos_id], add_prefix_space=False)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, response_format: dict, param: str = "response_format"):
        """-> the compiled grammar of a json_object / json_schema response_format, or None for
        text; ApiError 400 for a format this server or the library refuses."""
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
        compiler = self._get()
        try:
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except Exception as e:          # the library's refusal: say which schema and why
            why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip()).splitlines()[0]
            raise ApiError(400, f"{param}: {PACKAGE} cannot compile this JSON schema ({why}); "
                                f"simplify the schema (what it supports: "
                                f"https://xgrammar.mlc.ai/docs)", param) from None


class JsonConstraint:
    """A compiled grammar's matcher as a Constraint. after: a token id that starts the
    constraint (thinking mode: "</think>"; the reasoning before it is free), or None."""

    def __init__(self, compiled, after: int | None = None):
        import xgrammar as xgr
        self._m = xgr.GrammarMatcher(compiled)
        self._waiting = after
        self.rejected = 0               # chosen tokens the matcher refused (never, if masked)

    def fill(self, bitmask) -> None:
        if self._waiting is not None:
            bitmask.fill_(-1)           # every token allowed until the trigger
            return
        self._m.fill_next_token_bitmask(bitmask.view(1, -1))

    def accept(self, token: int) -> None:
        if self._waiting is not None:
            if token == self._waiting:
                self._waiting = None
            return
        if not self._m.is_terminated() and not self._m.accept_token(token):
            self.rejected += 1


def constraint_for(compiled, tokenizer, thinking: bool) -> JsonConstraint | None:
    if compiled is None:
        return None
    return JsonConstraint(compiled, tokenizer.token_to_id(THINK_END) if thinking else None)
