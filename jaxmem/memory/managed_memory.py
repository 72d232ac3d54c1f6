"""Managed (CUDA Unified) memory for XLA's GPU client, and per-data-type memory advice.

This is the second seed paper's idea (Choi & Lee, Appl. Sci. 2021) in JAX. A model can be
bigger than the device memory when XLA's GPU client runs on CUDA Unified Memory: pages that
do not fit on the device stay in host memory and migrate on demand. Telling the driver how
each kind of data is used (``cudaMemAdvise``) can cut the paging cost further.

Two steps, in this order:

1. :func:`enable` before the first JAX operation. It sets the environment the XLA GPU
   client reads when it starts:

   - ``TF_FORCE_UNIFIED_MEMORY=1`` makes XLA's BFC memory pool managed memory;
   - ``XLA_CLIENT_MEM_FRACTION`` above 1 lets that pool exceed the device memory;
   - ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` grows the pool on demand.

   Outside Python, the same recipe is ``python -m jaxmem managed-memory
   --oversubscription 1.5 -- python train.py``, or ``eval "$(python -m jaxmem
   managed-memory --print-env)"``.
2. Optionally, :func:`advise` (or :func:`advise_train_state`). It applies ``cudaMemAdvise``
   to the buffers of arrays you hold, through the CUDA runtime that the jax CUDA plugin
   loaded.

On CPU, or where no CUDA runtime is found, :func:`enable` still sets the environment, so
the same script runs everywhere, and warns that it has no effect there. :func:`advise` does
nothing and warns once.

The mapping from data type to advice is **our inference**. The paper's abstract names the
three types (parameters, intermediate results, input data) and the advice kinds; which
advice goes with which type is not verified (see docs/managed_memory.md):

- ``"params"``: SetReadMostly. Every layer reads them every step; they are written once,
  by the update.
- ``"intermediates"``: SetPreferredLocation(device). They are made and consumed on the
  device.
- ``"inputs"``: SetAccessedBy(device) and SetAccessedBy(host). The host writes them and the
  device reads them.

The parts live in sibling modules, all re-exported here: the environment and its checks
in :mod:`~jaxmem.memory.managed_env`, the ctypes binding of the CUDA runtime in
:mod:`~jaxmem.memory.managed_cudart`, the data kinds' advice in
:mod:`~jaxmem.memory.managed_advice`, the status record in
:mod:`~jaxmem.memory.managed_status` and the errors in :mod:`~jaxmem.memory.managed_errors`.
This module holds what changes the process: :func:`enable`, :func:`advise`, the CUDA runtime
it loads once, and what was advised so far.

Example (runs anywhere; on CPU it only configures and warns):

>>> import warnings
>>> from jaxmem import managed_memory
>>> env = managed_memory.environment(oversubscription=1.5)
>>> env["TF_FORCE_UNIFIED_MEMORY"], env["XLA_CLIENT_MEM_FRACTION"]
('1', '1.5')
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

from jaxmem import _jax

# Every name this module had before it was split stays reachable here (``jaxmem.managed_memory.
# <name>``, ``jaxmem.memory.managed_memory.<name>``), the private ones included.
from jaxmem.memory.managed_advice import (  # noqa: F401
    _ADVICE_NAMES,
    KINDS,
    _gpu_buffers,
    _iter_arrays,
    _Plan,
    _resolve,
)
from jaxmem.memory.managed_cudart import (  # noqa: F401
    _CPU_DEVICE_ID,
    _LOCATION_TYPE,
    ENV_CUDART,
    Advice,
    CudaRuntime,
    _MemLocation,
    advise_signature,
    cudart_candidates,
    nvidia_wheel_cudarts,
)
from jaxmem.memory.managed_env import (  # noqa: F401
    ENV_ALLOCATOR,
    ENV_FRACTION,
    ENV_FRACTION_DEPRECATED,
    ENV_PREALLOCATE,
    ENV_UNIFIED,
    ENV_VARS,
    _fmt_fraction,
    _gpu_possible,
    _merged_environment,
    _parse_bool_tsl,
    _parse_fraction,
    _parse_preallocate,
    conflicts,
    environment,
    recipe,
)
from jaxmem.memory.managed_errors import CudaError, ManagedMemoryError, ManagedMemoryWarning
from jaxmem.memory.managed_status import ManagedMemoryStatus

__all__ = [
    "Advice",
    "CudaError",
    "CudaRuntime",
    "KINDS",
    "ManagedMemoryError",
    "ManagedMemoryStatus",
    "ManagedMemoryWarning",
    "advise",
    "advise_train_state",
    "conflicts",
    "cuda_runtime",
    "enable",
    "environment",
    "recipe",
    "status",
]

T = TypeVar("T")

#: Above this oversubscription :func:`enable` warns: paging cost grows with the ratio.
WARN_OVERSUBSCRIPTION = 2.0

_DOCS = "docs/managed_memory.md"


# --- enable / status ------------------------------------------------------------------------

_LOCK = threading.Lock()
_REQUESTED: dict[str, str] | None = None
_WARNED: set[str] = set()
_ADVISED: dict[str, int] = {}
_ADVISED_BYTES: dict[str, int] = {}
_APPLIED: set[tuple[Any, ...]] = set()


def _warn_once(key: str, message: str) -> None:
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, ManagedMemoryWarning, stacklevel=3)


def enable(
    oversubscription: float = 1.5, preallocate: bool = False, *, override: bool = False
) -> ManagedMemoryStatus:
    """Put XLA's GPU client on CUDA managed memory. Call before the first JAX operation.

    Sets ``TF_FORCE_UNIFIED_MEMORY=1``, ``XLA_CLIENT_MEM_FRACTION=<oversubscription>`` and
    ``XLA_PYTHON_CLIENT_PREALLOCATE`` in ``os.environ``. The XLA GPU client reads them
    once, when the backend starts: the first ``jax.devices()``, array creation or compiled
    call.

    Args:
      oversubscription: pool size as a multiple of device memory, >= 1 (see
        :func:`environment`). Keep it bounded: pages beyond the device live in host RAM, and
        the slowdown grows with the ratio. Above 2 this warns.
      preallocate: reserve the whole pool at start-up (default: grow on demand).
      override: replace conflicting settings already in the environment, with a warning
        naming each one. Without it, conflicts raise :class:`ManagedMemoryError`.

    Returns:
      :func:`status` after the change.

    Raises:
      ManagedMemoryError: a JAX backend already started in this process. The message gives
        the environment-variable and ``python -m jaxmem managed-memory`` recipes. The same
        error is raised for settings already in the environment that disagree (both memory
        fraction names; a fraction below 1; unified memory turned off; a non-BFC
        allocator). Calling ``enable`` again with settings already in force is fine.
      ValueError: ``oversubscription`` < 1.

    On CPU, or without a CUDA GPU or plugin, the variables are still set, so scripts run
    everywhere. A :class:`ManagedMemoryWarning` says the call has no effect there.

    >>> import warnings, jaxmem.managed_memory as mm
    >>> mm.environment(1.5)["XLA_CLIENT_MEM_FRACTION"]   # what enable(1.5) will set
    '1.5'
    """
    global _REQUESTED
    wanted = environment(oversubscription, preallocate)
    to_set, to_unset, problems = _merged_environment(wanted, _not_ours(os.environ), override)
    already = not problems and all(os.environ.get(k) == v for k, v in wanted.items())
    if _jax.default_backend_initialized():
        if already:  # e.g. launched through `python -m jaxmem managed-memory`
            with _LOCK:
                _REQUESTED = dict(wanted)
            return status()
        raise _started_error(oversubscription, preallocate)
    if problems and not override:
        raise ManagedMemoryError(
            "managed memory settings conflict with the environment; nothing was changed:\n  - "
            + "\n  - ".join(problems)
            + "\nFix the environment, or call enable(..., override=True) to replace these "
            "(each replacement is reported)."
        )
    if problems:
        warnings.warn(
            "jaxmem.managed_memory.enable(override=True) replaced: " + " | ".join(problems),
            ManagedMemoryWarning,
            stacklevel=2,
        )
    for k in to_unset:
        os.environ.pop(k, None)
    os.environ.update(to_set)
    with _LOCK:
        _REQUESTED = dict(wanted)
    _warn_if_ineffective(float(wanted[ENV_FRACTION]))
    return status()


def _not_ours(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the values an earlier :func:`enable` in this process set: those are
    ours to change, not conflicts."""
    base = dict(environ)
    for k, v in (_REQUESTED or {}).items():
        if base.get(k) == v:
            del base[k]
    return base


def _started_error(oversubscription: float, preallocate: bool) -> ManagedMemoryError:
    """The error :func:`enable` raises once a backend has started, with the recipe to use
    instead."""
    running = ", ".join(_jax.initialized_platforms()) or "a backend"
    return ManagedMemoryError(
        "jaxmem.managed_memory.enable() must be called before the first JAX operation: "
        "the XLA GPU client reads its memory settings once, when the backend starts, and "
        f"the {running} backend has already started in this process (something called "
        "jax.devices(), created an array or ran a jitted function). Nothing was changed.\n"
        + recipe(oversubscription, preallocate)
        + "\nIn a notebook, restart the kernel and run enable() in the first cell."
    )


def _warn_if_ineffective(ratio: float) -> None:
    """After :func:`enable` set the environment: warn (at its caller) when the ratio is large
    or when managed memory cannot apply in this process."""
    if ratio > WARN_OVERSUBSCRIPTION:
        warnings.warn(
            f"oversubscription={ratio} is large: everything beyond the device memory is paged "
            "from host RAM on demand, and managed memory can be many times slower than device "
            "memory (jax-ml/jax#11056). Keep it near 1.5, and make sure host RAM holds the "
            "excess.",
            ManagedMemoryWarning,
            stacklevel=3,
        )
    ok, why = _gpu_possible()
    if not ok:
        warnings.warn(
            f"jaxmem.managed_memory.enable(): the environment is set, but it has no effect "
            f"here: {why}. Managed memory applies only to XLA's CUDA GPU client; the same "
            "script will use it on a machine with an NVIDIA GPU.",
            ManagedMemoryWarning,
            stacklevel=3,
        )


def status() -> ManagedMemoryStatus:
    """Report what managed-memory settings are in force. Starts no backend.

    >>> from jaxmem import managed_memory
    >>> s = managed_memory.status()
    >>> s.in_force in (None, True, False)
    True
    """
    env = {k: os.environ.get(k) for k in ENV_VARS}
    unified = _parse_bool_tsl(env[ENV_UNIFIED] or "") is True
    options: dict[str, Any] | None
    note_bad = ""
    try:
        options = _jax.gpu_client_options_from_env()
    except ValueError as e:  # both fraction names, bad allocator, ...
        options, note_bad = None, f"the XLA GPU client would refuse this environment: {e}"
    fraction = None if options is None else options.get("memory_fraction")
    if fraction is None:
        raw = env[ENV_FRACTION] or env[ENV_FRACTION_DEPRECATED] or ""
        fraction = _parse_fraction(raw) if raw else None
    pre = None if options is None else options.get("preallocate")
    platforms = _jax.initialized_platforms()
    started = _jax.default_backend_initialized()
    gpu_running = any(p in ("cuda", "gpu") for p in platforms)
    in_force: bool | None
    if note_bad:
        in_force, note = (None if not started else False), note_bad
    elif not started:
        in_force = None
        ok, why = _gpu_possible()
        if not unified:
            note = f"{ENV_UNIFIED} is not set; call enable() before the first JAX operation"
        elif ok:
            note = "takes effect when the CUDA backend starts"
        else:
            note = f"set, but it will have no effect here: {why}"
    elif gpu_running and unified:
        in_force = True
        note = (
            f"XLA's GPU pool is managed memory, up to {fraction or 'the default fraction of'}"
            " x device memory (assuming these variables were set before the backend started)"
        )
    elif gpu_running:
        in_force, note = False, f"the CUDA backend runs without {ENV_UNIFIED}"
    else:
        in_force = False
        note = f"no CUDA backend ({', '.join(platforms)}): managed memory has no effect here"
    rt = _RUNTIME if isinstance(_RUNTIME, CudaRuntime) else None
    with _LOCK:
        advised, advised_bytes = dict(_ADVISED), dict(_ADVISED_BYTES)
        requested = _REQUESTED is not None
    return ManagedMemoryStatus(
        requested=requested,
        unified_memory=unified,
        memory_fraction=fraction,
        preallocate=pre,
        environment=env,
        client_options=options,
        backend_initialized=started,
        platforms=platforms,
        in_force=in_force,
        note=note,
        cuda_runtime=None if rt is None else f"{rt.path} (version {rt.version})",
        advised_buffers=advised,
        advised_bytes=advised_bytes,
    )


# --- the CUDA runtime, loaded once ----------------------------------------------------------

_RUNTIME: CudaRuntime | None | bool = False  # False: not looked up yet


def cuda_runtime() -> CudaRuntime | None:
    """The CUDA runtime :func:`advise` uses, or ``None`` if none loads. Cached.

    Prefers the ``libcudart`` the jax CUDA plugin already loaded into this process; set
    ``JAXMEM_CUDART`` to a path to choose one.
    """
    global _RUNTIME
    with _LOCK:
        if _RUNTIME is not False:
            return _RUNTIME  # type: ignore[return-value]
        rt = None
        for path in cudart_candidates():
            try:
                rt = CudaRuntime(path)
                break
            except (OSError, AttributeError):
                continue
        _RUNTIME = rt
        return rt


# --- advise ---------------------------------------------------------------------------------

def advise(tree: T, kind: str | Advice, *, location: str | None = None) -> T:
    """Apply ``cudaMemAdvise`` to every buffer of the arrays in ``tree``, shard by shard.

    Args:
      tree: a pytree; its ``jax.Array`` leaves are advised, other leaves ignored.
      kind: a data kind from the paper's scheme, ``"params"``, ``"intermediates"`` or
        ``"inputs"`` (see :data:`KINDS`). Or one advice: ``"read_mostly"``,
        ``"preferred_location"``, ``"accessed_by"``, ``"unset_read_mostly"``, ... or an
        :class:`Advice`.
      location: for a single advice, ``"device"`` (the shard's GPU; default) or ``"host"``.

    Returns:
      ``tree`` itself, so ``params = advise(params, "params")`` reads naturally.

    Advice is per page of managed memory: it only works when :func:`enable` ran before the
    backend started, and it stays on the pages after the array is freed (XLA's pool reuses
    them). Buffers already given the same advice are skipped, so calling this every step
    costs nothing while buffers stay put (donated train states do).

    Without a CUDA GPU, a CUDA runtime library or managed memory, this does nothing and
    warns once (:class:`ManagedMemoryWarning`).

    Raises:
      CudaError: the driver rejected the advice (the message says why).
      ValueError: an unknown kind, or a deleted (donated) array.

    >>> import jax.numpy as jnp, warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     params = advise({"w": jnp.ones((4, 4))}, "params")   # a no-op on CPU
    >>> params["w"].shape
    (4, 4)
    """
    label, plan = _resolve(kind, location)
    buffers, other_platforms = _gpu_buffers(tree, label)
    if not buffers:
        if other_platforms:
            _warn_once(
                "platform",
                f"jaxmem.managed_memory.advise() does nothing here: the arrays are on "
                f"{', '.join(sorted(other_platforms))}, not on a CUDA GPU; memory advice only "
                f"applies to CUDA managed memory. This warning is shown once (see {_DOCS}).",
            )
        return tree
    if _parse_bool_tsl(os.environ.get(ENV_UNIFIED, "")) is not True:
        _warn_once(
            "unified",
            "jaxmem.managed_memory.advise() does nothing: XLA's GPU memory is not managed "
            f"memory ({ENV_UNIFIED} is not set). Call jaxmem.managed_memory.enable() before "
            "the first JAX operation, or launch with `python -m jaxmem managed-memory -- ...`. "
            "This warning is shown once.",
        )
        return tree
    rt = cuda_runtime()
    if rt is None:
        _warn_once(
            "runtime",
            "jaxmem.managed_memory.advise() does nothing: no CUDA runtime library (libcudart) "
            f"could be loaded. Set {ENV_CUDART}=/path/to/libcudart.so. This warning is shown "
            "once.",
        )
        return tree
    done, done_bytes = _apply(rt, buffers, plan)
    if done:
        with _LOCK:
            _ADVISED[label] = _ADVISED.get(label, 0) + done
            _ADVISED_BYTES[label] = _ADVISED_BYTES.get(label, 0) + done_bytes
    return tree


def _apply(rt: CudaRuntime, buffers: list[tuple[Any, int, int]], plan: _Plan) -> tuple[int, int]:
    """Give every buffer the advice of ``plan`` it does not have yet, once per device and
    pointer; ``(buffers advised, their bytes)``."""
    seen: set[tuple[int, int]] = set()
    done, done_bytes = 0, 0
    for device, ptr, nbytes in buffers:
        hw = getattr(device, "local_hardware_id", None)
        ordinal = int(device.id if hw is None else hw)
        if (ordinal, ptr) in seen:
            continue
        seen.add((ordinal, ptr))
        fresh = False
        for advice, loc in plan:
            key = (ordinal, ptr, nbytes, int(advice), loc)
            if key in _APPLIED:
                continue
            rt.mem_advise(ptr, nbytes, advice, loc, ordinal)
            with _LOCK:
                _APPLIED.add(key)
            fresh = True
        if fresh:
            done, done_bytes = done + 1, done_bytes + nbytes
    return done, done_bytes


def advise_train_state(params: Any, batch: Any, *, opt_state: Any = None) -> None:
    """The paper's three-type scheme on a train step's arguments (our mapping, see module doc).

    ``params`` get ``"params"`` (read-mostly) and ``batch`` gets ``"inputs"`` (accessed by
    device and host). ``opt_state``, if given, gets ``"intermediates"`` (preferred on the
    device), because it is read and written on the device every step. XLA's own
    temporaries have no Python handle and keep the default managed-memory behaviour.

    Recipe (``jaxmem.optimize`` composes with it; nothing else changes)::

        from jaxmem.memory import managed_memory
        managed_memory.enable(oversubscription=1.5)      # first, before any JAX operation
        ...
        step = jax.jit(train_step, donate_argnums=(0, 1))
        for batch in data:
            managed_memory.advise_train_state(params, batch, opt_state=opt_state)
            params, opt_state, loss = step(params, opt_state, batch)

    With donation the buffers stay put, so after the first step each call only advises
    the new batch.

    >>> import jax.numpy as jnp, warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     advise_train_state({"w": jnp.ones(3)}, jnp.ones((2, 3)))   # no-op on CPU
    """
    advise(params, "params")
    advise(batch, "inputs")
    if opt_state is not None:
        advise(opt_state, "intermediates")
