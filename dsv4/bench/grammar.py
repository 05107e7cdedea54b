"""The per-token cost of a structured-output token mask on the host, for each grammar library the
server could use (xgrammar, llguidance), over the real DeepSeek-V4 tokenizer's vocabulary:
`python scripts/bench_grammar.py [--tokens 200] [--json]`.

For each schema, both libraries walk the same path of `--tokens` tokens: at each step each fills
its next-token bitmask [ceil(V / 32)] int32 (timed), a seeded choice among the tokens both allow
is made, and each accepts it (timed); a finished document starts a new one. Interleaving the two
per token makes a loaded machine slow both alike. The per-token figure is the median of fill +
accept. Nothing of the model runs: this is the host work the server adds to each step of a
constrained request.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

SCHEMAS = {
    "json_object": None,
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "kind": {"enum": ["a", "b", "c"]}}, "required": ["name", "age", "kind"],
        "additionalProperties": False},
}


def _allowed(bitmask, vocab: int) -> list[int]:
    """Ids whose bit is set in bitmask [ceil(V / 32)] int32."""
    import numpy as np
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits).tolist()


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr
        self.xgr = xgr
        vocab = tok.vocab_list()
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab),
                                 stop_token_ids=[tok.eos_id], add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab = len(vocab)

    def start(self, schema):
        # compact separators, as llguidance's non-flexible whitespace: the same documents
        g = self.compiler.compile_json_schema(json.dumps(schema or {"type": "object"}),
                                              any_whitespace=False, separators=(",", ":"))
        self.m = self.xgr.GrammarMatcher(g)
        self.mask = self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self):
        self.m.fill_next_token_bitmask(self.mask)
        return self.mask[0]

    def accept(self, tid) -> bool:
        self.m.accept_token(tid)
        return self.m.is_terminated()


class _Llguidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.torch as lt
        self.llg, self.lt = llguidance, lt
        self.tokenizer = llguidance.LLTokenizer(tok.path.read_text(), n_vocab=tok.vocab_size,
                                                eos_token=tok.eos_id)
        self.vocab = tok.vocab_size

    def start(self, schema):
        llg = self.llg
        grammar = llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False})
        self.m = llg.LLMatcher(self.tokenizer, grammar)
        self.mask = self.lt.allocate_token_bitmask(1, self.vocab)

    def fill(self):
        self.lt.fill_next_token_bitmask(self.m, self.mask, 0)
        return self.mask[0]

    def accept(self, tid) -> bool:
        self.m.consume_token(tid)
        return self.m.is_stopped()


def measure(libs, schema, tokens: int, seed: int = 0) -> dict:
    """The walk above -> {library: {compile_ms, median_us, p90_us, tokens, documents}}."""
    rng = random.Random(seed)
    out = {}
    for lib in libs:
        t = time.perf_counter()
        lib.start(schema)
        out[lib.name] = {"compile_ms": (time.perf_counter() - t) * 1e3, "times": []}
    docs = 0
    for _ in range(tokens):
        allowed = None
        for lib in libs:
            t = time.perf_counter()
            mask = lib.fill()
            out[lib.name]["times"].append(time.perf_counter() - t)
            ok = set(_allowed(mask, lib.vocab))
            allowed = ok if allowed is None else allowed & ok
        if not allowed:             # the grammars disagree here: start a new document
            for lib in libs:
                lib.start(schema)
            continue
        tid = rng.choice(sorted(allowed))
        done = False
        for lib in libs:
            t = time.perf_counter()
            done |= lib.accept(tid)
            out[lib.name]["times"][-1] += time.perf_counter() - t
        if done:
            docs += 1
            for lib in libs:
                lib.start(schema)
    for r in out.values():
        times = sorted(r.pop("times"))
        r.update(median_us=statistics.median(times) * 1e6,
                 p90_us=times[int(0.9 * len(times))] * 1e6, tokens=tokens, documents=docs)
    return out


def main(argv=None) -> int:
    from ..text.tokenizer import load_tokenizer
    p = argparse.ArgumentParser(prog="bench_grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    tok = load_tokenizer()
    out, libs = {}, []
    for cls in (_Xgrammar, _Llguidance):
        try:
            t = time.perf_counter()
            libs.append(cls(tok))
            out[cls.name] = {"tokenizer_setup_s": time.perf_counter() - t}
        except ImportError as e:
            out[cls.name] = {"error": f"not installed ({e})"}
    for name, schema in SCHEMAS.items():
        for lib, r in measure(libs, schema, args.tokens).items():
            out[lib][name] = r
    if args.json:
        print(json.dumps(out))
    else:
        for name, r in out.items():
            print(name, json.dumps(r, indent=1))
    return 0
