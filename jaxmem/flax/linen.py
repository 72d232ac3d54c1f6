"""jaxmem transforms for flax.linen modules (lifted like ``nn.remat``)."""

from jaxmem.flax._chunking import linen_chunked as chunked  # noqa: F401
from jaxmem.flax._remat import linen_intercept as intercept  # noqa: F401
from jaxmem.flax._remat import linen_remat as remat  # noqa: F401
