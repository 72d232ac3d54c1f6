"""Compile options for tests that check values, not speed or memory: XLA:CPU at -O0 without
its fusion emitters takes about a third of the time, and every program a test compares is
compiled the same way."""

from __future__ import annotations

import os
from typing import Any

from jaxmem import measure

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def fast_compile(lowered: Any) -> Any:
    """``measure.compile`` with :data:`FAST_COMPILE` (-O0 alone on an XLA without the emitter
    option)."""
    return _fast(measure.compile, lowered)


def _fast(compile_fn: Any, lowered: Any, options: dict[str, Any] | None = None) -> Any:
    """``compile_fn(lowered, options)`` with :data:`FAST_COMPILE` added (-O0 alone on an
    XLA without the emitter option)."""
    try:
        return compile_fn(lowered, {**FAST_COMPILE, **(options or {})})
    except Exception as e:
        if "xla_cpu_use_fusion_emitters" not in str(e):
            raise
        return compile_fn(lowered, {"xla_backend_optimization_level": 0, **(options or {})})


def xla_flags(*extra: str) -> str:
    """``XLA_FLAGS`` for a subprocess: this process's (conftest.py's -O0) and ``extra``."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()


def fast_run(fn: Any, *args: Any, **jit_kwargs: Any) -> Any:
    """``jax.jit(fn, **jit_kwargs)(*args)``, compiled with :data:`FAST_COMPILE`: for values
    compared with another program the test compiles the same way (both sides of a
    comparison, never one side against a step ``jaxmem.optimize`` compiled)."""
    import jax

    return fast_compile(jax.jit(fn, **jit_kwargs).lower(*args))(*args)


def fast_jaxmem_compiles(monkeypatch: Any) -> None:
    """jaxmem's own compiles (``jaxmem.measure.compile``) with :data:`FAST_COMPILE` too, for
    the rest of a test: for one that reads only the values of what ``jaxmem.optimize(...,
    verify=False)`` runs (no figures) and compares them with programs it compiles with
    :func:`fast_compile` or :func:`fast_run`, so that both sides are compiled the same way.
    jaxmem plans and rewrites as ever; only XLA:CPU's machine code is made faster."""
    real = measure.compile
    monkeypatch.setattr(measure, "compile",
                        lambda lowered, options=None: _fast(real, lowered, options))
