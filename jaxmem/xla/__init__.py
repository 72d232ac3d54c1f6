"""What XLA reports, and for which device: the foundation every box stands on.

- :mod:`jaxmem.xla.measure` — compiled memory figures (``argument + output + temp - alias``,
  the barrier flag on CPU) and FLOPs, read from XLA's executable.
- :mod:`jaxmem.xla.targets` — the devices jaxmem can compile for without having them (H100,
  H200, A100 and TPU topologies) and each target's compiler options.

Imports :mod:`jaxmem.tracing` (jaxmem's own FLOP count of a traced program) and
:mod:`jaxmem._jax`; every folder above may import it.
"""
