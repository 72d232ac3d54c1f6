"""jaxmem: train deeper, wider networks and bigger batches in the same accelerator memory.

Public entry points (see README.md and docs/):

- :func:`jaxmem.optimize` — a drop-in ``jax.jit`` for train steps that needs less memory,
  optionally under a ``budget=``.
- :func:`jaxmem.analyze` — which forward values the backward pass keeps, by layer.
- :func:`jaxmem.checkpoint`, :mod:`jaxmem.policies`, :mod:`jaxmem.flax` — the same plans
  through ``jax.checkpoint``, for losses, blocks, scan bodies and flax modules.
- :func:`jaxmem.chunked`, :func:`jaxmem.chunked_cross_entropy` — bottleneck layers in chunks.
- :func:`jaxmem.offload_name` — park a value in host memory between forward and backward.
- :mod:`jaxmem.measure` — XLA's own compiled memory figures, measured the jaxmem way.
- :mod:`jaxmem.targets` — compile for an H100, H200, A100 or TPU without one (deviceless).
- :mod:`jaxmem.managed_memory` — CUDA Unified Memory for XLA's GPU client.
- :mod:`jaxmem.plan_cache` — plans kept across calls, processes and hosts
  (``JAXMEM_PLAN_CACHE_DIR``).
- :class:`jaxmem.PlanMismatchError` — the processes of a ``jax.distributed`` job planned a
  step differently (:mod:`jaxmem.compiling.multihost` checks every new plan's fingerprint).
"""

from jaxmem import _compat
from jaxmem.analyzing.analysis import Analysis, Residual, analyze
from jaxmem.analyzing.costmodel import DeviceProfile
from jaxmem.analyzing.tags import offload_name
from jaxmem.compiling import plan_cache
from jaxmem.compiling.multihost import PlanMismatchError
from jaxmem.memory import managed_memory
from jaxmem.memory.chunked import chunked, chunked_cross_entropy
from jaxmem.optimized import Optimized, optimize, pareto
from jaxmem.planning.budget import Budget, BudgetError
from jaxmem.planning.plan import Choice, Decision, Plan
from jaxmem.rewriting import policies
from jaxmem.rewriting.remat import Checkpointed, checkpoint
from jaxmem.tracing import primitives, program
from jaxmem.tracing.program import Program, TraceError, trace
from jaxmem.xla import measure, targets

_compat.install()  # the module paths of 0.1 (jaxmem.measure, jaxmem.strategies, ...)

__version__ = "0.1.0.dev0"

#: Submodules loaded on first attribute access: ``jaxmem.flax`` imports flax, which a user of
#: ``jaxmem.optimize`` on a plain-JAX step should not pay for (about a second, and flax's own
#: imports). ``import jaxmem.flax`` and ``from jaxmem import flax`` load it as usual.
_LAZY_SUBMODULES = ("flax",)


def __getattr__(name: str) -> object:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"jaxmem.{name}")  # also sets it as an attribute
    raise AttributeError(f"module 'jaxmem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = [
    "Analysis", "Budget", "BudgetError", "Checkpointed", "Choice", "Decision", "DeviceProfile",
    "Optimized", "Plan", "PlanMismatchError", "Program", "Residual", "TraceError", "analyze",
    "checkpoint", "chunked", "chunked_cross_entropy", "flax", "managed_memory", "measure",
    "offload_name", "optimize", "pareto", "plan_cache", "policies", "primitives", "program",
    "targets", "trace",
]
