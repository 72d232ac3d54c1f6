"""First box of the data flow: a step traced into a :class:`~jaxmem.tracing.program.Program`.

- :mod:`~jaxmem.tracing.program` — the jaxpr flattened into annotated nodes (layer paths,
  forward and backward regions, donation).
- :mod:`~jaxmem.tracing.primitives` — what each primitive costs and whether it is a utility.
- :mod:`~jaxmem.tracing.arguments` — how a call's arguments split into traced, static, donated.
- :mod:`~jaxmem.tracing.structure`, :mod:`~jaxmem.tracing.blocks` — layers and blocks, from the
  program's structure and from its name stack.

Imports :mod:`jaxmem._jax` only: the bottom folder.
"""
