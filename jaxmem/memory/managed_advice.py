"""Per-data-type memory advice: which ``cudaMemAdvise`` calls each kind of data gets.

Part of the memory box (``jaxmem.memory``, layer 6), behind :mod:`jaxmem.managed_memory`
(which re-exports :data:`KINDS`). The three-type scheme (parameters, intermediate results,
input data) is the second seed paper's; which advice goes with which type is our inference
(see :mod:`jaxmem.managed_memory`'s docstring and docs/managed_memory.md). This module turns
a kind or a single advice into the ``(advice, location)`` pairs to apply, and finds the GPU
buffers of a pytree's arrays, shard by shard. Applying the advice, and remembering what was
applied, is ``jaxmem.managed_memory.advise()``'s job.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from jaxmem import _jax
from jaxmem.memory.managed_cudart import _LOCATION_TYPE, Advice

__all__ = ["KINDS"]

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


def _gpu_buffers(tree: Any, label: str) -> tuple[list[tuple[Any, int, int]], set[str]]:
    """``(buffers, other platforms)``: ``(device, pointer, bytes)`` of every non-empty shard
    of ``tree``'s arrays on a CUDA GPU, and the platforms of the shards that are elsewhere.

    Raises ValueError for a deleted (donated) array; ``label`` names the advice in the
    message."""
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
    return buffers, other_platforms
