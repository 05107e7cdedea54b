"""The direction of imports inside dsv4 (docs/ARCHITECTURE.md), read from the source: no circle
among the modules (every import counted, also those inside functions), kernels never import the
model, the runtime never imports the benchmarks, and the model's modules reach the kernels only
through dsv4.backend.ops and dsv4.backend. (graphs/ never importing dsv4: tests/graphs/.)"""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PKG = REPO / "dsv4"
# the model's layers: they call named ops (dsv4.backend.ops), never a kernel module
MODEL = {"dsv4.model.attention", "dsv4.model.block", "dsv4.model.compressor", "dsv4.model.indexer", "dsv4.model.linear",
         "dsv4.model.transformer", "dsv4.model.moe", "dsv4.model.mtp", "dsv4.runtime.speculative.verify", "dsv4.runtime.speculative.step",
         "dsv4.runtime.passes", "dsv4.runtime.prefill_graphs", "dsv4.runtime.session"}
# what kernel modules may import from the rest of dsv4: the numerics their references use
NUMERICS = {"dsv4.weights.formats", "dsv4.numerics.quant", "dsv4.numerics.rope", "dsv4.numerics.sparse", "dsv4.numerics.mhc", "dsv4.weights.presets",
            "dsv4.weights.config", "dsv4.errors", "dsv4.weights.dspark"}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports() -> dict[str, set[str]]:
    """module -> the dsv4 modules it imports (anywhere in its source)."""
    names = {module_name(p) for p in PKG.rglob("*.py")}
    out = {}
    for path in PKG.rglob("*.py"):
        mod = module_name(path)
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")
                    base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in names]
                targets = subs if len(subs) == len(node.names) else [base] + subs
            for t in targets:
                while t and t not in names:           # the module itself, not a name in it
                    t = t.rpartition(".")[0]
                if t and t.startswith("dsv4") and t != mod:
                    deps.add(t)
        out[mod] = deps
    return out


def test_no_import_circle():
    graph = imports()
    # a package __init__ importing its own submodules is not a circle of the code's layers
    edges = {m: {d for d in ds if not d.startswith(m + ".")} for m, ds in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2
    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernels_never_import_the_model():
    for mod, deps in imports().items():
        if mod.startswith("dsv4.kernels"):
            bad = {d for d in deps if not d.startswith("dsv4.kernels") and d not in NUMERICS}
            assert not bad, f"{mod} imports {sorted(bad)} (kernels see only the numerics)"


def test_runtime_never_imports_the_benchmarks():
    for mod, deps in imports().items():
        if not mod.startswith("dsv4.bench") and mod != "dsv4.cli.main":
            assert not {d for d in deps if d.startswith("dsv4.bench")}, mod


def test_the_model_reaches_kernels_through_ops():
    for mod, deps in imports().items():
        if mod in MODEL:
            bad = {d for d in deps if d.startswith("dsv4.kernels")}
            assert not bad, f"{mod} imports {sorted(bad)}; call dsv4.backend.ops instead"


def test_parallel_sits_between_the_model_and_the_kernels():
    """dsv4.parallel (the model imports it) reaches below only to the kernels and the errors."""
    graph = imports()
    assert any(m.startswith("dsv4.parallel") for m in graph)
    for mod, deps in graph.items():
        if mod.startswith("dsv4.parallel"):
            bad = {d for d in deps if not d.startswith(("dsv4.parallel", "dsv4.kernels"))
                   and d != "dsv4.errors"}
            assert not bad, f"{mod} imports {sorted(bad)} (parallel sees only kernels and errors)"
        elif mod.startswith(("dsv4.kernels", "dsv4.numerics", "dsv4.weights", "dsv4.text")):
            assert not {d for d in deps if d.startswith("dsv4.parallel")}, mod
    src = "\n".join(p.read_text() for p in (PKG / "parallel").glob("*.py"))
    assert "import graphs" not in src and "from graphs" not in src
