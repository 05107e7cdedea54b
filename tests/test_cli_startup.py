"""What the `dsv4` command checks before it loads anything: --help without importing torch, every
output path (exit 2 naming the flag), a busy --port for `dsv4 serve` (exit 2 before the model
loads); and `bench` takes --device like every other command (--devices kept as an alias)."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from conftest import REPO

HEAVY = ("torch", "numpy", "safetensors", "tokenizers", "huggingface_hub", "fastapi", "uvicorn")
PROBE = """
import contextlib, io, sys
from dsv4.cli.main import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        rc = main(sys.argv[1:])
    except SystemExit as e:
        rc = e.code
heavy = [m for m in {heavy!r} if m in sys.modules]
print(rc, len(out.getvalue()), ",".join(heavy) or "-")
"""


def dsv4(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "dsv4", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, **kw)


def dsv4_here(*args):
    """`dsv4 ...`'s main in this process: its exit status and what it prints (a subprocess
    importing torch takes ~4 s; the serve test below runs one as users do)."""
    from dsv4.cli.main import main
    from helpers import run_main
    return run_main(main, args, ["dsv4"])


def error_line(p) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


@pytest.mark.parametrize("argv", [["--help"], ["decode", "--help"], ["chat", "--help"],
                                  ["serve", "--help"], ["make-checkpoint", "--help"],
                                  ["bench", "--help"]])
def test_help_imports_no_torch(argv):
    """`dsv4 decode --help` took ~3 s on a 2-core CPU importing torch; it imports none of it."""
    p = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    rc, chars, heavy = p.stdout.split()
    assert rc == "0" and int(chars) > 200, p.stderr      # the help itself was printed
    assert heavy == "-", f"dsv4 {' '.join(argv)} imported {heavy}"


def test_make_checkpoint_weight_choices_are_the_writers():
    """make-checkpoint spells out --weights' choices (its writer's module imports torch)."""
    from dsv4.cli.main import make_checkpoint
    from dsv4.weights.synthetic import WEIGHT_MODES
    with pytest.raises(SystemExit):
        make_checkpoint(["--help"])
    p = subprocess.run([sys.executable, "-m", "dsv4", "make-checkpoint", "--help"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "{" + ",".join(WEIGHT_MODES) + "}" in p.stdout


@pytest.mark.parametrize("path, words", [
    ("/nonexistent-dsv4/x.npy", ["/nonexistent-dsv4", "does not exist"]),
    (".", ["is a directory"]),
    ("/proc/dsv4-logits.npy", ["cannot write there"]),
])
def test_an_output_path_is_checked_before_anything_loads(path, words):
    """--dump-logits is checked first: even with a checkpoint that does not exist, the error is
    the output path's (nothing was resolved, downloaded or loaded)."""
    line = error_line(dsv4_here("decode", "--ckpt", "/nonexistent-ckpt", "--prompt-ids", "1",
                                "--dump-logits", path))
    assert "--dump-logits" in line and all(w in line for w in words), line


def test_an_output_folder_that_cannot_be_made(tmp_path):
    from dsv4.cli.options import check_output_dir
    from dsv4.errors import InputError
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="--profile torch: cannot write into"):
        check_output_dir(tmp_path / "file" / "profiles", "--profile torch")
    check_output_dir(tmp_path / "new" / "profiles", "--profile torch")     # made, writable
    assert (tmp_path / "new" / "profiles").is_dir()


def test_serve_on_a_busy_port_fails_before_loading():
    pytest.importorskip("uvicorn", reason="dsv4 serve needs the serve extra")
    pytest.importorskip("fastapi", reason="dsv4 serve needs the serve extra")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = dsv4("serve", "--demo", "--device", "cpu", "--port", str(port))
    line = error_line(p)
    assert f"--port {port}" in line and "already in use" in line, line
    # nothing was built or loaded: no [dsv4] line (the demo's build, the ready line)
    assert not [ln for ln in p.stderr.splitlines() if ln.startswith("[dsv4]")], p.stderr


def test_bench_takes_device_and_keeps_devices_as_an_alias():
    pytest.importorskip("torch")
    from dsv4.cli.bench import DTYPES, build_parser
    from dsv4.runtime.config import DTYPES as RUNTIME_DTYPES
    assert set(DTYPES) == set(RUNTIME_DTYPES)       # the choices --help shows without torch
    p = build_parser()
    for flag in ("--device", "--devices"):
        assert p.parse_args(["--preset", "tiny", flag, "cpu"]).device == "cpu"
    text = p.format_help()
    assert "--device " in text and "--devices" not in text     # the old spelling: not shown
