"""Flax (linen and nnx) wrappers for jaxmem's transforms.

- ``jaxmem.flax.linen.chunked`` / ``jaxmem.flax.nnx.chunked``: run a submodule's ``__call__``
  chunk by chunk (see :func:`jaxmem.chunked` and ``docs/chunking.md``).
"""

from jaxmem.flax import linen, nnx

__all__ = ["linen", "nnx"]
