"""Third box: for each residual, keep it, recompute it or offload it.

- :mod:`~jaxmem.planning.plan` — the :class:`~jaxmem.planning.plan.Plan` record.
- :mod:`~jaxmem.planning.strategies` — the planners (MEDL's rule, per block, selective, ...).
- :mod:`jaxmem.planning.budget` — plans under a peak budget, the solvers, the Pareto sweep.

Plans are values: nothing here rewrites or compiles a program. Imports the folders below it
(:mod:`jaxmem.analyzing`, :mod:`jaxmem.tracing`, :mod:`jaxmem.xla`) only.
"""
