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

Example (runs anywhere; on CPU it only configures and warns):

>>> import warnings
>>> from jaxmem import managed_memory
>>> env = managed_memory.environment(oversubscription=1.5)
>>> env["TF_FORCE_UNIFIED_MEMORY"], env["XLA_CLIENT_MEM_FRACTION"]
('1', '1.5')
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import enum
import glob
import importlib.util
import math
import os
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import jax

from jaxmem import _jax

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

ENV_UNIFIED = "TF_FORCE_UNIFIED_MEMORY"
ENV_FRACTION = "XLA_CLIENT_MEM_FRACTION"
ENV_FRACTION_DEPRECATED = "XLA_PYTHON_CLIENT_MEM_FRACTION"
ENV_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ENV_ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
ENV_CUDART = "JAXMEM_CUDART"
"""Set to a ``libcudart.so`` path to choose the CUDA runtime :func:`advise` uses."""

#: Every variable :func:`status` reports.
ENV_VARS = (ENV_UNIFIED, ENV_FRACTION, ENV_FRACTION_DEPRECATED, ENV_PREALLOCATE, ENV_ALLOCATOR)

#: Above this oversubscription :func:`enable` warns: paging cost grows with the ratio.
WARN_OVERSUBSCRIPTION = 2.0

_DOCS = "docs/managed_memory.md"


class ManagedMemoryError(RuntimeError):
    """Managed memory cannot be set up as asked. The message says what to do instead."""


class CudaError(ManagedMemoryError):
    """A CUDA runtime call failed. ``.code`` is the ``cudaError_t`` value."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class ManagedMemoryWarning(UserWarning):
    """Managed memory or memory advice has no effect here (CPU, no CUDA runtime, ...)."""


# --- environment ----------------------------------------------------------------------------

def _fmt_fraction(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() else f"{float(x):.1f}"


def environment(oversubscription: float = 1.5, preallocate: bool = False) -> dict[str, str]:
    """The environment variables that put XLA's GPU client on managed memory.

    Pure: reads and changes nothing. :func:`enable` sets these in ``os.environ``;
    ``python -m jaxmem managed-memory --print-env`` prints them as ``export`` lines.

    Args:
      oversubscription: pool size as a multiple of device memory, at least 1. XLA sizes the
        managed pool as ``device_memory * max(1, fraction)``, so 1.0 means managed memory
        without oversubscription and 1.5 lets the program use 50% more than the device has.
      preallocate: reserve the whole pool when the backend starts (``False``: grow on
        demand, the usual choice with managed memory).

    Returns:
      ``{"TF_FORCE_UNIFIED_MEMORY": "1", "XLA_CLIENT_MEM_FRACTION": ...,
      "XLA_PYTHON_CLIENT_PREALLOCATE": "false"|"true"}``. The deprecated
      ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is never set; XLA refuses both names together.

    >>> environment(2)
    {'TF_FORCE_UNIFIED_MEMORY': '1', 'XLA_CLIENT_MEM_FRACTION': '2.0', 'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}
    """  # noqa: E501
    try:
        ratio = float(oversubscription)
    except (TypeError, ValueError):
        raise TypeError(
            f"oversubscription must be a number >= 1 (e.g. 1.5), got {oversubscription!r}"
        ) from None
    if not math.isfinite(ratio) or ratio < 1.0:
        raise ValueError(
            f"oversubscription must be a finite number >= 1, got {oversubscription!r}. "
            "With managed memory XLA sizes its pool as device_memory * max(1, fraction): 1.0 "
            "is managed memory without oversubscription, 1.5 is 50% more than the device "
            "has. To cap memory below the device size, do not use managed memory; set "
            f"{ENV_FRACTION} alone."
        )
    return {
        ENV_UNIFIED: "1",
        ENV_FRACTION: _fmt_fraction(ratio),
        ENV_PREALLOCATE: "true" if preallocate else "false",
    }


def _parse_bool_tsl(value: str) -> bool | None:
    """``tsl::ReadBoolFromEnvVar``: "true"/"1" and "false"/"0", case-insensitive."""
    v = value.strip().lower()
    if v in ("1", "true"):
        return True
    if v in ("0", "false"):
        return False
    return None


def _parse_preallocate(value: str) -> bool | None:
    """jaxlib's reading: empty means "not set", ``false``/``False``/``0`` mean off."""
    if value == "":
        return None
    return value not in ("false", "False", "0")


def _parse_fraction(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def conflicts(
    wanted: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """Settings already in ``environ`` that disagree with ``wanted`` (from :func:`environment`).

    Each entry is one sentence naming the variable, both values and the fix. Variables
    already set to an equal value are not conflicts. :func:`enable` raises with these unless
    ``override=True``, so nothing is overwritten silently.

    >>> conflicts(environment(1.5), {"XLA_CLIENT_MEM_FRACTION": "0.8"})[0][:44]
    'XLA_CLIENT_MEM_FRACTION=0.8 is already set: '
    """
    env = os.environ if environ is None else environ
    out: list[str] = []
    frac_new = env.get(ENV_FRACTION, "")
    frac_old = env.get(ENV_FRACTION_DEPRECATED, "")
    want_frac = wanted.get(ENV_FRACTION)
    if frac_new and frac_old:
        out.append(
            f"{ENV_FRACTION}={frac_new} and {ENV_FRACTION_DEPRECATED}={frac_old} are both set; "
            f"XLA refuses to start with both. Unset the deprecated {ENV_FRACTION_DEPRECATED} "
            f"(`unset {ENV_FRACTION_DEPRECATED}`)."
        )
    elif frac_old and want_frac is not None:
        out.append(
            f"{ENV_FRACTION_DEPRECATED}={frac_old} is set (the deprecated name). jaxmem sets "
            f"{ENV_FRACTION} and XLA refuses both. Unset it (`unset {ENV_FRACTION_DEPRECATED}`) "
            "or pass override=True / --override to replace it."
        )
    name, raw = (ENV_FRACTION, frac_new) if frac_new else (ENV_FRACTION_DEPRECATED, frac_old)
    if raw and want_frac is not None:
        have, want = _parse_fraction(raw), float(want_frac)
        if have is None:
            out.append(f"{name}={raw!r} is not a number. Unset it or pass override=True.")
        elif have < 1.0 and want > 1.0:
            out.append(
                f"{name}={raw} is already set: below 1 it caps XLA's pool under the device "
                f"size, but oversubscription={want_frac} was requested. Unset it "
                f"(`unset {name}`), or pass override=True / --override to replace it."
            )
        elif not math.isclose(have, want):
            out.append(
                f"{name}={raw} is already set, but {want_frac} was requested. Unset it, "
                f"request oversubscription={raw}, or pass override=True / --override."
            )
    if ENV_UNIFIED in wanted and env.get(ENV_UNIFIED, "") != "":
        have_um = _parse_bool_tsl(env[ENV_UNIFIED])
        if have_um is not _parse_bool_tsl(wanted[ENV_UNIFIED]):
            out.append(
                f"{ENV_UNIFIED}={env[ENV_UNIFIED]} is already set and "
                + ("turns managed memory off. " if have_um is False else "is not a boolean. ")
                + f"Unset it (`unset {ENV_UNIFIED}`) or pass override=True."
            )
    if ENV_PREALLOCATE in wanted and env.get(ENV_PREALLOCATE, "") != "":
        have_pre = _parse_preallocate(env[ENV_PREALLOCATE])
        if have_pre != _parse_preallocate(wanted[ENV_PREALLOCATE]):
            out.append(
                f"{ENV_PREALLOCATE}={env[ENV_PREALLOCATE]} is already set, but "
                f"preallocate={have_pre is False} was requested. Unset it, pass "
                f"preallocate={have_pre}, or pass override=True."
            )
    allocator = env.get(ENV_ALLOCATOR, "")
    if allocator and allocator.lower() not in ("default", "bfc"):
        out.append(
            f"{ENV_ALLOCATOR}={allocator} is set: managed memory only applies to XLA's BFC "
            f"allocator. Unset it (`unset {ENV_ALLOCATOR}`) or pass override=True."
        )
    return out


def _merged_environment(
    wanted: Mapping[str, str], environ: Mapping[str, str], override: bool
) -> tuple[dict[str, str], list[str], list[str]]:
    """``(variables to set, variables to unset, conflicts found)`` for ``wanted``."""
    problems = conflicts(wanted, environ)
    if problems and not override:
        return dict(wanted), [], problems
    unset = []
    if environ.get(ENV_FRACTION_DEPRECATED, "") != "":
        unset.append(ENV_FRACTION_DEPRECATED)
    alloc = environ.get(ENV_ALLOCATOR, "")
    if alloc and alloc.lower() not in ("default", "bfc"):
        unset.append(ENV_ALLOCATOR)
    return dict(wanted), unset, problems


def recipe(oversubscription: float = 1.5, preallocate: bool = False) -> str:
    """How to turn managed memory on, as text: in a script, in the shell, with the CLI.

    >>> print(recipe(1.5).splitlines()[0])
    In Python, before the first JAX operation:
    """
    env = environment(oversubscription, preallocate)
    ratio = env[ENV_FRACTION]
    pre = " --preallocate" if preallocate else ""
    exports = "\n".join(f"      export {k}={v}" for k, v in env.items())
    return (
        "In Python, before the first JAX operation:\n"
        "      from jaxmem import managed_memory\n"
        f"      managed_memory.enable(oversubscription={ratio}"
        + (", preallocate=True" if preallocate else "")
        + ")\n"
        "In the shell, before Python starts:\n"
        f"{exports}\n"
        "Or launch through jaxmem:\n"
        f"      python -m jaxmem managed-memory --oversubscription {ratio}{pre} -- "
        "python your_script.py"
    )


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


def _gpu_possible() -> tuple[bool, str]:
    """Whether the CUDA backend could start in this process, and why not (starts nothing)."""
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(
        getattr(jax.config, "jax_platforms", "") or ""
    )
    if platforms:
        names = {p.strip().lower() for p in platforms.split(",")}
        if not names & {"cuda", "gpu"}:
            return False, f"JAX_PLATFORMS={platforms} excludes the CUDA backend"
    if not _jax.cuda_plugin_installed():
        return False, "no jax CUDA plugin is installed (pip install 'jax[cuda12]' or cuda13)"
    if not _jax.has_visible_nvidia_gpu():
        return False, "no NVIDIA GPU is visible to this process"
    return True, ""


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
    # Values an earlier enable() in this process set are ours to change, not conflicts.
    base = dict(os.environ)
    for k, v in (_REQUESTED or {}).items():
        if base.get(k) == v:
            del base[k]
    to_set, to_unset, problems = _merged_environment(wanted, base, override)
    already = not problems and all(os.environ.get(k) == v for k, v in wanted.items())
    if _jax.default_backend_initialized():
        if already:  # e.g. launched through `python -m jaxmem managed-memory`
            with _LOCK:
                _REQUESTED = dict(wanted)
            return status()
        running = ", ".join(_jax.initialized_platforms()) or "a backend"
        raise ManagedMemoryError(
            "jaxmem.managed_memory.enable() must be called before the first JAX operation: "
            "the XLA GPU client reads its memory settings once, when the backend starts, and "
            f"the {running} backend has already started in this process (something called "
            "jax.devices(), created an array or ran a jitted function). Nothing was changed.\n"
            + recipe(oversubscription, preallocate)
            + "\nIn a notebook, restart the kernel and run enable() in the first cell."
        )
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
    ratio = float(wanted[ENV_FRACTION])
    if ratio > WARN_OVERSUBSCRIPTION:
        warnings.warn(
            f"oversubscription={ratio} is large: everything beyond the device memory is paged "
            "from host RAM on demand, and managed memory can be many times slower than device "
            "memory (jax-ml/jax#11056). Keep it near 1.5, and make sure host RAM holds the "
            "excess.",
            ManagedMemoryWarning,
            stacklevel=2,
        )
    ok, why = _gpu_possible()
    if not ok:
        warnings.warn(
            f"jaxmem.managed_memory.enable(): the environment is set, but it has no effect "
            f"here: {why}. Managed memory applies only to XLA's CUDA GPU client; the same "
            "script will use it on a machine with an NVIDIA GPU.",
            ManagedMemoryWarning,
            stacklevel=2,
        )
    return status()


@dataclasses.dataclass(frozen=True)
class ManagedMemoryStatus:
    """What :func:`status` found: the settings, whether they are in force, and why.

    ``in_force`` is ``None`` before any backend has started (the settings are pending),
    ``True`` when the CUDA backend runs with managed memory on, ``False`` otherwise.
    ``client_options`` is what the XLA GPU client reads from this environment
    (``memory_fraction``, ``preallocate``, ...); ``None`` if jaxlib cannot say, or if the
    environment is invalid (then ``note`` says why).
    """

    requested: bool
    unified_memory: bool
    memory_fraction: float | None
    preallocate: bool | None
    environment: dict[str, str | None]
    client_options: dict[str, Any] | None
    backend_initialized: bool
    platforms: tuple[str, ...]
    in_force: bool | None
    note: str
    cuda_runtime: str | None
    advised_buffers: dict[str, int]
    advised_bytes: dict[str, int]

    def __str__(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.environment.items() if v is not None)
        state = {None: "pending (no backend yet)", True: "IN FORCE", False: "not in force"}
        lines = [
            f"managed memory: {state[self.in_force]}: {self.note}",
            f"  environment: {env or '(none of the managed-memory variables set)'}",
            f"  XLA GPU client options: {self.client_options}",
            f"  backends started: {', '.join(self.platforms) or 'none'}",
        ]
        if self.cuda_runtime:
            lines.append(f"  CUDA runtime: {self.cuda_runtime}")
        if self.advised_buffers:
            adv = ", ".join(
                f"{k}: {n} buffers / {self.advised_bytes.get(k, 0)} B"
                for k, n in self.advised_buffers.items()
            )
            lines.append(f"  advised: {adv}")
        return "\n".join(lines)


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


# --- the CUDA runtime (ctypes) --------------------------------------------------------------

class Advice(enum.IntEnum):
    """``enum cudaMemoryAdvise`` (identical in CUDA 12 and 13)."""

    SET_READ_MOSTLY = 1
    UNSET_READ_MOSTLY = 2
    SET_PREFERRED_LOCATION = 3
    UNSET_PREFERRED_LOCATION = 4
    SET_ACCESSED_BY = 5
    UNSET_ACCESSED_BY = 6


class _MemLocation(ctypes.Structure):
    """``struct cudaMemLocation { enum cudaMemLocationType type; int id; }``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_LOCATION_TYPE = {"device": 1, "host": 2}  # cudaMemLocationTypeDevice / ...Host
_CPU_DEVICE_ID = -1  # cudaCpuDeviceId, the CUDA <= 12 way to say "host"


def advise_signature(version: int) -> str:
    """Which ``cudaMemAdvise`` a CUDA runtime of ``version`` (e.g. 12080, 13000) exports.

    - ``"location"``: CUDA >= 13, ``cudaMemAdvise(const void*, size_t, enum
      cudaMemoryAdvise, struct cudaMemLocation)``;
    - ``"device"``: CUDA <= 12, ``cudaMemAdvise(const void*, size_t, enum
      cudaMemoryAdvise, int device)``, ``-1`` (``cudaCpuDeviceId``) for the host.

    >>> advise_signature(13000), advise_signature(12080)
    ('location', 'device')
    """
    return "location" if version >= 13000 else "device"


class CudaRuntime:
    """A ``libcudart`` loaded with ctypes, with ``cudaMemAdvise`` bound to the right signature.

    >>> rt = CudaRuntime("/usr/local/cuda-13.0/lib64/libcudart.so.13")  # doctest: +SKIP
    >>> rt.version, rt.signature                                        # doctest: +SKIP
    (13000, 'location')
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = ctypes.CDLL(path)
        v = ctypes.c_int(0)
        get_version = self.lib.cudaRuntimeGetVersion
        get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
        get_version.restype = ctypes.c_int
        rc = get_version(ctypes.byref(v))
        if rc != 0 or v.value <= 0:
            raise OSError(f"{path}: cudaRuntimeGetVersion failed (error {rc})")
        self.version: int = v.value
        self.signature: str = advise_signature(self.version)
        self._error_string = self.lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p
        self._error_name = self.lib.cudaGetErrorName
        self._error_name.argtypes = [ctypes.c_int]
        self._error_name.restype = ctypes.c_char_p
        fn = self.lib.cudaMemAdvise
        last = _MemLocation if self.signature == "location" else ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, last]
        fn.restype = ctypes.c_int
        self._mem_advise = fn

    def __repr__(self) -> str:
        return f"CudaRuntime({self.path!r}, version={self.version}, signature={self.signature!r})"

    def error_text(self, code: int) -> str:
        name = (self._error_name(code) or b"?").decode(errors="replace")
        text = (self._error_string(code) or b"?").decode(errors="replace")
        return f"{name} ({text})"

    def mem_advise_rc(
        self, ptr: int, nbytes: int, advice: Advice | int, location: str, device: int
    ) -> int:
        """Raw ``cudaMemAdvise``; returns the ``cudaError_t`` (0 is success)."""
        if location not in _LOCATION_TYPE:
            raise ValueError(f"location must be 'device' or 'host', got {location!r}")
        if self.signature == "location":
            loc = _MemLocation(_LOCATION_TYPE[location], device if location == "device" else 0)
            return int(self._mem_advise(ptr, nbytes, int(advice), loc))
        dev = device if location == "device" else _CPU_DEVICE_ID
        return int(self._mem_advise(ptr, nbytes, int(advice), dev))

    def mem_advise(
        self, ptr: int, nbytes: int, advice: Advice | int, location: str, device: int
    ) -> None:
        """``cudaMemAdvise`` on ``[ptr, ptr + nbytes)``; raises :class:`CudaError` on failure."""
        rc = self.mem_advise_rc(ptr, nbytes, advice, location, device)
        if rc != 0:
            raise CudaError(
                f"cudaMemAdvise({Advice(advice).name}, {location}, device {device}) on "
                f"{nbytes} bytes at {ptr:#x} failed: {self.error_text(rc)}. If this is "
                "cudaErrorInvalidValue, the buffer is not managed memory: call "
                "jaxmem.managed_memory.enable() before the first JAX operation.",
                rc,
            )


def cudart_candidates() -> list[str]:
    """Paths to try for ``libcudart``, best first.

    Order: ``$JAXMEM_CUDART``; the libcudart already mapped into this process (the one the
    jax CUDA plugin loaded); the ``nvidia-cuda-runtime`` wheels (``nvidia/cu13/lib``,
    ``nvidia/cuda_runtime/lib``); ``$CUDA_HOME``; the system library path; ``/usr/local/cuda*``.
    """
    out: list[str] = []
    if os.environ.get(ENV_CUDART):
        out.append(os.environ[ENV_CUDART])
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            path = line.rsplit(" ", 1)[-1].strip()
            if "/libcudart.so" in path:
                out.append(path)
    out.extend(nvidia_wheel_cudarts())
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.extend(sorted(glob.glob(os.path.join(os.environ[var], "lib*", "libcudart.so*"))))
    found = ctypes.util.find_library("cudart")
    if found:
        out.append(found)
    for pattern in ("/usr/local/cuda/lib64/libcudart.so*", "/usr/local/cuda-*/lib64/libcudart.so*"):
        out.extend(sorted(glob.glob(pattern), reverse=True))
    return [p for p in dict.fromkeys(out) if p and not p.endswith((".a", ".py"))]


def nvidia_wheel_cudarts() -> list[str]:
    """``libcudart.so*`` files shipped by installed ``nvidia-cuda-runtime`` wheels."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    out: list[str] = []
    for root in spec.submodule_search_locations or ():
        out.extend(sorted(glob.glob(os.path.join(root, "*", "lib", "libcudart.so*"))))
    return out


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

#: The three-type scheme: data kind -> ((advice, location), ...). Our inference, see module doc.
KINDS: dict[str, tuple[tuple[Advice, str], ...]] = {
    "params": ((Advice.SET_READ_MOSTLY, "device"),),
    "intermediates": ((Advice.SET_PREFERRED_LOCATION, "device"),),
    "inputs": ((Advice.SET_ACCESSED_BY, "device"), (Advice.SET_ACCESSED_BY, "host")),
}

_ADVICE_NAMES = {
    a.name.lower().removeprefix("set_"): a for a in Advice if a.name.startswith("SET_")
} | {a.name.lower(): a for a in Advice}


_Plan = tuple[tuple[Advice, str], ...]


def _resolve(kind: str | Advice, location: str | None) -> tuple[str, _Plan]:
    if isinstance(kind, Advice):
        return kind.name.lower(), ((kind, location or "device"),)
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a string or an Advice, got {kind!r}")
    key = kind.strip().lower().replace("-", "_")
    if key in KINDS:
        if location is not None:
            raise ValueError(
                f"kind={kind!r} fixes its own locations {KINDS[key]}; pass an advice "
                "('read_mostly', 'preferred_location', 'accessed_by') to choose a location"
            )
        return key, KINDS[key]
    if key in _ADVICE_NAMES:
        loc = location or "device"
        if loc not in _LOCATION_TYPE:
            raise ValueError(f"location must be 'device' or 'host', got {location!r}")
        return key, ((_ADVICE_NAMES[key], loc),)
    choices = sorted(KINDS) + sorted(k for k in _ADVICE_NAMES if not k.startswith("set_"))
    raise ValueError(f"unknown kind {kind!r}; expected one of {choices} or an Advice")


def _iter_arrays(tree: Any) -> Iterable[jax.Array]:
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            yield leaf


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
    buffers: list[tuple[Any, int, int]] = []
    other_platforms: set[str] = set()
    for x in _iter_arrays(tree):
        if x.is_deleted():
            raise ValueError(
                f"advise({label!r}): an array of shape {x.shape} was deleted (donated to a "
                "jitted call?). Advise the arrays that call returned instead."
            )
        for device, ptr, nbytes in _jax.shard_buffers(x):
            if device.platform not in ("gpu", "cuda"):
                other_platforms.add(device.platform)
            elif nbytes > 0:
                buffers.append((device, ptr, nbytes))
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
    if done:
        with _LOCK:
            _ADVISED[label] = _ADVISED.get(label, 0) + done
            _ADVISED_BYTES[label] = _ADVISED_BYTES.get(label, 0) + done_bytes
    return tree


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
