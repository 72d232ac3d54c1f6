"""A STEP string resolved to a train step and its arguments (command line, :mod:`jaxmem.cli`).

:func:`load_target` reads ``zoo:<name>[:size]`` (the repository's model zoo,
``benchmarks/zoo``), ``pkg.module:make_step`` and ``path/to/file.py:make_step``; a STEP that
cannot be loaded raises :class:`TargetError`, whose message the commands print (exit code 2).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

TARGET_HELP = (
    "the train step: zoo:<name>[:test|bench], pkg.module:make_step or file.py:make_step "
    "(make_step() returns (step, args) or an object with .step and .args)"
)


class TargetError(ValueError):
    """A TARGET that cannot be loaded; its message says why (printed, exit code 2)."""


def _step_and_args(obj: Any, where: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if hasattr(obj, "step") and hasattr(obj, "args"):
        return obj.step, tuple(obj.args)
    if isinstance(obj, tuple | list) and len(obj) == 2 and callable(obj[0]):
        return obj[0], tuple(obj[1])
    raise TargetError(
        f"{where} gave {type(obj).__name__}; expected (step, args) or an object with .step "
        "and .args (a benchmarks.zoo.Workload, say)"
    )


def load_target(spec: str, batch: int | None = None, *, abstract: bool = False
                ) -> tuple[Callable[..., Any], tuple, str]:
    """Resolve a STEP string to ``(step, args, label)``.

    ``abstract``: build zoo models with ``jax.ShapeDtypeStruct`` state (for compile-only
    targets; realistic sizes then cost no memory).

    ``zoo:<name>[:size]`` builds ``benchmarks.zoo.make`` (``batch`` overrides its batch):
    the zoo ships with the repository's ``benchmarks/``, not with the installed library, so
    these targets work from a checkout. ``module:attr`` / ``file.py:attr`` imports ``attr``
    and, if it is not already a ``(step, args)`` pair or a Workload-like object, calls it
    with no arguments (or with ``batch=`` when given). The current directory is importable,
    as with ``python -m``.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if spec.startswith("zoo:"):
        zoo = _zoo(spec)
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[1]:
            raise TargetError(f"{spec!r}: expected zoo:<name>[:size]")
        name, size = parts[1], parts[2] if len(parts) == 3 else "test"
        if name not in zoo.names():
            raise TargetError(f"{spec!r}: unknown zoo model {name!r}; choose from {zoo.names()}")
        try:
            zoo.config(name, size)
        except ValueError as e:
            raise TargetError(f"{spec!r}: {e}") from e
        w = zoo.make(name, size=size, batch=batch, abstract=abstract)
        return w.step, tuple(w.args), f"zoo {name} ({size}, batch {w.batch_size})"
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise TargetError(f"{spec!r}: expected pkg.module:make_step, file.py:make_step or "
                          "zoo:<name>[:size]")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise TargetError(f"{spec!r}: no file {mod_name!r}")
            name = "_jaxmem_target_" + os.path.splitext(os.path.basename(mod_name))[0]
            file_spec = importlib.util.spec_from_file_location(name, mod_name)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise TargetError(f"{spec!r}: cannot import {mod_name!r}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise TargetError(f"{spec!r}: {mod_name!r} has no attribute {attr!r}")
    if not (hasattr(obj, "step") and hasattr(obj, "args")) and not isinstance(obj, tuple):
        if not callable(obj):
            raise TargetError(f"{spec!r}: {attr!r} is neither callable nor (step, args)")
        obj = obj(batch=batch) if batch is not None else obj()
    step, args = _step_and_args(obj, spec)
    return step, args, spec


def _zoo(spec: str) -> Any:
    """``benchmarks.zoo``, or a :class:`TargetError` saying where the zoo lives."""
    try:
        return importlib.import_module("benchmarks.zoo")
    except ModuleNotFoundError as e:
        # "The zoo is not here" and "a package the zoo needs is missing" are ours to explain;
        # anything else failing inside the zoo is a bug and keeps its traceback.
        if e.name in ("benchmarks", "benchmarks.zoo"):
            raise TargetError(
                f"{spec!r}: zoo targets need the model zoo, benchmarks/zoo, which ships with "
                "the jaxmem repository, not with the installed package: run from a checkout "
                "of the repository (its root as the current directory), or name your own "
                "step as pkg.module:make_step or file.py:make_step"
            ) from e
        if e.name and e.name.partition(".")[0] not in ("benchmarks", "jaxmem"):
            raise TargetError(
                f"{spec!r}: the model zoo needs {e.name!r}, which is not installed: "
                "pip install -e '.[test]' from the repository root"
            ) from e
        raise
