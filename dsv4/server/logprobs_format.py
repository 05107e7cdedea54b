"""Token log-probabilities (dsv4.runtime.logprobs.TokenLogprobs) in the OpenAI API's two shapes:
chat's `choices[0].logprobs.content` ([{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]) and the legacy completions' `choices[0].logprobs` ({tokens, token_logprobs,
top_logprobs: [{token: logprob}], text_offset}, the echoed prompt's first entry null), as
lm-evaluation-harness reads them.

A token's text is its bytes (the byte-level BPE form undone) decoded as UTF-8, with U+FFFD where
a token holds part of a character (its `bytes` give the exact ones).
"""
from __future__ import annotations


def _byte_decoder() -> dict:
    """The byte-level BPE alphabet back to bytes: printable bytes map to themselves, the rest
    to the code points from 256 on, in order (GPT-2's table, which DeepSeek's tokenizer uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_DECODER = _byte_decoder()


class TokenTexts:
    """Text and bytes of token ids for one tokenizer (cached per id)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list]] = {}
        self.special = tokenizer.special_ids()

    def of(self, tid: int) -> tuple[str, list]:
        hit = self._cache.get(tid)
        if hit is None:
            form = self.tok.id_to_token(tid) or ""
            if form and all(c in BYTE_DECODER for c in form):
                raw = bytes(BYTE_DECODER[c] for c in form)
            else:                           # an added token (markup, BOS / EOS): its text
                raw = form.encode()
            hit = self._cache[tid] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def text(self, tid: int) -> str:
        return self.of(tid)[0]


def chat_entry(e, k: int, texts: TokenTexts) -> dict:
    """One generated token for choices[0].logprobs.content, with its top k alternatives."""
    text, raw = texts.of(e.token)
    top = []
    for tid, lp in e.top[:k]:
        t, b = texts.of(tid)
        top.append({"token": t, "logprob": lp, "bytes": b})
    return {"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top}


def chat_logprobs(entries: list, k: int, texts: TokenTexts) -> dict:
    return {"content": [chat_entry(e, k, texts) for e in entries], "refusal": None}


class CompletionLogprobs:
    """The legacy `logprobs` object, built token by token (streamed chunks carry slices of it).
    k: alternatives per token (the request's `logprobs`); the chosen token is always among
    them (OpenAI: up to k + 1). offset: the text offset of the next token. skip_special: tokens
    the text leaves out take no characters."""

    def __init__(self, k: int, texts: TokenTexts, offset: int = 0, skip_special: bool = True):
        self.k, self.texts, self.offset, self.skip = k, texts, offset, skip_special

    def add(self, out: dict, tid: int, e) -> None:
        """Append token tid (its entry e, or None for the prompt's first token) to out."""
        text = self.texts.text(tid)
        out["tokens"].append(text)
        out["text_offset"].append(self.offset)
        if not (self.skip and tid in self.texts.special):
            self.offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            return
        top = {}
        for t, lp in e.top[:self.k]:
            top.setdefault(self.texts.text(t), lp)
        top.setdefault(text, e.logprob)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append(top)

    def build(self, ids: list, entries: list) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e in zip(ids, entries):
            self.add(out, tid, e)
        return out
