"""Third box: for each residual, keep it, recompute it or offload it.

- :mod:`~jaxmem.planning.plan` — the :class:`~jaxmem.planning.plan.Plan` record.
- :mod:`~jaxmem.planning.strategies` — the planners (MEDL's rule, per block, selective, ...),
  all importable from there; each lives in a module of its own:
  :mod:`~jaxmem.planning.medl` (MEDL's rule, ``plan_none``, ``plan_auto``),
  :mod:`~jaxmem.planning.block_plans` (block boundaries and depths, ``plan_blocks``,
  ``resave``), :mod:`~jaxmem.planning.selective` (``plan_selective``),
  :mod:`~jaxmem.planning.cost_model_plans` (``plan_segments``, ``plan_offload``,
  ``plan_from_sets``), :mod:`~jaxmem.planning.candidates` (``auto_candidates``) and
  :mod:`~jaxmem.planning.anchors` (the record a plan keeps for an anchor).
- :mod:`jaxmem.planning.budget` — plans under a peak budget, the solvers, the Pareto sweep.

Plans are values: nothing here rewrites or compiles a program. Imports the folders below it
(:mod:`jaxmem.analyzing`, :mod:`jaxmem.tracing`, :mod:`jaxmem.xla`) only.
"""
