"""jaxmem benchmarks: the zoo under each variant (plain jit, per-block remat, jaxmem).

The model zoo itself is :mod:`benchmarks.zoo` (one module per model family), also used by
the tests, the docs and ``python -m jaxmem ... zoo:<name>``.

``python -m benchmarks`` runs them (see :mod:`benchmarks.run`); ``python -m benchmarks table``
renders the saved ``results.json`` as markdown (see :mod:`benchmarks.readme_table`).
"""
