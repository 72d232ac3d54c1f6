"""jaxmem: train deeper, wider networks and bigger batches in the same accelerator memory.

Public entry points (see README.md and docs/):

- :func:`jaxmem.analyze` — which forward values the backward pass keeps, by layer.
- :mod:`jaxmem.measure` — XLA's own compiled memory figures, measured the jaxmem way.
"""

from jaxmem import measure, primitives, program
from jaxmem.analysis import Analysis, Residual, analyze
from jaxmem.program import Program, TraceError, trace

__version__ = "0.1.0.dev0"

__all__ = [
    "Analysis", "Program", "Residual", "TraceError", "analyze", "measure", "primitives",
    "program", "trace",
]
