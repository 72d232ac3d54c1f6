"""Which arguments a step donates: the one place the donation is decided.

Part of the fifth box (:mod:`jaxmem.compiling`). Every program compiled for one signature
donates what :func:`donated_argnums` returns: each candidate plan's rewrite, the loss under
the built-in policies, and the plain ``jax.jit`` of the user's step that every candidate is
checked against (:mod:`jaxmem.compiling.steps`), so the baseline is ``jax.jit`` with the
same donation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxmem.compiling.signature import normalise_argnums
from jaxmem.tracing.program import Program


def donated_argnums(donate_argnums: int | Sequence[int] | str | None,
                    dyn_args: tuple[Any, ...], program: Program) -> tuple[int, ...]:
    """Positional (dynamic) argument indices to donate.

    ``donate_argnums="auto"``: each argument, in order, whose leaves are all arrays (or
    their abstract stand-ins placed on a compile-only target) and all reappear among the
    outputs of ``program`` with the same shape and dtype, counting each output once (the
    train state: XLA then updates it in place). An argument with any other leaf (a Python
    scalar, such as a train state's step count) is not donated. Otherwise the given
    positions, normalised (``None``: none).
    """
    if donate_argnums != "auto":
        return normalise_argnums(donate_argnums, len(dyn_args))
    out_avals: dict[Any, int] = {}
    for v in program.outputs:
        k = (program.values[v].shape, program.values[v].dtype)
        out_avals[k] = out_avals.get(k, 0) + 1
    chosen = []
    for i, a in enumerate(dyn_args):
        leaves = jax.tree_util.tree_leaves(a)
        need: dict[Any, int] = {}
        for x in leaves:
            k = (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", "")))
            need[k] = need.get(k, 0) + 1
        # arrays, or their abstract stand-ins placed on a (compile-only) target
        arrays = [x for x in leaves if isinstance(x, jax.Array | jax.ShapeDtypeStruct)]
        if arrays and len(arrays) == len(leaves) and all(
                out_avals.get(k, 0) >= c for k, c in need.items()):
            chosen.append(i)
            for k, c in need.items():
                out_avals[k] -= c
    return tuple(chosen)
