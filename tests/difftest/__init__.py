"""Differential testing of ``jaxmem.optimize`` against ``jax.jit`` on generated train steps.

- :mod:`.generator`: seeded random train steps from the primitive families users hit.
- :mod:`.check`: one step under one strategy against ``jax.jit`` (values, structure, peaks,
  budgets).
- :mod:`.runner`: batches of seeds packed into shared compiles; the CI test and
  ``benchmarks/differential.py`` call it.
- :mod:`.shrink`: ddmin over a failing case's ops.
"""
