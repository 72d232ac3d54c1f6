"""The record :func:`jaxmem.managed_memory.status` returns, and how it prints.

Part of the memory box (``jaxmem.memory``, layer 6), behind :mod:`jaxmem.managed_memory`
(which re-exports :class:`ManagedMemoryStatus`): the managed-memory variables as set, what the
XLA GPU client reads from them, which backends have started, whether the settings are in
force and why, and how many buffers each kind of advice was applied to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ManagedMemoryStatus"]


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
