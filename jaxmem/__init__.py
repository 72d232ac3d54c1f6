"""jaxmem: train deeper, wider networks and bigger batches in the same accelerator memory.

Public entry points (see README.md and docs/):

- :func:`jaxmem.analyze` — which forward values the backward pass keeps, by layer.
- :func:`jaxmem.optimize` — a drop-in ``jax.jit`` for train steps that needs less memory.
- :mod:`jaxmem.measure` — XLA's own compiled memory figures, measured the jaxmem way.
- :mod:`jaxmem.managed_memory` — CUDA Unified Memory for XLA's GPU client.
"""

from jaxmem import managed_memory, measure, primitives, program
from jaxmem.analysis import Analysis, Residual, analyze
from jaxmem.optimized import Optimized, optimize
from jaxmem.plan import Choice, Decision, Plan
from jaxmem.program import Program, TraceError, trace

__version__ = "0.1.0.dev0"

__all__ = [
    "Analysis", "Choice", "Decision", "Optimized", "Plan", "Program", "Residual", "TraceError",
    "analyze", "managed_memory", "measure", "optimize", "primitives", "program", "trace",
]
