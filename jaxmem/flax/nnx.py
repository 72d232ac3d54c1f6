"""jaxmem transforms for flax.nnx modules."""

from jaxmem.flax._chunking import nnx_chunked as chunked  # noqa: F401
