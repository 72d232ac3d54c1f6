"""Module paths of jaxmem 0.1 before the package was laid out by the data flow.

Until 0.1 every module sat in ``jaxmem/`` (``jaxmem.strategies``, ``jaxmem.rewrite``, ...).
They now live in the folder of their box (docs/architecture.md). Two kinds of old path keep
working:

- :data:`PUBLIC` — modules the top-level package exports (``jaxmem.measure``,
  ``jaxmem.targets``, ``jaxmem.policies``, ...): the same module under its public name, for
  good, no warning (``import jaxmem.measure`` and ``jaxmem.measure`` are
  :mod:`jaxmem.xla.measure`).
- :data:`DEPRECATED` — every other old path: importing it gives the module at its new path
  and a :class:`DeprecationWarning` naming that path. They go in the release after next.

The old name is an alias, not a copy: ``jaxmem.strategies is jaxmem.planning.strategies``,
so patching one patches the other, and plans pickled under the old class paths (plan caches
written by 0.1) load.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

#: Old public path -> where the module lives now (aliases, kept for good).
PUBLIC: dict[str, str] = {
    "jaxmem.measure": "jaxmem.xla.measure",
    "jaxmem.targets": "jaxmem.xla.targets",
    "jaxmem.primitives": "jaxmem.tracing.primitives",
    "jaxmem.program": "jaxmem.tracing.program",
    "jaxmem.policies": "jaxmem.rewriting.policies",
    "jaxmem.managed_memory": "jaxmem.memory.managed_memory",
    "jaxmem.plan_cache": "jaxmem.compiling.plan_cache",
}

#: Old internal path -> new path (aliases with a DeprecationWarning, removed after 0.2).
DEPRECATED: dict[str, str] = {
    "jaxmem.arguments": "jaxmem.tracing.arguments",
    "jaxmem.structure": "jaxmem.tracing.structure",
    "jaxmem.analysis": "jaxmem.analyzing.analysis",
    "jaxmem.liveness": "jaxmem.analyzing.liveness",
    "jaxmem.fusion": "jaxmem.analyzing.fusion",
    "jaxmem.schedule": "jaxmem.analyzing.schedule",
    "jaxmem.chains": "jaxmem.analyzing.chains",
    "jaxmem.costmodel": "jaxmem.analyzing.costmodel",
    "jaxmem.losses": "jaxmem.analyzing.losses",
    "jaxmem.tags": "jaxmem.analyzing.tags",
    "jaxmem.plan": "jaxmem.planning.plan",
    "jaxmem.strategies": "jaxmem.planning.strategies",
    "jaxmem.budget.scans": "jaxmem.compiling.scan_budget",
    "jaxmem.budget.search": "jaxmem.planning.budget.search",
    "jaxmem.budget.solvers": "jaxmem.planning.budget.solvers",
    "jaxmem.budget.units": "jaxmem.planning.budget.units",
    "jaxmem.budget.fallbacks": "jaxmem.planning.budget.fallbacks",
    "jaxmem.budget.pareto": "jaxmem.planning.budget.pareto",
    "jaxmem.budget": "jaxmem.planning.budget",
    "jaxmem.rewrite": "jaxmem.rewriting.rewrite",
    "jaxmem.remat": "jaxmem.rewriting.remat",
    "jaxmem.blockwise": "jaxmem.rewriting.blockwise",
    "jaxmem.substitutes": "jaxmem.rewriting.substitutes",
    "jaxmem.scans": "jaxmem.rewriting.scans",
    "jaxmem.state_offload": "jaxmem.memory.state_offload",
    "jaxmem.param_offload": "jaxmem.memory.param_offload",
    "jaxmem.chunked": "jaxmem.memory.chunked",
    "jaxmem.chunked_ce": "jaxmem.memory.chunked_ce",
    "jaxmem.quick_compile": "jaxmem.compiling.quick_compile",
    "jaxmem.multihost": "jaxmem.compiling.multihost",
    "jaxmem.shard_map": "jaxmem.compiling.shard_map",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str, warn: bool) -> None:
        self.target = target
        self.warn = warn

    def create_module(self, spec: Any) -> ModuleType:
        if self.warn:
            warnings.warn(f"{spec.name} moved to {self.target}; import it from there "
                          "(the old path goes in the release after next)",
                          DeprecationWarning, stacklevel=_caller_level())
        module = importlib.import_module(self.target)
        self._spec = module.__spec__  # the import system sets the alias's spec on it
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # already executed under its new name; keep its spec


def _caller_level() -> int:
    """The stack level of the first frame outside importlib (the user's import line)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                 or frame.f_code.co_filename == __file__):
        frame, level = frame.f_back, level + 1
    return level


class _Finder(importlib.abc.MetaPathFinder):
    """Resolves the old module paths of :data:`PUBLIC` and :data:`DEPRECATED`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in PUBLIC:
            return importlib.util.spec_from_loader(name, _Alias(PUBLIC[name], warn=False))
        if name in DEPRECATED:
            return importlib.util.spec_from_loader(name, _Alias(DEPRECATED[name], warn=True))
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once; ``import jaxmem`` does it)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
