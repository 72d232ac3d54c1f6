"""Fifth box: compile the candidates, check XLA's figures, choose, and remember the choice.

- :mod:`~jaxmem.compiling.quick_compile` — compiles that are only read.
- :mod:`~jaxmem.compiling.plan_cache` — plans kept across calls, processes and hosts.
- :mod:`~jaxmem.compiling.multihost` — one plan on every process of a ``jax.distributed`` job.
- :mod:`~jaxmem.compiling.shard_map`, :mod:`~jaxmem.compiling.scan_budget` — per-device and
  per-scan-body plans, compile-checked.

Imports every folder below it; only the entry points (:mod:`jaxmem.optimized`,
:mod:`jaxmem.flax`, the command line) import it.
"""
