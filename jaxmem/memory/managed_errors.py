"""The errors and the warning of :mod:`jaxmem.managed_memory`, in one place.

Part of the memory box (``jaxmem.memory``, layer 6): :mod:`~jaxmem.memory.managed_memory`
raises :class:`ManagedMemoryError` and warns :class:`ManagedMemoryWarning`, and the ctypes
binding (:mod:`~jaxmem.memory.managed_cudart`) raises :class:`CudaError`. All three are
public as ``jaxmem.managed_memory.<name>``.
"""

from __future__ import annotations

__all__ = ["CudaError", "ManagedMemoryError", "ManagedMemoryWarning"]


class ManagedMemoryError(RuntimeError):
    """Managed memory cannot be set up as asked. The message says what to do instead."""


class CudaError(ManagedMemoryError):
    """A CUDA runtime call failed. ``.code`` is the ``cudaError_t`` value."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class ManagedMemoryWarning(UserWarning):
    """Managed memory or memory advice has no effect here (CPU, no CUDA runtime, ...)."""
