"""The layers of dsv4, read from the folders and the imports themselves and held against the table in
docs/ARCHITECTURE.md ("The layers"): every module belongs to exactly one row, a module imports only
from its own package or from the rows below it (every import counted, also those inside
functions), no import circle anywhere, each package says what it owns, and the model's math never
asks the backend which implementation to run. (graphs/ never importing dsv4: tests/graphs/.)"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PKG = REPO / "dsv4"
ARCH = REPO / "docs" / "ARCHITECTURE.md"


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


def layer_table() -> list[tuple[str, list[str]]]:
    """The rows of ARCHITECTURE.md's layer table, top to bottom: (layer, [packages])."""
    text = ARCH.read_text()
    section = text[text.index("## The layers"):]
    section = section[:section.index("\n## ", 4)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].startswith("`dsv4"):
            rows.append((cells[0], re.findall(r"`(dsv4[\w.]*)`", cells[1])))
    assert rows, "no layer table found under '## The layers' in docs/ARCHITECTURE.md"
    return rows


def row_of(mod: str, rows) -> int:
    """The index of the row whose package is mod or holds it (the longest match)."""
    best, depth = None, -1
    for i, (_, pkgs) in enumerate(rows):
        for p in pkgs:
            if (mod == p or mod.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    return best


def test_every_module_is_in_one_layer():
    rows = layer_table()
    listed = [p for _, pkgs in rows for p in pkgs]
    assert len(listed) == len(set(listed)), f"a package in two rows: {listed}"
    mods = imports()
    for p in listed:
        assert p in mods, f"ARCHITECTURE.md lists {p}, which does not exist"
    lost = sorted(m for m in mods if m != "dsv4" and row_of(m, rows) is None)
    assert not lost, f"modules in no layer of ARCHITECTURE.md: {lost}"


def test_imports_point_down_the_layers():
    rows = layer_table()
    bad = []
    for mod, deps in imports().items():
        if mod == "dsv4":                     # the public names, imported on first use
            continue
        here = row_of(mod, rows)
        for d in deps:
            there = row_of(d, rows)
            if d != "dsv4" and there < here:
                bad.append(f"{mod} ({rows[here][0]}) imports {d} ({rows[there][0]})")
    assert not bad, "imports up the layers:\n" + "\n".join(sorted(bad))


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


def test_each_package_says_what_it_owns():
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(REPO)}: no docstring saying what it owns"


def test_the_model_never_asks_the_backend():
    """The model's modules read no backend decision and hold no ops: each sublayer calls what it
    was bound to (dsv4/backend/binding.py)."""
    for path in (PKG / "model").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = {getattr(node, "attr", None), getattr(node, "id", None)}
            assert not names & {"backend", "ops", "Ops"}, \
                f"{path.relative_to(REPO)}:{node.lineno}: reads {names & {'backend', 'ops'}}"
        assert not re.search(r"\bbackend\.", re.sub(r'""".*?"""|#.*', "", path.read_text(),
                                                     flags=re.S)), path
