"""The package's layout (issues 18 and 39): folders that are the data flow, imports that run
one way between them (the order docs/architecture.md states), no import cycles (module level
or inside functions), and no module, class or function past its size limit."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "jaxmem"
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"

#: Size limits (issue 39): lines of a module, lines of a class, lines of code of a function
#: (its docstring, comments and blank lines not counted).
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 250, 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> jaxmem modules it imports, at module level or inside functions."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def layers() -> dict[str, int]:
    """Folder or top-level module -> its layer, as docs/architecture.md's layer table states
    (rows ``| 3 | `jaxmem.analyzing` | ...``)."""
    found = re.findall(r"^\| (\d+) \| `(jaxmem[\w.]*)` \|", ARCHITECTURE.read_text(), re.M)
    return {name: int(layer) for layer, name in found}


def _layer_of(module: str, table: dict[str, int]) -> int:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in table:
            return table[".".join(parts[:i])]
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def test_every_module_is_in_a_layer():
    table = layers()
    assert len(table) >= 8, "docs/architecture.md's layer table was not found"
    for m in _modules():
        _layer_of(m, table)


def test_imports_run_one_way_between_layers():
    """A module imports only modules of its own layer or of layers below it."""
    table = layers()
    upward = [(m, t) for m, targets in import_graph().items() for t in targets
              if _layer_of(t, table) > _layer_of(m, table)]
    assert upward == []


def _code_lines(lines: list[str], node: ast.AST) -> int:
    body = node.body
    doc = None
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        doc = (body[0].lineno, body[0].end_lineno)
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if not (doc and doc[0] <= i <= doc[1])
               and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def oversized() -> list[str]:
    out = []
    for name, path in _modules().items():
        src = path.read_text()
        lines = src.splitlines()
        if len(lines) > MAX_MODULE:
            out.append(f"module {name}: {len(lines)} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS:
                    out.append(f"class {name}.{node.name}: {n} lines")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = _code_lines(lines, node)
                if n > MAX_FUNCTION:
                    out.append(f"function {name}.{node.name}: {n} lines of code")
    return out


def test_sizes():
    assert oversized() == []


def test_old_module_paths():
    """The 0.1 module paths: public ones are the moved module with no warning, internal ones
    the moved module with a DeprecationWarning (in a fresh interpreter: nothing imported)."""
    code = """
import importlib, warnings
warnings.simplefilter("error")
import jaxmem
from jaxmem import _compat
for old, new in _compat.PUBLIC.items():
    assert importlib.import_module(old) is importlib.import_module(new), old
for old, new in _compat.DEPRECATED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new), old
    assert mod.__spec__.name == new, old
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
               for w in caught) or old in {"jaxmem.budget"} and caught == [], (old, caught)
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)


def test_architecture_page_matches_the_tree():
    """Every record docs/architecture.md names (``folder.module.Name``) exists there, and
    every package file it names (``planning/candidates.py``) is in jaxmem/."""
    import importlib

    text = ARCHITECTURE.read_text()
    records = set(re.findall(r"`((?:[a-z_]+\.)+[A-Z]\w*)`", text))
    assert len(records) >= 8
    for dotted in records:
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(f"jaxmem.{module}"), name), dotted
    files = set(re.findall(r"`([a-z_]+/[a-z_/]+\.py)(?::\w+)?`", text))
    assert files
    for f in files:
        assert (ROOT / f).exists() or (ROOT.parent / f).exists(), f
