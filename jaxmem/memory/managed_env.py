"""The environment variables that put XLA's GPU client on managed memory, and their checks.

Part of the memory box (``jaxmem.memory``, layer 6), behind :mod:`jaxmem.managed_memory`
(which re-exports every name here). The XLA GPU client reads these variables once, when the
backend starts: ``TF_FORCE_UNIFIED_MEMORY`` (managed memory on), ``XLA_CLIENT_MEM_FRACTION``
(the pool as a multiple of the device memory) and ``XLA_PYTHON_CLIENT_PREALLOCATE``. This
module computes them (:func:`environment`), reads the ones already set the way XLA and jaxlib
read them, lists the settings that disagree (:func:`conflicts`), prints the recipe
(:func:`recipe`), and says whether the CUDA backend could start at all here. It reads the
environment and changes nothing; ``enable()`` does the setting.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import jax

from jaxmem import _jax

__all__ = ["conflicts", "environment", "recipe"]

ENV_UNIFIED = "TF_FORCE_UNIFIED_MEMORY"
ENV_FRACTION = "XLA_CLIENT_MEM_FRACTION"
ENV_FRACTION_DEPRECATED = "XLA_PYTHON_CLIENT_MEM_FRACTION"
ENV_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ENV_ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"

#: Every variable :func:`status` reports.
ENV_VARS = (ENV_UNIFIED, ENV_FRACTION, ENV_FRACTION_DEPRECATED, ENV_PREALLOCATE, ENV_ALLOCATOR)


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
