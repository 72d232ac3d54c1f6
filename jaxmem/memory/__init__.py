"""Memory mechanisms beside the save/recompute planner: where buffers live, and in what pieces.

- :mod:`~jaxmem.memory.state_offload`, :mod:`~jaxmem.memory.param_offload` — optimizer state
  and parameters in host memory, streamed through the step; the update's groups in
  :mod:`~jaxmem.memory.state_layout`, the leaves' bytes and pairing in
  :mod:`~jaxmem.memory.state_leaves`.
- :mod:`~jaxmem.memory.managed_memory` — CUDA Unified Memory for XLA's GPU client
  (``jaxmem.managed_memory``); its parts, all re-exported there: the environment
  (:mod:`~jaxmem.memory.managed_env`), the CUDA runtime binding
  (:mod:`~jaxmem.memory.managed_cudart`), the per-data-type advice
  (:mod:`~jaxmem.memory.managed_advice`), the status record
  (:mod:`~jaxmem.memory.managed_status`) and the errors (:mod:`~jaxmem.memory.managed_errors`).
- :mod:`~jaxmem.memory.chunked`, :mod:`~jaxmem.memory.chunked_ce` — bottleneck layers and the
  LM loss as chunked, double-buffered scans.

Imports the folders below it; nothing below imports it.
"""
