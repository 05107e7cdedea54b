"""From an OpenAI request to a decode job, and from the job's events to the OpenAI response: the
chat prompt (the DSV4 encoding, as decode.py builds it), the checks against the context length,
the sampling parameters (the request's, else the command line's), log-probabilities, echo and
structured output, the response objects, the server-sent event chunks and `usage` (with
prompt_tokens_details.cached_tokens).
"""
from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass, field

from ..errors import UserInputError
from ..runtime.sampling import SamplingParams
from ..text.chat import THINK_START
from ..text.tokenizer import build_prompt_ids
from .engine import Job
from .logprobs_format import CompletionLogprobs, TokenTexts, chat_entry, chat_logprobs
from .reply import REASONING, ReplyParser
from .schemas import ApiError, ChatRequest, CompletionRequest
from .structured import GrammarCompiler, constraint_for


@dataclass(frozen=True)
class Defaults:
    """What the command line sets: sampling defaults, the served model's name and limits."""
    model: str
    max_seq_len: int
    vocab_size: int
    sampling: SamplingParams          # seed: used when a request gives none (None: random)
    seed: int | None = None
    speculative: bool = False
    prefix_snapshots: int = 4
    allow_force_ids: bool = False
    # per tokenizer, made by the command: response_format grammars, token texts of log-probs
    grammar: GrammarCompiler | None = field(default=None, compare=False)
    texts: TokenTexts | None = field(default=None, compare=False)


def check_model(name: str | None, d: Defaults) -> None:
    if name is not None and name != d.model:
        raise ApiError(404, f"The model `{name}` does not exist: this server serves `{d.model}` "
                            f"(GET /v1/models)", "model", code="model_not_found")


def _sampling(req, d: Defaults) -> SamplingParams:
    base = d.sampling
    seed = req.seed if req.seed is not None else d.seed
    if seed is None:
        seed = secrets.randbelow(2 ** 31)
    try:
        return SamplingParams(base.temperature if req.temperature is None else req.temperature,
                              base.top_p if req.top_p is None else req.top_p,
                              base.top_k if req.top_k is None else req.top_k,
                              seed % 2 ** 63)
    except UserInputError as e:
        raise ApiError(400, str(e)) from None


def _limits(n_prompt: int, limit: int | None, d: Defaults, param: str) -> int:
    """max_tokens for a prompt of n_prompt ids: the request's, else what the context leaves.
    param: the field that holds the prompt ("messages" or "prompt")."""
    cap = d.max_seq_len
    if n_prompt >= cap:
        raise ApiError(400, f"the prompt has {n_prompt} tokens and the context length is {cap} "
                            f"(--max-seq-len): shorten the prompt, or restart the server with "
                            f"--max-seq-len above {n_prompt}", param,
                       code="context_length_exceeded")
    n = cap - n_prompt if limit is None else limit
    if n_prompt + n > cap:
        raise ApiError(400, f"prompt ({n_prompt} tokens) + max_tokens ({n}) = {n_prompt + n} "
                            f"exceeds the context length {cap} (--max-seq-len): lower max_tokens "
                            f"to at most {cap - n_prompt}, or restart the server with a larger "
                            f"--max-seq-len", "max_tokens", code="context_length_exceeded")
    return n


def _constraint(req, d: Defaults, tok, thinking: bool):
    """The token mask's Constraint of the request's response_format, or of its tool_choice where
    that asks for tool calls (None for text / none)."""
    forced = getattr(req, "forces_tool", False)
    param = "tool_choice" if forced else "response_format"
    if not forced and (req.response_format is None or req.response_format.get("type") == "text"):
        return None
    if req.force_ids is not None:
        raise ApiError(400, f"force_ids decides every token: leave {param} out", param)
    grammar = d.grammar or GrammarCompiler(tok, d.vocab_size)
    if forced:
        compiled = grammar.compile_tools(req.tools, req.tool_name,
                                         req.parallel_tool_calls is not False)
    else:
        compiled = grammar.compile(req.response_format)
    return constraint_for(compiled, tok, thinking, param)


def _job_common(req, d: Defaults, loop, prompt: list, limit, parser, param: str) -> Job:
    if req.speculative and not d.speculative:
        raise ApiError(400, "speculative = true, but the server was started without "
                            "--speculative 1; leave the field out", "speculative")
    if req.force_ids is not None:
        if not d.allow_force_ids:
            raise ApiError(400, "Unrecognized request argument supplied: force_ids", "force_ids")
        bad = [t for t in req.force_ids if not 0 <= t < d.vocab_size]
        if bad or not req.force_ids:
            raise ApiError(400, f"force_ids: give 1+ ids in 0..{d.vocab_size - 1}", "force_ids")
        if req.logprobs:
            raise ApiError(400, "force_ids decides every token: leave logprobs out", "logprobs")
        limit = len(req.force_ids)
    return Job(prompt=prompt, max_tokens=_limits(len(prompt), limit, d, param), texts=d.texts,
               sampling=_sampling(req, d), parser=parser, loop=loop,
               use_cache=req.use_cache, speculative=req.speculative, force_ids=req.force_ids,
               skip_special=req.skip_special_tokens, ignore_eos=req.ignore_eos)


def chat_job(req: ChatRequest, tok, d: Defaults, loop) -> Job:
    """The decode job of a chat request (400 for what cannot be encoded or does not fit)."""
    check_model(req.model, d)
    tools = req.tools if req.tool_choice != "none" else None
    try:
        ids = build_prompt_ids(tok, messages={"messages": req.dsv4_messages(), "tools": tools},
                               thinking=req.thinking, reasoning_effort=req.encoding_effort)
    except UserInputError as e:
        if str(e).startswith("tools["):
            raise ApiError(400, str(e), "tools") from None
        raise ApiError(400, f"messages: {e}", "messages") from None
    parser = ReplyParser(thinking=req.thinking, stop=tuple(req.stop), tools=True)
    job = _job_common(req, d, loop, ids, req.limit, parser, "messages")
    job.top = req.top
    job.constraint = _constraint(req, d, tok, req.thinking)
    # a thinking-mode follow-up re-encodes this turn with "</think>" where the prompt ends with
    # "<think>": keep a snapshot before that last token
    job.save_before_last = (d.prefix_snapshots > 0 and req.thinking and
                            ids[-1] == tok.token_to_id(THINK_START))
    return job


def completion_job(req: CompletionRequest, tok, d: Defaults, loop) -> Job:
    check_model(req.model, d)
    p = req.prompt
    if isinstance(p, str):
        try:
            ids = build_prompt_ids(tok, prompt=p, raw=True)
        except UserInputError as e:
            raise ApiError(400, f"prompt: {e}", "prompt") from None
    else:
        ids = list(p)
        bad = [t for t in ids if not 0 <= t < d.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is out of range: the vocabulary has "
                                f"{d.vocab_size} ids (0..{d.vocab_size - 1})", "prompt")
    parser = ReplyParser(thinking=False, stop=tuple(req.stop), tools=False)
    job = _job_common(req, d, loop, ids, req.max_tokens, parser, "prompt")
    if req.echo:
        special = tok.special_ids() if req.skip_special_tokens else frozenset()
        job.echo = tok.decode([t for t in ids if t not in special])
    job.top = req.logprobs
    job.score = req.echo and req.logprobs is not None
    job.constraint = _constraint(req, d, tok, False)
    return job


# ---- responses -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(job: Job, calls: int = 0) -> str:
    if calls:
        return "tool_calls"
    return "length" if job.finish == "length" else "stop"


def usage(job: Job) -> dict:
    n = len(job.output_ids)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": n,
            "total_tokens": len(job.prompt) + n,
            "prompt_tokens_details": {"cached_tokens": job.cached}}


def tool_call(call: dict, index: int) -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": dict(call["function"])}


def _content(job: Job, content: str, calls: list) -> str | None:
    """message.content: the text, or null when there is none because the reply is tool calls or
    a reasoning that max_tokens cut before it closed."""
    if content:
        return content
    return None if calls or job.parser.state == REASONING else ""


def chat_response(job: Job, deltas: list, rid: str, model: str, token_ids: bool) -> dict:
    reasoning = "".join(x.text for x in deltas if x.kind == "reasoning")
    content = "".join(x.text for x in deltas if x.kind == "content")
    calls = [tool_call(x.call, i) for i, x in
             enumerate(x for x in deltas if x.kind == "tool_call")]
    for c in calls:
        del c["index"]
    msg = {"role": "assistant", "content": _content(job, content, calls),
           "reasoning_content": reasoning if job.parser.thinking else None}
    if calls:
        msg["tool_calls"] = calls
    choice = {"index": 0, "message": msg,
              "logprobs": (chat_logprobs(job.logprobs, job.top, job.texts)
                           if job.top is not None else None),
              "finish_reason": finish_reason(job, len(calls))}
    out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": [choice], "usage": usage(job)}
    if token_ids:
        out["prompt_token_ids"], choice["token_ids"] = job.prompt, job.output_ids
    return out


def _echo_ids(job: Job) -> list:
    return job.prompt if job.echo is not None else []


def completion_response(job: Job, deltas: list, rid: str, model: str, token_ids: bool) -> dict:
    text = (job.echo or "") + "".join(x.text for x in deltas)
    logprobs = None
    if job.top is not None:
        prompt = _echo_ids(job)
        entries = ((job.prompt_logprobs or [None] * len(prompt)) if prompt else []) + \
            job.logprobs
        logprobs = CompletionLogprobs(job.top, job.texts, skip_special=job.skip_special).build(
            prompt + job.output_ids, entries)
    choice = {"index": 0, "text": text, "logprobs": logprobs,
              "finish_reason": finish_reason(job)}
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [choice], "usage": usage(job)}
    if token_ids:
        out["prompt_token_ids"], choice["token_ids"] = job.prompt, job.output_ids
    return out


class ChunkWriter:
    """The server-sent events of one streamed response ("data: {json}\\n\\n" ... "data: [DONE]");
    a piece's log-probs ride in its chunk (chat: logprobs.content; completions: the legacy
    object for its tokens; an echo's prompt and its log-probs come first)."""

    def __init__(self, job: Job, rid: str, model: str, chat: bool, include_usage: bool):
        self.job, self.rid, self.model, self.chat = job, rid, model, chat
        self.include_usage, self.created, self.calls = include_usage, int(time.time()), 0
        self._echo = job.echo is not None and not chat          # the echo is still to send
        self._n = 0                                             # generated tokens sent
        self._lp = (CompletionLogprobs(job.top, job.texts, skip_special=job.skip_special)
                    if job.top is not None and not chat else None)

    def _event(self, choices: list, **extra) -> bytes:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else
               "text_completion", "created": self.created, "model": self.model,
               "choices": choices, **extra}
        return b"data: " + _json(obj) + b"\n\n"

    def _choice(self, delta: dict | str, finish: str | None = None, entries=None) -> dict:
        if self.chat:
            lp = None
            if entries is not None and self.job.top is not None:
                lp = {"content": [chat_entry(e, self.job.top, self.job.texts) for e in entries]}
            return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        lp = None
        if entries is not None and self._lp is not None:
            lp = self._lp.build([e.token for e in entries], entries)
        return {"index": 0, "text": delta, "logprobs": lp, "finish_reason": finish}

    def start(self) -> bytes:
        return self._event([self._choice({"role": "assistant", "content": ""})]) if self.chat \
            else b""

    def _echo_chunk(self) -> bytes:
        """Completions with echo: the prompt's text (and log-probs), before any generated text."""
        if not self._echo:
            return b""
        self._echo, job = False, self.job
        lp = None
        if self._lp is not None:
            entries = job.prompt_logprobs or [None] * len(job.prompt)
            lp = self._lp.build(job.prompt, entries)
        return self._event([{"index": 0, "text": job.echo, "logprobs": lp,
                             "finish_reason": None}])

    def deltas(self, deltas: list) -> bytes:
        out = [self._echo_chunk()]
        for d in deltas:
            if not self.chat:
                out.append(self._event([self._choice(d.text, entries=d.logprobs)]))
            elif d.kind == "tool_call":
                out.append(self._event([self._choice(
                    {"tool_calls": [tool_call(d.call, self.calls)]}, entries=d.logprobs)]))
                self.calls += 1
            else:
                key = "reasoning_content" if d.kind == "reasoning" else "content"
                out.append(self._event([self._choice({key: d.text}, entries=d.logprobs)]))
        return b"".join(out)

    def end(self) -> bytes:
        fin = finish_reason(self.job, self.calls)
        out = self._echo_chunk() + self._event([self._choice({} if self.chat else "", fin)])
        if self.include_usage:
            out += self._event([], usage=usage(self.job))
        return out + b"data: [DONE]\n\n"

    @staticmethod
    def error(err: ApiError) -> bytes:
        return b"data: " + _json(err.body()) + b"\n\ndata: [DONE]\n\n"


def _json(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
