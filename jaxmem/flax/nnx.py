"""jaxmem transforms for flax.nnx modules."""

from jaxmem.flax._chunking import nnx_chunked as chunked  # noqa: F401
from jaxmem.flax._optimize import optimize  # noqa: F401
from jaxmem.flax._remat import named_scopes  # noqa: F401
from jaxmem.flax._remat import nnx_intercept as intercept  # noqa: F401
from jaxmem.flax._remat import nnx_remat as remat  # noqa: F401
