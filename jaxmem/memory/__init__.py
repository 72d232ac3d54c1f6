"""Memory mechanisms beside the save/recompute planner: where buffers live, and in what pieces.

- :mod:`~jaxmem.memory.state_offload`, :mod:`~jaxmem.memory.param_offload` — optimizer state
  and parameters in host memory, streamed through the step.
- :mod:`~jaxmem.memory.managed_memory` — CUDA Unified Memory for XLA's GPU client
  (``jaxmem.managed_memory``).
- :mod:`~jaxmem.memory.chunked`, :mod:`~jaxmem.memory.chunked_ce` — bottleneck layers and the
  LM loss as chunked, double-buffered scans.

Imports the folders below it; nothing below imports it.
"""
