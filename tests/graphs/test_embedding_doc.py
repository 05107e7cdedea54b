"""The runnable example in docs/EMBEDDING.md runs (eager on CPU, graphs on CUDA) and decodes."""
from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "EMBEDDING.md"


def example_code() -> str:
    text = DOC.read_text()
    section = text.split("## Example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_example_runs_and_decodes():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(example_code(), str(DOC), "exec"), {"__name__": "embedding_example"})
    first, last = buf.getvalue().strip().splitlines()[-2:]
    assert first.startswith("graph" if torch.cuda.is_available() else "eager")
    ids = ast.literal_eval(last)
    assert len(ids) == 8 and all(0 <= i < 32 for i in ids)
    assert ids[0] != ids[1] or ids[1] != ids[2], "decode looks stuck"


def test_doc_mentions_the_contract():
    text = DOC.read_text()
    for phrase in ("overwritten by the next step", "allocate()", "warmup()", "capture()",
                   "close()", "eager_step", "granularity", "debug=True", "CUDA_LAUNCH_BLOCKING",
                   "graph_pool_handle", "own stream"):
        assert phrase in text, phrase
