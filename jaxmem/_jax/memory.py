"""Memory kinds and spaces, and the buffers behind an array (bottom layer,
:mod:`jaxmem._jax`).

The memory kinds a device offers (``device``, ``pinned_host``; the compile-only GPU
topology device lists none but compiles both), the ``jax.memory`` spaces host offload names,
and each addressable shard's raw device buffer (what jaxmem's managed-memory advice
names to the CUDA driver).
"""

from __future__ import annotations

from typing import Any

import jax


def host_space() -> Any:
    return jax.memory.Space.Host


def device_space() -> Any:
    return jax.memory.Space.Device


def memory_kinds(device: Any = None) -> frozenset[str]:
    """Memory kinds of ``device`` (default: the default device): ``device``,
    ``pinned_host``, ... A GPU's compile-only topology device lists none, but XLA:GPU
    compiles host placement for it as for a real GPU: ``device`` and ``pinned_host``."""
    device = device if device is not None else jax.devices()[0]
    try:
        kinds = frozenset(m.kind for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - a backend without the memories API
        kinds = frozenset()
    if not kinds and str(getattr(device, "platform", "")).lower() in ("gpu", "cuda"):
        kinds = frozenset({"device", "pinned_host"})
    return kinds


def shard_buffers(x: Any) -> list[tuple[Any, int, int]]:
    """``[(device, raw pointer, bytes on device)]`` for each addressable shard of an array.

    ``unsafe_buffer_pointer()`` refuses sharded arrays, so this goes shard by shard.
    """
    out = []
    for s in x.addressable_shards:
        data = s.data
        size = getattr(data, "on_device_size_in_bytes", None)
        nbytes = int(size()) if callable(size) else int(data.nbytes)
        out.append((s.device, int(data.unsafe_buffer_pointer()), nbytes))
    return out
