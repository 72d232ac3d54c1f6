"""Compiles that are only read: the candidates a plan is chosen from.

Part of the last box (:mod:`jaxmem.optimized`). ``verify`` compiles the plain step and each
candidate plan, reads their figures and throws every executable away but the winner's. XLA
fixes the figures before the backend makes machine code: buffer assignment (every
``memory_analysis()`` field) and ``cost_analysis()`` both read the optimised HLO. On CPU
the machine code is most of a compile (LLVM), so these compiles run LLVM at its lowest
level (:data:`QUICK_OPTIONS`): the same HLO passes, the same buffers, the same figures, for
about 0.6x the compile time; the winner alone is then compiled again in full to run
(:func:`finish`). ``tests/test_quick_compile.py`` checks the figures are identical.

``JAXMEM_QUICK_COMPILE=0`` compiles every candidate in full (and runs the winner's).
Platforms without an entry in :data:`QUICK_OPTIONS` always do: on XLA:GPU without the device
the backend level did not shorten the compile (docs/plan_cache.md).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from jaxmem.xla import measure

log = logging.getLogger("jaxmem")

#: Per platform, compiler options that change only the machine code, not the figures.
QUICK_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True},
}


def options(platform: str) -> dict[str, Any]:
    """The figures-only options for ``platform`` (empty: compile in full)."""
    if os.environ.get("JAXMEM_QUICK_COMPILE", "1") == "0":
        return {}
    return dict(QUICK_OPTIONS.get(platform, {}))


def is_quick(lowered: Any) -> bool:
    """Whether :func:`compile` of ``lowered`` makes a figures-only executable."""
    return bool(options(measure._platform_of(lowered)))  # noqa: SLF001


def compile(lowered: Any) -> Any:  # noqa: A001
    """:func:`jaxmem.measure.compile` with the figures-only options of ``lowered``'s
    platform: read its figures, do not run it (unless :func:`is_quick` is false)."""
    return measure.compile(lowered, options(measure._platform_of(lowered)) or None)  # noqa: SLF001


def finish(lowered: Any, quick_exe: Any) -> Any:
    """The executable to run for the winning ``lowered``: ``quick_exe`` itself when it was
    compiled in full, else a full compile (whose figures the caller reads)."""
    return measure.compile(lowered) if is_quick(lowered) else quick_exe


def checked(quick: Any, full: Any) -> Any:
    """The full compile's figures ``full``; a warning (logger ``"jaxmem"``) where they differ
    from the figures-only compile's ``quick`` that the choice was made on."""
    if (quick.peak, quick.flops) != (full.peak, full.flops):
        log.warning("jaxmem: the figures-only compile gave peak %d, flops %g; the full "
                    "compile gives %d, %g (JAXMEM_QUICK_COMPILE=0 chooses on full compiles)",
                    quick.peak, quick.flops, full.peak, full.flops)
    return full


def threads(n: int | None = None) -> int:
    """The compile threads for ``n`` programs (None: as many as there are CPUs):
    ``JAXMEM_COMPILE_THREADS`` where set (1: one after another), else the CPUs, at most
    ``n``."""
    cpus = os.cpu_count() or 1
    return int(os.environ.get("JAXMEM_COMPILE_THREADS", 0)) or min(n or cpus, cpus)


def compile_all(lowerings: Sequence[Callable[[], Any]],
                compile_fn: Callable[[Any], Any] = compile) -> tuple[list[Any], list[Any]]:
    """Lower each thunk and compile it with ``compile_fn``, in threads; returns the lowered
    programs and their executables, in order.

    Lowering holds the GIL and XLA's compile does not, so each program is handed to the pool
    as soon as it is lowered: the next one lowers while the last compiles.
    ``JAXMEM_COMPILE_THREADS`` caps the threads (1: one after another)."""
    workers = threads(len(lowerings))
    if workers <= 1 or len(lowerings) <= 1:
        lowered = [f() for f in lowerings]
        return lowered, [compile_fn(x) for x in lowered]
    lowered, futures = [], []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for f in lowerings:
            lowered.append(f())
            futures.append(pool.submit(compile_fn, lowered[-1]))
        return lowered, [fut.result() for fut in futures]
