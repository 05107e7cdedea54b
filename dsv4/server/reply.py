"""Streaming parse of a generated DSV4 reply into OpenAI deltas: reasoning, content, tool calls.

Text arrives in pieces that may split any marker ("</think>", "<｜DSML｜tool_calls>", a stop
string) anywhere; a piece is emitted only once no marker can start in it, so markup never reaches
`content` and a tool call split over many pieces is emitted whole, once its `</｜DSML｜invoke>`
arrives. The rules are those of `dsv4.text.chat.parse_completion`: in thinking mode everything before
"</think>" is reasoning; content ends where the tool-call block opens (the "\\n\\n" before it is
dropped; an opener without them opens the block too); text after the closed block is dropped.
Stop strings end the content at their first occurrence (they are matched in content only).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..text.chat import (
    INVOKE_CLOSE,
    THINK_END,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    parse_tool_calls,
)

REASONING, CONTENT, CALLS, DONE = "reasoning", "content", "calls", "done"


@dataclass
class Delta:
    """One piece of the reply: kind "reasoning" | "content" (text) or "tool_call" (call: an
    OpenAI tool call without id)."""
    kind: str
    text: str = ""
    call: dict | None = None
    logprobs: list | None = None      # TokenLogprobs of the tokens since the previous piece


@dataclass
class ReplyParser:
    """Feed text pieces with push(); finish() at the end. thinking: the reply opens with
    reasoning; tools: parse the DSML tool-call block (off: plain text, e.g. /v1/completions)."""
    thinking: bool = False
    stop: tuple = ()
    tools: bool = True
    state: str = field(init=False)
    stopped: bool = field(init=False, default=False)    # a stop string ended the reply
    calls: list = field(init=False, default_factory=list)
    _buf: str = field(init=False, default="")

    def __post_init__(self):
        self.state = REASONING if self.thinking else CONTENT
        self.stop = tuple(s for s in self.stop if s)

    def push(self, text: str) -> list[Delta]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        """The held text: an unclosed reasoning block stays reasoning; a partial marker at the
        end of the content is emitted unless it is DSML markup; an unclosed tool-call block is
        dropped (its complete invokes were emitted already)."""
        return self._drain(final=True)

    @property
    def done(self) -> bool:
        """Nothing more will be emitted (a stop string hit): the generation may stop."""
        return self.stopped

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self.state == REASONING:
                i = self._buf.find(THINK_END)
                if i >= 0:
                    self._emit(out, REASONING, self._buf[:i])
                    self._buf, self.state = self._buf[i + len(THINK_END):], CONTENT
                    continue
                keep = 0 if final else _held(self._buf, (THINK_END,))
                self._emit(out, REASONING, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            if self.state == CONTENT:
                if self._content(out, final):
                    continue
                return out
            if self.state == CALLS:
                if self._calls(out, final):
                    continue
                return out
            self._buf = ""                               # DONE: the rest is dropped
            return out

    def _content(self, out: list, final: bool) -> bool:
        """Emit content up to the next marker; True when the state changed (drain again)."""
        buf = self._buf
        opener = buf.find(TOOL_CALLS_OPEN) if self.tools else -1
        stop_at = -1
        for s in self.stop:
            j = buf.find(s)
            if j >= 0 and (stop_at < 0 or j < stop_at):
                stop_at = j
        if stop_at >= 0 and (opener < 0 or stop_at < opener):
            self._emit(out, CONTENT, buf[:stop_at])
            self._buf, self.state, self.stopped = "", DONE, True
            return True
        if opener >= 0:
            text = buf[:opener]
            self._emit(out, CONTENT, text[:-2] if text.endswith("\n\n") else text)
            self._buf, self.state = buf[opener + len(TOOL_CALLS_OPEN):], CALLS
            return True
        markers = ((("\n\n" + TOOL_CALLS_OPEN),) if self.tools else ()) + self.stop
        keep = _held(buf, markers)
        if final and "<｜" not in buf[len(buf) - keep:]:  # at the end only a cut opener is held
            keep = 0
        self._emit(out, CONTENT, buf[:len(buf) - keep])
        self._buf = "" if final else buf[len(buf) - keep:]
        return False

    def _calls(self, out: list, final: bool) -> bool:
        buf = self._buf
        end_invoke, end_block = buf.find(INVOKE_CLOSE), buf.find(TOOL_CALLS_CLOSE)
        if end_invoke >= 0 and (end_block < 0 or end_invoke < end_block):
            cut = end_invoke + len(INVOKE_CLOSE)
            for call in parse_tool_calls(buf[:cut]):
                self.calls.append(call)
                out.append(Delta("tool_call", call=call))
            self._buf = buf[cut:]
            return True
        if end_block >= 0:
            self._buf, self.state = "", DONE
            return True
        if final:
            self._buf = ""
        return False

    def _emit(self, out: list, kind: str, text: str) -> None:
        if text:
            out.append(Delta(kind, text))


def _held(buf: str, markers) -> int:
    """Length of the longest suffix of buf that is a proper prefix of a marker (may still become
    one)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best
