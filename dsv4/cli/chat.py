"""`dsv4 chat`: a multi-turn chat in the terminal, or through a pipe (one message a line).

Each turn continues the sequence the session holds (`build_followup_ids` +
`Session.generate(..., continue_sequence=True)`): earlier turns are never read again. Answers
stream; thinking mode's reasoning is shown apart from the answer; a stats line per turn goes to
stderr. Commands: /reset, /thinking on|off, /exit. Exit status as `dsv4 decode` (docs/CLI.md).
"""
from __future__ import annotations

import sys

from ..errors import InputError, UserInputError, exit_code, in_cli_words
from .options import (
    Parser,
    add_model_args,
    add_runtime_args,
    add_sampling_args,
    check_checkpoint_args,
    check_runtime_args,
    checkpoint_dir,
    load_session,
    sampling_params,
)

CHAT_CONTEXT = 8192        # default capacity of a conversation (tokens)
COMMANDS = "/reset (new conversation), /thinking on|off, /exit"
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


def build_parser() -> Parser:
    p = Parser(prog="dsv4 chat", description="Multi-turn chat with a DeepSeek-V4 checkpoint: each "
               "turn continues the sequence (earlier turns are not read again). Type a message "
               f"per line; commands: {COMMANDS}. On a pipe: one message per line, EOF ends.")
    add_model_args(p)
    p.add_argument("--system", help="system prompt of each conversation")
    p.add_argument("--thinking", action="store_true",
                   help="start in thinking mode (the reasoning shows apart from the answer; "
                        "/thinking on|off switches from the next turn)")
    add_sampling_args(p, max_new_tokens=512)
    add_runtime_args(p, max_seq_len=CHAT_CONTEXT, max_seq_len_help="cache capacity: the longest "
                     "conversation in tokens (then /reset)")
    return p


class ReplyStream:
    """Writes one reply as it streams: reasoning (thinking mode, up to "</think>") apart from the
    answer, dimmed on a terminal, between [thinking] and [/thinking] lines on a pipe."""

    def __init__(self, out, tok, reasoning: bool, tty: bool):
        from ..text.tokenizer import IncrementalDetokenizer
        self.out, self.tok, self.tty = out, tok, tty
        self.detok = IncrementalDetokenizer(tok)
        self.think_end = tok.token_to_id("</think>")
        self.in_reasoning = reasoning
        self.reasoning: list[int] = []
        self.answer: list[int] = []
        if reasoning:
            self._write(DIM if tty else "[thinking]\n")

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def push(self, tid: int) -> None:
        if self.in_reasoning and tid == self.think_end:
            self._end_reasoning()
            return
        (self.reasoning if self.in_reasoning else self.answer).append(tid)
        if tid != self.tok.eos_id:
            self._write(self.detok.push(tid))

    def _end_reasoning(self) -> None:
        self.in_reasoning = False
        self._write(self.detok.flush() + (PLAIN + "\n" if self.tty else "\n[/thinking]\n"))

    def finish(self) -> None:
        if self.in_reasoning:          # cut before "</think>": close the block all the same
            self._end_reasoning()
        self._write(self.detok.flush() + "\n")

    def message(self) -> dict:
        """The reply as an assistant message (for the conversation's context)."""
        ids = [t for t in self.answer if t != self.tok.eos_id]
        msg = {"role": "assistant", "content": self.tok.decode(ids)}
        if self.reasoning:
            msg["reasoning_content"] = self.tok.decode(self.reasoning)
        return msg


class Conversation:
    """The messages a session holds and the next turn's ids; one turn at a time."""

    def __init__(self, session, tok, *, system: str | None, thinking: bool, max_new: int,
                 out=sys.stdout, err=sys.stderr, tty: bool = False):
        self.session, self.tok, self.system = session, tok, system
        self.thinking, self.max_new = thinking, max_new
        self.out, self.err, self.tty = out, err, tty
        self.messages: list[dict] = []
        self.needs_eos = False         # the last reply was cut before its EOS

    @property
    def capacity(self) -> int:
        return self.session.model.rt.max_seq_len

    @property
    def used(self) -> int:
        """Positions the next turn starts at: the state plus the pending (unfed) token."""
        return self.session.length + (self.session.pending is not None)

    def reset(self) -> None:
        self.session.reset()
        self.messages, self.needs_eos = [], False

    def _ids(self, user: dict) -> list[int]:
        from ..text.tokenizer import build_followup_ids, build_prompt_ids
        if not self.messages:
            first = ([{"role": "system", "content": self.system}] if self.system else []) + [user]
            return build_prompt_ids(self.tok, messages=first, thinking=self.thinking)
        ids = build_followup_ids(self.tok, [user], context=self.messages, thinking=self.thinking)
        return ([self.tok.eos_id] if self.needs_eos else []) + ids

    def turn(self, text: str) -> dict | None:
        """Answer one user message (streamed); the stats dict, or None when it did not fit."""
        user = {"role": "user", "content": text}
        ids = self._ids(user)
        cached = self.session.length if self.messages else 0      # held, not read again
        prefilled = len(ids) + bool(self.messages and self.session.pending is not None)
        start = cached + prefilled - len(ids)
        n_new = min(self.max_new, self.capacity - start - len(ids))
        if n_new < 1:
            self._say(f"the context is full: this message needs {len(ids)} tokens and "
                      f"{start} of the {self.capacity} (--max-seq-len) are used. /reset starts a "
                      f"new conversation (or restart with a larger --max-seq-len)")
            return None
        stream = ReplyStream(self.out, self.tok, self.thinking, self.tty)
        try:
            res = self.session.generate(ids, n_new, eos_id=self.tok.eos_id, on_token=stream.push,
                                        continue_sequence=bool(self.messages))
        except KeyboardInterrupt:
            stream.finish()
            self.reset()               # the state is mid-step: start afresh
            self._say("interrupted: the conversation was reset")
            return None
        stream.finish()
        if self.system and not self.messages:
            self.messages.append({"role": "system", "content": self.system})
        self.messages += [user, stream.message()]
        self.needs_eos = res.finish_reason != "eos"
        t = res.timings
        stats = {"tokens": len(res.output_ids), "finish_reason": res.finish_reason,
                 "decode_tok_per_s": t["decode_tok_per_s"], "cached": cached,
                 "prefilled": prefilled, "prefill_tok_per_s": t["prefill_tok_per_s"],
                 "context": self.used}
        self._say(f"{stats['tokens']} tokens ({res.finish_reason}) | decode "
                  f"{stats['decode_tok_per_s']:.1f} tok/s | prompt {stats['cached']} cached + "
                  f"{stats['prefilled']} prefilled ({stats['prefill_tok_per_s']:.0f} tok/s) | "
                  f"context {stats['context']}/{self.capacity}")
        if res.finish_reason == "length" and n_new < self.max_new:
            self._say(f"the context is full ({self.capacity} tokens, --max-seq-len): the answer "
                      f"was cut. /reset starts a new conversation")
        return stats

    def command(self, line: str) -> bool:
        """Run a /command; False for /exit."""
        word, _, arg = line.partition(" ")
        arg = arg.strip().lower()
        if word in ("/exit", "/quit"):
            return False
        if word == "/reset":
            self.reset()
            self._say("new conversation")
        elif word == "/thinking" and arg in ("on", "off"):
            self.thinking = arg == "on"
            self._say(f"thinking mode {arg} (from the next turn"
                      + (")" if not self.messages else "; /reset to start afresh in it)"))
        elif word == "/thinking":
            self._say(f"thinking mode is {'on' if self.thinking else 'off'}; /thinking on|off "
                      f"switches it")
        else:
            self._say(f"unknown command {word!r}; commands: {COMMANDS}")
        return True

    def _say(self, text: str) -> None:
        self.err.write(f"[dsv4] {text}\n")
        self.err.flush()


def _lines(tty: bool):
    """The user's lines: input() with a prompt on a terminal, stdin's lines on a pipe."""
    while True:
        if tty:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return
        else:
            line = sys.stdin.readline()
            if not line:
                return
        yield line.strip()


def run(args) -> int:
    from ..text.tokenizer import load_tokenizer
    from ..weights.config import ModelConfig
    devices, mode = check_runtime_args(args)
    sampling, seed = sampling_params(args)
    cap = args.max_seq_len
    if cap is None or cap < 2:
        raise InputError(f"--max-seq-len {cap}: must be >= 2 (the longest conversation in tokens)")
    ckpt = checkpoint_dir(args)
    cfg = ModelConfig.from_json(ckpt)
    check_checkpoint_args(args, cfg)
    tok = load_tokenizer(ckpt)
    session, load_s = load_session(args, ckpt, cap, devices, mode, sampling)
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    chat = Conversation(session, tok, system=args.system, thinking=args.thinking,
                        max_new=args.max_new_tokens, tty=tty)
    how = "greedy" if seed is None else f"seed={seed}"
    chat._say(f"chat: {ckpt.name} mode={mode} device={','.join(devices)} {how} | capacity {cap} "
              f"tokens | load {load_s:.1f} s | thinking {'on' if args.thinking else 'off'} | "
              f"{COMMANDS}")
    with session:
        for line in _lines(tty):
            if not line:
                continue
            if line.startswith("/"):
                if not chat.command(line):
                    break
                continue
            try:
                chat.turn(line)
            except UserInputError as e:          # a bad message loses nothing: say so, go on
                chat._say(f"error: {in_cli_words(str(e))}")
    return 0


def main(argv=None) -> int:
    return exit_code(lambda: run(build_parser().parse_args(argv)))

