"""Structure: graphs/ is model-agnostic (never imports dsv4) and follows the house module rules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "graphs"
FILES = sorted(PKG.glob("*.py"))


def imported_modules(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
            mods |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return mods


def test_package_has_the_documented_modules():
    names = {p.name for p in FILES}
    assert {"__init__.py", "buffers.py", "placement.py", "capture.py", "decoder.py",
            "errors.py"} <= names


MODEL_PACKAGES = ("dsv4", "transformers", "examples")   # the models graphs/ is embedded by


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_never_imports_dsv4(path):
    bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in MODEL_PACKAGES)
    assert not bad, f"{path.name} imports {bad}; graphs/ must stay model-agnostic"
    assert "dsv4" not in {n.id for n in ast.walk(ast.parse(path.read_text()))
                          if isinstance(n, ast.Name)}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_module_docstring_size_and_no_torch_cuda_nvtx(path):
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.strip().splitlines()) <= 3, f"{path.name}: 1-3 line module docstring"
    assert len(path.read_text().splitlines()) < 450, f"{path.name} is too long"
    assert "torch.cuda.nvtx" not in path.read_text()  # raises on CPU-only torch builds


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_module_level_mutable_state(path):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                name = getattr(t, "id", "")
                assert name.isupper() or name.startswith("_") or name == "__all__", \
                    f"{path.name}: module-level {name!r} (only UPPER_CASE constants allowed)"
                assert not isinstance(node.value, (ast.Dict, ast.List, ast.Set)) \
                    or name == "__all__", f"{path.name}: mutable module-level {name!r}"


def test_graphs_import_does_not_pull_dsv4():
    import subprocess
    import sys
    code = ("import sys, graphs; assert not {m.split('.')[0] for m in sys.modules} & "
            f"{set(MODEL_PACKAGES)!r}")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PKG.parent)
