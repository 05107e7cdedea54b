"""Every ```python block of README.md and docs/*.md runs as written, or says it does not.

A block is one of: a sketch (its first line `# sketch: <what it shows>`; compiled, not run); run
by a test of its own (the text right after the block names `tests/....py`, a file that reads this
page); or run here, as written, in a fresh interpreter from the repository root (a block that
imports a package this installation lacks skips, naming it). Anything else fails: a newcomer
copies these blocks. A block that reads the checkpoint a `dsv4 make-checkpoint ... --out PATH`
line of the page's ```bash blocks writes gets it first, made by that line (once a test run, under
a lock: both xdist workers may need it), as the newcomer would have made it.
"""
from __future__ import annotations

import ast
import fcntl
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_YET: set = set()     # pages left out (none: SERVING.md's client example has a test of its own)
BLOCK = re.compile(r"^```python\n(.*?)^```\n?(.*?)(?=^```|\Z)", re.S | re.M)
OWN_TEST = re.compile(r"`(tests/[\w/]+\.py)`")
BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def made_checkpoints(page: Path) -> dict[str, list[str]]:
    """--out PATH -> the arguments of each `dsv4 make-checkpoint` line in the page's bash
    blocks."""
    out = {}
    for block in BASH.findall(page.read_text()):
        for line in block.splitlines():
            words = shlex.split(line.split("#")[0])
            if words[:2] == ["dsv4", "make-checkpoint"] and "--out" in words:
                out[words[words.index("--out") + 1]] = words[2:]
    return out


def make_checkpoint_once(path: str, args: list[str]) -> None:
    """Run `dsv4 make-checkpoint args` (writing `path`) unless this test run made it already:
    a marker in it names the run (pytest-xdist's run id, shared by its workers; else this
    process), so a checkpoint left by an older tree is made again. Under a lock file."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid-{os.getpid()}"
    marker = Path(path) / ".made-by-test-run"
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text() == run:
            return
        shutil.rmtree(path, ignore_errors=True)
        p = subprocess.run([sys.executable, "-m", "dsv4", "make-checkpoint", *args],
                           capture_output=True, text=True, timeout=600, cwd=REPO)
        assert p.returncode == 0, f"dsv4 make-checkpoint {' '.join(args)}: {p.stderr[-2000:]}"
        marker.write_text(run)


def blocks():
    """(page, index, code, the text after the block up to the next fence)."""
    out = []
    for page in PAGES:
        rel = str(page.relative_to(REPO))
        if rel in NOT_YET:
            continue
        for i, m in enumerate(BLOCK.finditer(page.read_text()), 1):
            out.append(pytest.param(page, m.group(1), m.group(2), id=f"{rel}#{i}"))
    return out


@pytest.mark.parametrize("page, code, after", blocks())
def test_block_runs_or_says_it_does_not(page, code, after):
    where = f"{page.relative_to(REPO)}"
    compile(code, where, "exec")                    # every block is valid Python, sketches too
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if first.startswith("# sketch:"):
        assert len(first) > len("# sketch: ") + 10, f"{where}: a sketch says what it shows"
        return
    named = OWN_TEST.search(" ".join(after.split()[:60]))
    if named:
        test = REPO / named.group(1)
        assert test.is_file(), f"{where} names {named.group(1)}, which does not exist"
        assert page.name in test.read_text(), f"{named.group(1)} does not read {page.name}"
        return
    for path, args in made_checkpoints(page).items():
        if path in code:
            make_checkpoint_once(path, args)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    lacking = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", p.stderr)
    if p.returncode and lacking and lacking.group(1).split(".")[0] not in ("dsv4", "graphs",
                                                                            "examples"):
        pytest.skip(f"{where}: needs {lacking.group(1)} (not installed)")
    assert p.returncode == 0, f"{where}: a block that does not run as written:\n{code}\n" \
                              f"{p.stderr[-3000:]}"


def test_every_page_is_covered():
    assert not NOT_YET
    assert len(blocks()) >= 8          # EMBEDDING.md's, REAL_MODEL.md's and SERVING.md's at least


def test_the_memory_snippet_prints_the_numbers_the_page_shows():
    """REAL_MODEL.md's snippet prints the Flash figures of its table (72.2 / 73.6 GiB at 64K)."""
    page = (REPO / "docs" / "REAL_MODEL.md").read_text()
    code = BLOCK.search(page.split("## Where the memory numbers come from")[1]).group(1)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr
    gib = ast.literal_eval(p.stdout.strip().splitlines()[-1])
    assert (round(gib["cuda:0"], 1), round(gib["cuda:1"], 1)) == (72.2, 73.6)
    assert "| 72.2 / 73.6 |" in page
