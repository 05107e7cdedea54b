"""`dsv4 chat`: a multi-turn chat in the terminal, or through a pipe (one message a line).

Each turn continues the sequence the session holds (`build_followup_ids` +
`Session.generate(..., continue_sequence=True)`): earlier turns are never read again. Answers
stream; thinking mode's reasoning is shown apart from the answer; a stats line per turn goes to
stderr. Commands: /reset, /thinking on|off, /exit. On a terminal: line editing and history
(readline); Ctrl-C stops the answer, not the conversation. On a pipe: each answer ends with the
line END_OF_ANSWER. Exit status as `dsv4 decode` (docs/CLI.md).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from ..errors import InputError, UserInputError, exit_code, in_cli_words
from .options import (
    Parser,
    add_model_args,
    add_runtime_args,
    add_sampling_args,
    check_checkpoint_args,
    check_runtime_args,
    check_tp_split,
    checkpoint_dir,
    load_session,
    load_tp_session,
    model_name,
    sampling_params,
)

CHAT_CONTEXT = 8192        # default capacity of a conversation (tokens)
MAX_NEW = 512              # default answer length (tokens)
DEMO_MAX_NEW = 16          # ... with the demo: random text at ~1-20 tok/s on a CPU, so an answer
                           # that ends in seconds (the README's pipe example: two of them)
COMMANDS = "/reset (new conversation), /thinking on|off, /exit"
DIM, PLAIN = "\x1b[2m", "\x1b[0m"
END_OF_ANSWER = "[end of answer]"   # on a pipe: the line after each answer (or refused turn)
HISTORY_LINES = 1000


def build_parser() -> Parser:
    p = Parser(prog="dsv4 chat", description="Multi-turn chat with a DeepSeek-V4 checkpoint: each "
               "turn continues the sequence (earlier turns are not read again). Type a message "
               f"per line; commands: {COMMANDS}. Ctrl-C stops an answer (the conversation "
               f"keeps it), at the prompt it leaves. On a pipe: one message per line, EOF ends, "
               f"each answer ends with a line {END_OF_ANSWER}.")
    add_model_args(p)
    p.add_argument("--system", help="system prompt of each conversation")
    p.add_argument("--thinking", action="store_true",
                   help="start in thinking mode (the reasoning shows apart from the answer; "
                        "/thinking on|off switches from the next turn)")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"most tokens per answer (default: {MAX_NEW}; {DEMO_MAX_NEW} with the "
                        f"demo, whose random text is slow on a CPU)")
    add_sampling_args(g)
    add_runtime_args(p, max_seq_len=CHAT_CONTEXT, max_seq_len_help="cache capacity: the longest "
                     "conversation in tokens (then /reset)", parallel=True)
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


class StopOnInterrupt:
    """Ctrl-C (SIGINT) while an answer streams: the first one asks the answer to stop at its next
    token (`requested`, read by the token callback: the session stops there cleanly, its state
    whole); a second one, before that happens, raises KeyboardInterrupt at once. Outside the
    `with` block SIGINT is what it was. Only the main thread can take signals: elsewhere a no-op."""

    def __init__(self):
        self.requested = False
        self._old = None

    def _handler(self, sig, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopOnInterrupt":
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


class Conversation:
    """The messages a session holds and the next turn's ids; one turn at a time."""

    def __init__(self, session, tok, *, system: str | None, thinking: bool, max_new: int,
                 out=sys.stdout, err=sys.stderr, tty: bool = False):
        self.session, self.tok, self.system = session, tok, system
        self.thinking, self.max_new = thinking, max_new
        self.out, self.err, self.tty = out, err, tty
        self.messages: list[dict] = []
        self.needs_eos = False         # the last reply was cut before its EOS
        self.interrupt = StopOnInterrupt()

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
        """Answer one user message (streamed); the stats dict, or None when it did not fit or a
        second Ctrl-C broke it off. A first Ctrl-C stops the answer at its next token: the
        conversation keeps it, cut, as an answer cut by --max-new-tokens
        (finish_reason "interrupted")."""
        try:
            return self._turn(text)
        finally:
            if not self.tty:           # one block per message on a pipe, refused ones too
                self.out.write(END_OF_ANSWER + "\n")
                self.out.flush()

    def _turn(self, text: str) -> dict | None:
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
        stop, pushed = self.interrupt, []

        def push(tid: int) -> bool:    # truthy: the session stops after this token
            stream.push(tid)
            pushed.append(tid)
            return stop.requested
        try:
            with stop:
                res = self.session.generate(ids, n_new, eos_id=self.tok.eos_id, on_token=push,
                                            continue_sequence=bool(self.messages))
        except KeyboardInterrupt:      # a second Ctrl-C: the state may be mid-step
            stream.finish()
            self.reset()
            self._say("interrupted twice: the conversation was reset")
            return None
        # a speculative step outputs all of its tokens, also past the one at which Ctrl-C
        # stopped it (and the step launched before that one was read): they are in the
        # sequence the next turn continues, so the answer shows and keeps them too
        for tid in res.output_ids[len(pushed):]:
            stream.push(tid)
        stream.finish()
        finish = "interrupted" if res.finish_reason == "stopped" else res.finish_reason
        if self.system and not self.messages:
            self.messages.append({"role": "system", "content": self.system})
        self.messages += [user, stream.message()]
        # an answer that already holds its EOS (a speculative step's, past the stop) needs none
        self.needs_eos = (res.finish_reason != "eos"
                          and res.output_ids[-1:] != [self.tok.eos_id])
        t = res.timings
        stats = {"tokens": len(res.output_ids), "finish_reason": finish,
                 "decode_tok_per_s": t["decode_tok_per_s"], "cached": cached,
                 "prefilled": prefilled, "prefill_tok_per_s": t["prefill_tok_per_s"],
                 "context": self.used}
        self._say(f"{stats['tokens']} tokens ({finish}) | decode "
                  f"{stats['decode_tok_per_s']:.1f} tok/s | prompt {stats['cached']} cached + "
                  f"{stats['prefilled']} prefilled ({stats['prefill_tok_per_s']:.0f} tok/s) | "
                  f"context {stats['context']}/{self.capacity}")
        if finish == "interrupted":
            self._say("answer stopped (Ctrl-C); the conversation keeps it as it stands. Ctrl-C "
                      "at the prompt, /exit or Ctrl-D leaves")
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


def history_file() -> Path:
    """Where the terminal chat keeps its input history (readline's format)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "dsv4" / "chat_history"


class LineEditing:
    """On a terminal: readline's line editing (arrows, Ctrl-A/E, Ctrl-R) for input() and the
    history of earlier sessions, saved on exit. Optional: without the readline module, or with a
    history file that cannot be read or written, input() works as before (one notice)."""

    def __init__(self, err=sys.stderr):
        self.err, self.path, self.readline = err, history_file(), None

    def __enter__(self) -> "LineEditing":
        try:
            import readline
        except ImportError:          # e.g. a Python built without it
            return self
        self.readline = readline
        readline.set_history_length(HISTORY_LINES)
        try:
            if self.path.is_file():
                readline.read_history_file(str(self.path))
        except OSError as e:
            self._notice(f"chat history not read ({self.path}: {e.strerror or e})")
        return self

    def __exit__(self, *exc) -> None:
        if self.readline is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(str(self.path))
        except OSError as e:
            self._notice(f"chat history not saved ({self.path}: {e.strerror or e})")

    def _notice(self, text: str) -> None:
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
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    cap = args.max_seq_len
    if cap is None or cap < 2:
        raise InputError(f"--max-seq-len {cap}: must be >= 2 (the longest conversation in tokens)")
    max_new = args.max_new_tokens
    if max_new is None:
        max_new = DEMO_MAX_NEW if (args.demo or not args.ckpt) else MAX_NEW
    ckpt = checkpoint_dir(args)
    cfg = ModelConfig.from_json(ckpt)
    check_checkpoint_args(args, cfg)
    check_tp_split(args, cfg, devices)
    tok = load_tokenizer(ckpt)
    load = load_tp_session if args.parallel == "tp" else load_session
    session, load_s = load(args, ckpt, cap, devices, mode, sampling)
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    chat = Conversation(session, tok, system=args.system, thinking=args.thinking,
                        max_new=max_new, tty=tty)
    how = "greedy" if seed is None else f"seed={seed}"
    tp = " tensor-parallel" if args.parallel == "tp" else ""
    chat._say(f"chat: {model_name(args, ckpt)} mode={mode} device={','.join(devices)}{tp} {how} | "
              f"capacity {cap} tokens | --max-new-tokens {max_new} | "
              f"load {load_s:.1f} s | thinking {'on' if args.thinking else 'off'} | {COMMANDS}"
              + (" | Ctrl-C stops an answer" if tty else ""))
    with session, (LineEditing() if tty else _Nothing()):
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


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def main(argv=None) -> int:
    return exit_code(lambda: run(build_parser().parse_args(argv)))

