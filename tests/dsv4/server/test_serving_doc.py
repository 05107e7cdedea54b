"""docs/SERVING.md's client example runs as written against a `--demo` server (the page's own
address swapped for the test server's): every feature it shows (thinking, cached tokens, tools
streamed, log-probabilities, a JSON schema, scoring with echo) answers without an error."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving import REPO, ServerProcess, require_serve_packages

PAGE = REPO / "docs" / "SERVING.md"


def client_block() -> str:
    """The first ```python block of SERVING.md that is not a sketch (the client example)."""
    for code in re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M):
        if not code.lstrip().startswith("# sketch:"):
            return code
    raise AssertionError("SERVING.md has no client example")


def test_the_client_example_runs_against_a_demo_server(tmp_path):
    require_serve_packages()
    pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    code = client_block()
    assert "http://127.0.0.1:8000/v1" in code
    srv = ServerProcess(["--demo", "--max-seq-len", 512, "--device", "cpu"],
                        log=tmp_path / "server.log")
    try:
        run = subprocess.run([sys.executable, "-c",
                              code.replace("127.0.0.1:8000", f"127.0.0.1:{srv.port}")],
                             capture_output=True, text=True, timeout=600, cwd=REPO)
        assert run.returncode == 0, f"{run.stderr[-3000:]}\nserver: {srv.stderr_tail()}"
        assert "length" in run.stdout or "stop" in run.stdout    # the schema reply's finish
    finally:
        assert srv.stop() == 0
