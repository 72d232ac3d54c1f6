"""Which arguments a step donates: the one place the donation is decided.

Part of the fifth box (:mod:`jaxmem.compiling`). Every program compiled for one signature
donates what :func:`decide` returns: each candidate plan's rewrite, the loss under the
built-in policies, and the plain ``jax.jit`` of the user's step that every candidate is
checked against (:mod:`jaxmem.compiling.steps`), so the baseline is ``jax.jit`` with the
same donation.

``donate_argnums="auto"`` donates what ``jax.jit(step, donate_argnums=i)`` can: an argument
whose leaves are arrays or Python scalars (a flax ``TrainState``'s ``step`` is an ``int``
until the first update; ``None`` and static fields are no leaves) and all come back among
the step's outputs with the same abstract value. A Python scalar counts as the weakly typed
array ``jax.jit`` makes of it (``3`` as ``int32``, ``0.5`` as ``float32``), so the state of
the first call and the state a step returns are donated alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmem.compiling.signature import SCALARS, abstract, normalise_argnums
from jaxmem.tracing.program import Program


class Donation(NamedTuple):
    """The donated positional (dynamic) arguments, and why each other one is not."""

    argnums: tuple[int, ...]
    notes: tuple[str, ...] = ()


def _donatable(x: Any) -> bool:
    """Whether ``jax.jit`` can donate the buffer of leaf ``x``: an array (or its abstract
    stand-in placed on a compile-only target), a NumPy array, or a Python scalar."""
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, *SCALARS))


def decide(donate_argnums: int | Sequence[int] | str | None, dyn_args: tuple[Any, ...],
           program: Program) -> Donation:
    """Positional (dynamic) argument indices to donate.

    ``donate_argnums="auto"``: each argument, in order, whose leaves can be donated
    (:func:`_donatable`) and all reappear among the outputs of ``program`` with the same
    shape and dtype, counting each output once (the train state: XLA then updates it in
    place); each other argument gets a note that says why it is not donated. Otherwise the
    given positions, normalised (``None``: none).
    """
    if donate_argnums != "auto":
        return Donation(normalise_argnums(donate_argnums, len(dyn_args)))
    outputs = Counter((tuple(program.values[v].shape), str(program.values[v].dtype))
                      for v in program.outputs)
    chosen, notes = [], []
    for i, a in enumerate(dyn_args):
        leaves = jax.tree_util.tree_leaves(a)
        need = Counter(abstract(x) for x in leaves)
        why = _why_not(leaves, need, outputs)
        if why:
            notes.append(f"argument {i} not donated: {why}")
            continue
        chosen.append(i)
        outputs -= need  # each output aliases one input
    return Donation(tuple(chosen), tuple(notes))


def _why_not(leaves: list[Any], need: Counter, outputs: Counter) -> str:
    """Why an argument with ``leaves`` is not donated ("" where it is)."""
    if not leaves:
        return "it holds no array"
    odd = [x for x in leaves if not _donatable(x)]
    if odd:
        return f"it holds a {type(odd[0]).__name__}, which jax.jit cannot donate"
    missing = (need - outputs).total()
    if missing:
        return (f"{missing} of its {len(leaves)} leaves do not come back among the "
                "step's outputs (an input, not a state the step updates)")
    return ""

