"""The plan cache: a plan made once is reused by the next process, host or ``optimize``.

Part of the last box (:mod:`jaxmem.optimized`). Planning a step compiles it several times
(the auto strategy's candidates and the plain step under ``verify``; the budget search's
steps): on a large model that is minutes, paid again on every restart and every host. The
plan itself is small and depends only on the traced program, the target it was compiled
for, jaxmem's code and the options, so it is cached under a fingerprint of those:

- in memory, always (a second ``optimize`` of the same step in one process);
- on disk where the user allows it, like JAX's persistent compilation cache: the
  ``JAXMEM_PLAN_CACHE_DIR`` environment variable, or :func:`set_dir`.

A hit skips every planning compile: the step compiles once, for the cached plan.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxmem.planning.plan import Plan

log = logging.getLogger("jaxmem")

_MEMORY: dict[str, Any] = {}
_DIR: str | None = None
_CODE_DIGEST: str | None = None


def set_dir(path: str | os.PathLike[str] | None) -> None:
    """Keep plans on disk under ``path`` (``None``: in memory only, unless
    ``JAXMEM_PLAN_CACHE_DIR`` is set). Like ``jax_compilation_cache_dir``, the directory may
    be shared by processes and hosts; entries are written atomically.

    Example:
      >>> import jaxmem.plan_cache
      >>> jaxmem.plan_cache.set_dir("/tmp/jaxmem-plans")  # doctest: +SKIP
    """
    global _DIR
    _DIR = None if path is None else os.fspath(path)


def directory() -> Path | None:
    """The on-disk cache directory in use, or None."""
    d = _DIR if _DIR is not None else os.environ.get("JAXMEM_PLAN_CACHE_DIR")
    return Path(d) if d else None


def clear_memory() -> None:
    """Forget the plans cached in this process (the disk cache is left alone)."""
    _MEMORY.clear()


def _code_digest() -> str:
    """A digest of jaxmem's source (its ``__init__``, and with it the version, included): a
    plan made by other code is stale."""
    global _CODE_DIGEST
    if _CODE_DIGEST is None:
        h = hashlib.sha256()
        root = Path(__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
        _CODE_DIGEST = h.hexdigest()
    return _CODE_DIGEST


def fingerprint(jaxpr: Any, target: Any, options: Any) -> str:
    """The cache key: the traced program's text, the target (platform, device kind), the
    JAX and jaxmem versions and code, the options that change the plan, and the primitive
    classification (:func:`jaxmem.primitives.register`)."""
    from jaxmem.tracing import primitives  # its tables can be extended at run time (register)

    tables = tuple(sorted(t) for t in (primitives.HEAVY, primitives.UTILITY, primitives.FREE))
    h = hashlib.sha256()
    for part in (str(jaxpr), repr(target), jax.__version__, _code_digest(), repr(options),
                 repr(tables)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def load(key: str, kind: type = Plan) -> Any:
    """The plan cached under ``key``, from memory or disk, or None. ``kind``: the type of
    what is cached there (a scan-body choice is cached beside the plans, as
    :class:`~jaxmem.compiling.scan_budget.BodyChoice`); an entry of another type is a miss."""
    plan = _MEMORY.get(key)
    if plan is not None and not isinstance(plan, kind):
        return None
    d = directory()
    if plan is None and d is not None and (d / f"{key}.plan").is_file():
        try:
            plan = pickle.loads((d / f"{key}.plan").read_bytes())
        except Exception as e:  # noqa: BLE001 - a damaged entry is a miss, not an error
            log.warning("jaxmem: ignoring unreadable plan cache entry %s: %s", key, e)
            return None
        if not isinstance(plan, kind):
            return None
        log.info("jaxmem: plan %s... read from the plan cache in %s", key[:12], d)
        _MEMORY[key] = plan
    return plan


def store(key: str, plan: Any) -> None:
    """Cache ``plan`` (a :class:`~jaxmem.planning.plan.Plan`, or what :func:`load` is asked
    for by ``kind``) under ``key``: in memory, and on disk when a directory is set."""
    _MEMORY[key] = plan
    d = directory()
    if d is None:
        return
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(plan, f)
        os.replace(tmp, d / f"{key}.plan")
    except OSError as e:  # a read-only or full disk loses the cache, not the step
        log.warning("jaxmem: could not write the plan cache entry to %s: %s", d, e)


def compile_all(lowered: list[Any]) -> list[Any]:
    """:func:`jaxmem.measure.compile` of each lowered program, in threads (XLA compiles
    without the GIL): a cold plan costs about its slowest compile, not their sum, where
    there are cores to spare. ``JAXMEM_COMPILE_THREADS=1`` compiles one after another."""
    from jaxmem.xla import measure

    workers = int(os.environ.get("JAXMEM_COMPILE_THREADS", 0)) or min(len(lowered),
                                                                      os.cpu_count() or 1)
    if workers <= 1 or len(lowered) <= 1:
        return [measure.compile(x) for x in lowered]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(measure.compile, lowered))


def progress(compile_fn: Callable[..., Any], what: str,
             after_s: float = 3.0) -> Callable[..., Any]:
    """``compile_fn``, logging (logger ``"jaxmem"``, INFO) each compile once the search it
    belongs to has run longer than ``after_s`` seconds."""
    start = time.perf_counter()
    count = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        out = compile_fn(*args, **kwargs)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed > after_s:
            peak = getattr(out, "peak", None)
            log.info("jaxmem: %s: compile %d done after %.1f s%s", what, count, elapsed,
                     f" (peak {peak / 2**20:.2f} MiB)" if peak is not None else "")
        return out
    return run
