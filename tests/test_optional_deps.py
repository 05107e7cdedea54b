"""The CPU path needs none of the GPU-only packages: with `triton` made unimportable, `dsv4` and
`graphs` import, the CLI prints its help and a short eager decode runs."""
import json
import subprocess
import sys

from conftest import REPO
from helpers import small_checkpoint

# sys.modules[name] = None makes `import name` raise ImportError and find_spec(name) return None
BLOCK = "import sys; sys.modules['triton'] = None; sys.path.insert(0, {repo!r}); "


def _run(code: str, *args):
    return subprocess.run([sys.executable, "-c", BLOCK.format(repo=str(REPO)) + code, *args],
                          capture_output=True, text=True, timeout=300)


def test_imports_and_help_without_triton():
    p = _run("import importlib, pkgutil, dsv4, graphs\n"
             "for m in ('dsv4.cli.decode', 'dsv4.runtime.session', 'dsv4.runtime', 'dsv4.model', 'dsv4.backend',"
             " 'dsv4.bench', 'dsv4.kernels', 'graphs.decoder'):\n    importlib.import_module(m)\n"
             "from dsv4 import kernels; assert not kernels.triton_importable()\n"
             "from dsv4.cli.decode import main; sys.exit(main(['--help']))")
    assert p.returncode == 0, p.stderr
    assert "--ckpt" in p.stdout and "--prefill-chunk" in p.stdout


def test_cpu_decode_without_triton(tmp_path):
    ck = small_checkpoint(tmp_path, "fp8")
    p = _run("from dsv4.cli.decode import main; sys.exit(main(sys.argv[1:]))", "--ckpt", str(ck),
             "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["mode"] == "eager" and 1 <= len(out["output_ids"]) <= 3


def test_serve_without_its_packages_names_the_extra():
    p = subprocess.run([sys.executable, "-c", "import sys; sys.modules['fastapi'] = None; "
                        f"sys.path.insert(0, {str(REPO)!r}); from dsv4.cli.serve import main; "
                        "sys.exit(main(['--demo', '--device', 'cpu']))"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "fastapi" in line[0] and ".[serve]" in line[0], p.stderr
    help_ = subprocess.run([sys.executable, str(REPO / "scripts" / "serve.py"), "--help"],
                           capture_output=True, text=True, timeout=300)
    assert help_.returncode == 0, help_.stderr
    assert "--max-queue" in help_.stdout and "--prefill-graphs" in help_.stdout
