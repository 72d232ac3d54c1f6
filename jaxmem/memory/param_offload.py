"""Parameters in host memory: fetched to the device before each use in the step.

The part of ``optimize(offload_state="all")`` (:mod:`jaxmem.memory.state_offload`) that the
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
from jaxmem.tracing.program import Program

__all__ = ["model_reads", "update_start", "through_barriers", "anchor", "fetched", "reuse"]

#: A node reading parameters whose outputs are at most this fraction of their bytes (an
#: embedding lookup: a few rows of the table) is computed once, not re-fetched per use.
REUSE_FRACTION = 1 / 8


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
    """The value a fetch for node ``index`` waits for: the latest-made value, other than a
    parameter and made before the node, that the node or a node reading its outputs reads
    (a cast's matmul reads the layer's activation; a recomputed embedding lookup's sum reads
    the backward's latest cotangent). None where there is none (the fetch may then start at
    the beginning of the step)."""
    node = program.nodes[index]

    def best(values: Iterable[int]) -> int | None:
        made = [(program.values[v].producer, v) for v in values
                if v not in params and program.values[v].producer is not None
                and program.values[v].producer < index and v not in program.constant_derived]
        return max(made)[1] if made else None

    users = {u for o in node.outputs for u in program.users.get(o, ())}
    return best([*node.inputs, *(v for u in users for v in program.nodes[u].inputs)])


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


def reuse(program: Program, params: frozenset[int]) -> dict[int, int]:
    """Node index -> an earlier node computing the same outputs, for the nodes reading
    parameters whose outputs are small against them (:data:`REUSE_FRACTION`): the residual
    plan recomputes an embedding lookup in every layer's backward (cheap in FLOPs on the
    device), which from host memory would fetch the whole table each time. Same values are
    found by value numbering, barriers passing their inputs' numbers through."""
    number: dict[int, Any] = {}
    first: dict[Any, int] = {}
    out: dict[int, int] = {}
    for n in program.nodes[:update_start(program)]:
        if _is_barrier(n):
            for v, o in zip(n.inputs, n.outputs, strict=True):
                number[o] = number.get(v, v)
            continue
        key = _key(program, n, number)
        if key is None:
            continue
        if key in first:
            for o, e in zip(n.outputs, program.nodes[first[key]].outputs, strict=True):
                number[o] = number.get(e, e)
            read = sum(program.values[v].nbytes for v in reads(program, n.index, params))
            made = sum(program.values[o].nbytes for o in n.outputs)
            if read and made <= REUSE_FRACTION * read:
                out[n.index] = first[key]
        else:
            first[key] = n.index
    return out


def _key(program: Program, node: Any, number: dict[int, Any]) -> Any:
    """A hashable description of what ``node`` computes, or None (effects, nested jaxprs or
    functions, whose text may not say all they compute, large params)."""
    if node.eqn.effects or _jax.sub_jaxprs(node.eqn) or any(
            callable(x) for x in node.eqn.params.values()):
        return None
    params = repr(sorted(node.eqn.params.items()))
    if len(params) > 2000:
        return None
    return (node.eqn.primitive.name, params, tuple(_number(program, v, number)
                                                   for v in node.inputs))


def _number(program: Program, v: int, number: dict[int, Any]) -> Any:
    """``v``'s value number: a small literal by its value, anything else by its id."""
    val = program.values[v]
    if val.is_const and val.nbytes <= 64:
        c = val.const
        as_list = getattr(c, "tolist", lambda: c)()
        return ("literal", str(getattr(c, "dtype", type(c))), repr(as_list))
    return number.get(v, v)
