"""What ``pip install -e .`` brings and what ``import jaxmem`` loads.

Runtime dependencies are exactly the third-party packages ``jaxmem/`` imports; optional ones
(imported inside a function, behind an ImportError that names the extra) are in their extra.
The zoo, the examples and the tests bring their own (optax, chex, ...) through extras. JAX's
internals are imported by ``jaxmem/_jax/`` only (the jax range in pyproject.toml rests on it).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Imported by jaxmem only on request, with the extra that provides them.
OPTIONAL = {"matplotlib": "plot"}

#: Semi-private JAX: modules only ``jaxmem/_jax/`` may import.
JAX_INTERNALS = ("jax._src", "jaxlib")

#: JAX internals imported outside ``jaxmem/_jax/``: none (add none).
JAX_INTERNALS_OUTSIDE: set[str] = set()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    """Distribution names of requirement strings (``"jax>=0.10"`` -> ``"jax"``)."""
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def _third_party_imports(package: Path) -> dict[str, set[str]]:
    """Top-level module -> files of ``package`` importing it, standard library left out."""
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            for m in modules:
                top = m.partition(".")[0]
                if top not in sys.stdlib_module_names and top != package.name:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _internal_jax_imports(package: Path) -> dict[str, set[str]]:
    """``file:function`` (``file:<module>`` at module level) -> the JAX internals it imports
    (``jax._src.config`` for ``from jax._src import config``), for every file of ``package``
    outside ``package/_jax/``."""
    found: dict[str, set[str]] = {}

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            where = f"{where.partition(':')[0]}:{node.name}"
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            modules = [f"{node.module}.{a.name}" for a in node.names]
        else:
            modules = []
        for m in modules:
            if any(m == i or m.startswith(i + ".") for i in JAX_INTERNALS):
                found.setdefault(where, set()).add(m)
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    for path in package.rglob("*.py"):
        if (package / "_jax") not in path.parents:
            visit(ast.parse(path.read_text()), f"{path.relative_to(ROOT).as_posix()}:<module>")
    return found


def test_semi_private_jax_use_lives_in_jaxmem_jax():
    """Every semi-private JAX import is in jaxmem/_jax/, so a JAX upgrade is checked there."""
    outside = {where: mods - JAX_INTERNALS_OUTSIDE
               for where, mods in _internal_jax_imports(ROOT / "jaxmem").items()
               if mods - JAX_INTERNALS_OUTSIDE}
    assert outside == {}, f"import JAX internals through jaxmem._jax instead: {outside}"


def test_runtime_dependencies_are_what_jaxmem_imports():
    imported = _third_party_imports(ROOT / "jaxmem")
    declared = _names(_project()["dependencies"])
    required = set(imported) - set(OPTIONAL)
    assert required <= declared, f"imported, not declared: {sorted(required - declared)}"
    assert declared <= required, (
        f"declared, never imported by jaxmem/: {sorted(declared - required)}; move them to "
        "the extra of whatever uses them")


def test_optional_imports_are_in_their_extra():
    extras = _project()["optional-dependencies"]
    for module, extra in OPTIONAL.items():
        assert module in _names(extras[extra]), (module, extra)
        for path in _third_party_imports(ROOT / "jaxmem").get(module, ()):
            assert f"jaxmem[{extra}]" in (ROOT / path).read_text(), (
                f"{path} imports {module}: its ImportError should say pip install "
                f"'jaxmem[{extra}]'")


def test_import_jaxmem_loads_neither_flax_nor_optax():
    """flax loads with jaxmem.flax, on first use; optax and chex never (the zoo's, the tests')."""
    code = (
        "import sys, jaxmem\n"
        "heavy = lambda: sorted({m.partition('.')[0] for m in sys.modules} & "
        "{'flax', 'optax', 'chex', 'benchmarks'})\n"
        "print('after import jaxmem:', heavy())\n"
        "jaxmem.flax.linen.remat\n"
        "print('after jaxmem.flax:', heavy())\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "after import jaxmem: []" in r.stdout, r.stdout
    assert "after jaxmem.flax: ['flax'" in r.stdout, r.stdout  # (flax itself imports optax)
