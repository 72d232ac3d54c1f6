"""Parameters in host memory: fetched to the device before each use in the step.

The part of ``optimize(offload_state="all")`` (:mod:`jaxmem.state_offload`) that the
optimizer state does not need: a parameter (the f32 master weights) is read by the forward
pass, by the backward pass (a transposed matmul, or a recomputed cast) and by the update.
The update's reads are streamed with the moments, in the same groups; every other equation
that reads a parameter gets its *own* fetch, placed just before it:

- the fetch is ``device_put(host leaf -> device)`` behind an ``optimization_barrier`` tied to
  the equation's latest other input (the activation or cotangent arriving at that layer), so
  XLA cannot start it before the layer's turn;
- each use has its own barrier, so XLA cannot merge the fetches of the forward and the
  backward into one device copy that lives across the whole step.

So the device holds the parameters of the layer at work (and of the next, when XLA starts
its fetch early), not all of them; each parameter crosses the link twice into the device
(forward, backward) and once back (its new value), where the backward reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
from jax import lax

from jaxmem import _jax
from jaxmem.program import Program

__all__ = ["model_reads", "update_start", "through_barriers", "anchor", "fetched"]


def model_reads(program: Program) -> frozenset[int]:
    """Ids of the values the forward or backward pass reads."""
    return frozenset(v for n in program.nodes if n.phase in ("forward", "backward")
                     for v in n.inputs)


def update_start(program: Program) -> int:
    """Index of the first node after the last forward or backward node: the update's
    equations (and anything else after the backward pass) start there."""
    return 1 + max((n.index for n in program.nodes if n.phase in ("forward", "backward")),
                   default=-1)


def _is_barrier(node: Any) -> bool:
    return node.eqn.primitive.name == "optimization_barrier"


def through_barriers(program: Program, params: frozenset[int]) -> frozenset[int]:
    """``params`` and the values ``optimization_barrier`` s pass them through as, before the
    update (the residual rewrite ties recomputed equations' inputs with barriers): a barrier
    forwards the host copy, and the equation reading its output fetches it."""
    out = set(params)
    for n in program.nodes[:update_start(program)]:
        if _is_barrier(n):
            out.update(o for v, o in zip(n.inputs, n.outputs, strict=True) if v in out)
    return frozenset(out)


def reads(program: Program, index: int, params: frozenset[int]) -> list[int]:
    """The parameters node ``index`` fetches (none for a barrier: it forwards them)."""
    node = program.nodes[index]
    return [] if _is_barrier(node) else [v for v in dict.fromkeys(node.inputs) if v in params]


def anchor(program: Program, index: int, params: frozenset[int]) -> int | None:
    """The value a fetch for node ``index`` waits for: its latest-made input that is not a
    parameter; for a node reading parameters alone (a cast), the latest-made such input of
    the nodes that read its outputs (the matmul's activation), made before the node. None
    where there is none (the fetch may then start at the beginning of the step)."""
    node = program.nodes[index]

    def best(values: Iterable[int]) -> int | None:
        made = [(program.values[v].producer, v) for v in values
                if v not in params and program.values[v].producer is not None
                and program.values[v].producer < index and v not in program.constant_derived]
        return max(made)[1] if made else None

    own = best(node.inputs)
    if own is not None:
        return own
    users = {u for o in node.outputs for u in program.users.get(o, ())}
    return best(v for u in users for v in program.nodes[u].inputs)


def fetched(program: Program, index: int, params: frozenset[int], env: dict[int, Any]
            ) -> dict[int, Any]:
    """The parameters node ``index`` reads (value id -> array), each fetched to the device
    behind a barrier tied to :func:`anchor`: a fresh copy for this use only."""
    mine = reads(program, index, params)
    if not mine:
        return {}
    leaves = [env[v] for v in mine]
    tie = anchor(program, index, params)
    if tie is not None:
        leaves, _ = lax.optimization_barrier((leaves, env[tie]))
    return {v: jax.device_put(x, _jax.device_space()) for v, x in zip(mine, leaves, strict=True)}
