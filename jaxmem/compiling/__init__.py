"""Fifth box: compile the candidates, check XLA's figures, choose, and remember the choice.

One signature of a step, from its arguments to what runs (:class:`jaxmem.optimized.Optimized`
calls these in this order):

- :mod:`~jaxmem.compiling.options` — the options of one ``jaxmem.optimize``, checked.
- :mod:`~jaxmem.compiling.signature` — a call's arguments as ``jax.jit`` sees them; the key.
- :mod:`~jaxmem.compiling.donation` — which arguments are donated, in one place.
- :mod:`~jaxmem.compiling.build` — a cache miss: trace (:mod:`~jaxmem.compiling.trace_step`),
  plan (:mod:`~jaxmem.compiling.plan_step`), jit (:mod:`~jaxmem.compiling.steps`), and the
  :class:`~jaxmem.compiling.entry.Entry` the signature runs from.
- :mod:`~jaxmem.compiling.choose` — the candidates compiled, the lowest kept: never above
  plain ``jax.jit`` nor the whole-loss built-in.
- :mod:`~jaxmem.compiling.builtin_fallbacks` — a budget met by JAX's built-in policies.
- :mod:`~jaxmem.compiling.offload_verify` — offload checked on the device's memory kinds.
- :mod:`~jaxmem.compiling.background` — ``verify="background"``: the check in a thread.

And beside them:

- :mod:`~jaxmem.compiling.quick_compile` — compiles that are only read.
- :mod:`~jaxmem.compiling.heap` — the heap kept out of the collector's walks while a miss
  is built.
- :mod:`~jaxmem.compiling.plan_cache` — plans kept across calls, processes and hosts.
- :mod:`~jaxmem.compiling.multihost` — one plan on every process of a ``jax.distributed`` job.
- :mod:`~jaxmem.compiling.shard_map`, :mod:`~jaxmem.compiling.scan_budget` — per-device and
  per-scan-body plans, compile-checked.

Imports every folder below it; only the entry points (:mod:`jaxmem.optimized`,
:mod:`jaxmem.flax`, the command line) import it.
"""
