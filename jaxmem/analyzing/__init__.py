"""Second box: which forward values the backward pass reads, and what keeping them costs.

- :mod:`~jaxmem.analyzing.analysis` — the residuals, by layer (``jaxmem.analyze``).
- :mod:`~jaxmem.analyzing.chains` — recompute chains: where one starts, what it replays.
- :mod:`~jaxmem.analyzing.liveness`, :mod:`~jaxmem.analyzing.schedule`,
  :mod:`~jaxmem.analyzing.fusion` — the buffers XLA would allocate, in its order, per target.
- :mod:`~jaxmem.analyzing.costmodel` — the predicted peak and FLOPs of a decision.
- :mod:`~jaxmem.analyzing.losses`, :mod:`~jaxmem.analyzing.tags` — the logits bottleneck, and
  the values a user tagged for offload.

Imports :mod:`jaxmem.tracing`, :mod:`jaxmem.xla` and :mod:`jaxmem._jax` only.
"""
