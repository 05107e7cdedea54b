"""The request bodies of the OpenAI API (pydantic), the parameters dsv4 adds, and the OpenAI error
object every refusal answers with.

Unknown fields are refused, as the OpenAI API refuses them ("Unrecognized request argument"), so
that a misspelt parameter is never ignored silently; fields the API defines that the runtime
cannot honour (n > 1, penalties, logit_bias, suffix, best_of) get a 400 naming them. dsv4's
own fields: top_k, use_cache, speculative, chat_template_kwargs {thinking, reasoning_effort},
return_token_ids, skip_special_tokens, ignore_eos (benchmarks); force_ids only on a server
started with the test option --allow-force-ids.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
MAX_TEMPERATURE = 2.0       # the OpenAI API's range is 0..2
MAX_LOGPROBS = 20           # top_logprobs (chat) and logprobs (completions): 0..20
# OpenAI's reasoning efforts -> the DSV4 encoding's: "max" adds the official preamble; the
# encoding has no lower effort than its default ("high"), so low and medium think as high does
EFFORTS = {"low": "high", "medium": "high", "high": "high", "max": "max"}
Effort = Literal["low", "medium", "high", "max"]


class ApiError(Exception):
    """A refusal with the OpenAI error object: status 400 / 404 / 503 ..., message naming the
    problem and the fix, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Any = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: str = "function"
    function: ToolFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")          # clients echo back what they received
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list, None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self, i: int) -> str | None:
        """The content as text: a string, or a list of {"type": "text"} parts joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"messages[{i}].content has a part of type {kind!r}: this "
                                    f"model reads text only (give {{'type': 'text', 'text': ...}} "
                                    f"parts or a string)", f"messages[{i}].content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class TemplateKwargs(_Strict):
    thinking: bool | None = None
    reasoning_effort: Effort | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields chat and completions share."""
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, allow_inf_nan=False)
    top_p: float | None = Field(None, allow_inf_nan=False)
    top_k: int | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = Field(None, validate_default=True)
    n: int = 1
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None
    use_cache: bool = True
    speculative: bool | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    force_ids: list[int] | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and not 0 <= v <= MAX_TEMPERATURE:
            raise ValueError(f"temperature {v}: must be in 0..{MAX_TEMPERATURE:g} (0 = greedy), "
                             f"as in the OpenAI API")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"top_p {v}: must be in (0, 1] (1 = off)")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v < -1:
            raise ValueError(f"top_k {v}: must be >= 0 (0 or -1 = off)")
        return None if v == -1 else v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not -2 ** 63 <= v < 2 ** 63:
            raise ValueError(f"seed {v}: must be a 64-bit integer")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP}")
        return [s for s in stops if s]

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ApiError(400, f"n = {self.n}: this server decodes one sequence per request "
                                f"(batch 1); send n = 1 and repeat the request for more choices",
                           "n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} = {getattr(self, name)}: penalties are not "
                                    f"implemented; leave it at 0", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not implemented; leave it out", "logit_bias")
        return self


class ChatRequest(_Sampling):
    messages: list[Message]
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    reasoning_effort: Effort | None = None
    response_format: dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _chat(self):
        if not self.messages:
            raise ApiError(400, "messages is empty: give at least one user message", "messages")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ApiError(400, f"top_logprobs = {self.top_logprobs}: must be in "
                                    f"0..{MAX_LOGPROBS}", "top_logprobs")
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs = true; set both",
                               "top_logprobs")
        kw = self.chat_template_kwargs
        if kw is not None and kw.thinking is False and self.effort is not None:
            raise ApiError(400, f"reasoning_effort {self.effort!r} asks for thinking, but "
                                f"chat_template_kwargs.thinking is false; drop one of them",
                           "reasoning_effort")
        self._check_tool_choice()
        for name in ("max_tokens", "max_completion_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ApiError(400, f"{name} = {v}: must be >= 1", name)
        return self

    def _check_tool_choice(self) -> None:
        """tool_choice: "auto", "none", "required" or {"type": "function", "function": {"name":
        one of the tools}}; the last two need tools and leave response_format out (each
        constrains the whole reply)."""
        tc, words = self.tool_choice, ("'auto', 'none', 'required' or {'type': 'function', "
                                       "'function': {'name': ...}}")
        if isinstance(tc, dict):
            fn = tc.get("function") if tc.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"tool_choice {tc!r}: expected {words}", "tool_choice")
        elif tc not in (None, "auto", "none", "required"):
            raise ApiError(400, f"tool_choice {tc!r}: expected {words}", "tool_choice")
        if not self.forces_tool:
            return
        if not self.tools:
            raise ApiError(400, f"tool_choice {tc!r} asks for a tool call, but the request has "
                                f"no tools; give tools or leave tool_choice out", "tool_choice")
        fns = [t.get("function", t) for t in self.tools if isinstance(t, dict)]
        names = [f.get("name") for f in fns if isinstance(f, dict)]
        if self.tool_name is not None and self.tool_name not in names:
            raise ApiError(400, f"tool_choice names the function {self.tool_name!r}, which is "
                                f"not among the tools ({', '.join(map(str, names))})",
                           "tool_choice")
        if (self.response_format or {}).get("type", "text") != "text":
            raise ApiError(400, f"tool_choice {tc!r} and response_format "
                                f"{self.response_format.get('type')!r} each constrain the whole "
                                f"reply; give one of them", "tool_choice")

    @property
    def forces_tool(self) -> bool:
        """tool_choice "required" or a named function: the reply is tool calls (decoding is
        constrained to them: dsv4.server.structured.tool_call_grammar)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    @property
    def tool_name(self) -> str | None:
        """The function a named tool_choice asks for (else None)."""
        tc = self.tool_choice
        return tc["function"]["name"] if isinstance(tc, dict) else None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def thinking(self) -> bool:
        """chat_template_kwargs.thinking, else on when a reasoning_effort is given (what OpenAI
        clients mean by it: reason, with this effort)."""
        kw = self.chat_template_kwargs
        if kw is not None and kw.thinking is not None:
            return kw.thinking
        return self.effort is not None

    @property
    def effort(self) -> str | None:
        """The request's reasoning effort, in OpenAI's words (low / medium / high / max)."""
        kw = self.chat_template_kwargs
        return (kw.reasoning_effort if kw and kw.reasoning_effort else None) or \
            self.reasoning_effort

    @property
    def encoding_effort(self) -> str | None:
        """The effort as the DSV4 encoding takes it (EFFORTS)."""
        return EFFORTS[self.effort] if self.effort is not None else None

    @property
    def top(self) -> int | None:
        """Alternatives per token when log-probabilities are asked for (else None)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def dsv4_messages(self) -> list[dict]:
        """The messages as dsv4.text.chat takes them (text content, tool calls as name + arguments)."""
        out = []
        for i, m in enumerate(self.messages):
            msg: dict = {"role": m.role, "content": m.text(i)}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name,
                                                   "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            out.append(msg)
        return out


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _completion(self):
        for name, bad in (("suffix", self.suffix is not None),
                          ("best_of", self.best_of not in (None, 1))):
            if bad:
                raise ApiError(400, f"{name} is not implemented (batch 1, no infilling); leave "
                                    f"it out", name)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs = {self.logprobs}: must be in 0..{MAX_LOGPROBS} (the "
                                f"alternatives returned per token)", "logprobs")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ApiError(400, f"max_tokens = {self.max_tokens}: must be >= 0 (0 with echo: "
                                f"score the prompt only)", "max_tokens")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"prompt is a batch of {len(p)} prompts: this server takes "
                                    f"one prompt per request (batch 1); send them one by one "
                                    f"(lm-evaluation-harness: batch_size=1)", "prompt")
            self.prompt = p[0]
        if not self.prompt:
            raise ApiError(400, "prompt is empty: give some text or token ids", "prompt")
        return self
