"""Fourth box: a plan applied to a program, as jaxpr rewrites and ``jax.checkpoint`` policies.

- :mod:`~jaxmem.rewriting.rewrite` — the joint-jaxpr rewrite of a whole train step.
- :mod:`~jaxmem.rewriting.policies` — ``jax.checkpoint`` policies (``jaxmem.policies``).
- :mod:`~jaxmem.rewriting.remat` — ``jaxmem.checkpoint``, for functions differentiated later.
- :mod:`~jaxmem.rewriting.blockwise` — per-block ``jax.checkpoint`` of an unedited loss.
- :mod:`~jaxmem.rewriting.scans` — plans inside scan bodies, as body policies.
- :mod:`~jaxmem.rewriting.substitutes` — memory-lean equivalents of some primitives.

Imports :mod:`jaxmem.planning` and the folders below it.
"""
