"""jaxmem benchmarks: the zoo under each variant (plain jit, per-block remat, jaxmem).

``python -m benchmarks`` runs them (see :mod:`benchmarks.run`); ``python -m benchmarks table``
renders the saved ``results.json`` as markdown (see :mod:`benchmarks.readme_table`).
"""
