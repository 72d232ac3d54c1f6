"""jaxmem transforms for flax.linen modules (lifted like ``nn.remat``)."""

from jaxmem.flax._chunking import linen_chunked as chunked  # noqa: F401
