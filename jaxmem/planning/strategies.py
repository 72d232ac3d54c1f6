"""Strategies: what to keep, recompute or offload (third box of the data flow,
``Analysis -> Plan``).

The planners, one module each, all importable from here (the path the rest of jaxmem, the
tests and the benchmarks use):

- :mod:`~jaxmem.planning.medl` — MEDL's rule (:func:`medl_keeps`, keep heavy outputs and
  recompute utility ones; :func:`medl_keeps_primitive` for ``jax.checkpoint`` policies),
  :func:`plan_none` (keep everything: the baseline) and :func:`plan_auto`, MEDL's rule made
  cost-aware;
- :mod:`~jaxmem.planning.block_plans` — :func:`plan_blocks`,
  ``jax.checkpoint(policy=nothing_saveable)`` around every block: keep what crosses block
  boundaries (:func:`block_boundaries`, at the depths of :func:`block_depths`), re-create the
  rest once per block, optionally with boundary values in host memory
  (:func:`block_offload_candidates`); :func:`resave` spends a fitting block plan's headroom on
  keeping some of it again;
- :mod:`~jaxmem.planning.selective` — ``plan_selective``: per-block ``dots_saveable`` plus
  the heavy outputs cheap to redo (attention scores);
- :mod:`~jaxmem.planning.cost_model_plans` — :func:`plan_segments` (Chen et al.'s sqrt(n)
  checkpointing: keep every k-th heavy output), :func:`plan_offload` (the auto plan plus host
  offload of values whose round trip hides) and :func:`plan_from_sets`;
- :mod:`~jaxmem.planning.candidates` — ``auto_candidates``, the plans the ``"auto"`` strategy
  compiles and picks from.

Plans under a memory budget combine these with the solvers in :mod:`jaxmem.planning.budget`.
"""

from __future__ import annotations

from jaxmem.planning.block_plans import (
    block_boundaries,
    block_depths,
    block_offload_candidates,
    plan_blocks,
    resave,
)
from jaxmem.planning.candidates import auto_candidates  # noqa: F401
from jaxmem.planning.cost_model_plans import plan_from_sets, plan_offload, plan_segments
from jaxmem.planning.medl import medl_keeps, medl_keeps_primitive, plan_auto, plan_none
from jaxmem.planning.selective import plan_selective  # noqa: F401

__all__ = [
    "block_boundaries", "block_depths", "block_offload_candidates", "medl_keeps",
    "medl_keeps_primitive", "plan_auto", "plan_blocks", "plan_from_sets", "plan_none",
    "plan_offload", "plan_segments", "resave",
]
