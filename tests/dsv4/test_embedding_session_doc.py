"""The Session example of docs/EMBEDDING.md runs as written on the demo checkpoint (CPU, eager):
text to tokens, a streamed reply, a continued turn, a closed session."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "EMBEDDING.md"


def session_example() -> str:
    section = DOC.read_text().split("## The whole model", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_session_example_runs(demo_ckpt):
    code = session_example()
    # the settings the example names: the demo checkpoint, the CPU, a short reply (and, for the
    # CPU's speed, float32 activations and a small cache)
    for line, repl in ((r'ckpt = ".*"', f'ckpt = {str(demo_ckpt[0])!r}'),
                       (r"devices = \([^)]*\)", 'devices = ("cpu",)'),
                       (r"max_new = \d+", "max_new = 3"),
                       (r"max_seq_len=\d+", "max_seq_len=256, dtype=torch.float32")):
        code, n = re.subn(line, repl, code, count=1)
        assert n == 1, line
    out = io.StringIO()
    import torch
    scope = {"__name__": "embedding_session_example", "torch": torch}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "EMBEDDING.md: the Session example", "exec"), scope)
    s, res = scope["s"], scope["res"]
    assert s.mode == "eager" and res.finish_reason in ("eos", "length")
    assert [m["role"] for m in scope["messages"]] == ["system", "user", "assistant"]
    assert s.length > len(scope["ids"])                       # the second turn continued
    from graphs import LifecycleError
    with pytest.raises(LifecycleError):                        # the with block closed it
        s.decoder.step()
    assert out.getvalue().strip().splitlines()[-1].startswith(res.finish_reason)
