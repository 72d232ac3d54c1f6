"""A :class:`~jaxmem.analyzing.analysis.Residual` record for an anchor (third box of the
data flow, ``Analysis -> Plan``).

An anchor is a forward value a recompute chain starts from that the backward pass does not
read itself (a matmul output feeding a norm). A plan that drops or offloads one needs a
:class:`~jaxmem.planning.plan.Choice` for it, and a choice is about a residual record:
:func:`anchor_record` makes one. The block, selective and cost-model planners use it.
"""

from __future__ import annotations

from jaxmem.analyzing.analysis import Residual
from jaxmem.tracing.program import Program

__all__ = ["anchor_record"]


def anchor_record(program: Program, v: int) -> Residual:
    """A :class:`~jaxmem.analyzing.analysis.Residual` record for value ``v``, an anchor the
    backward does not read itself (a matmul output feeding a norm), so a plan can decide to
    re-create it too."""
    val = program.values[v]
    node = program.nodes[val.producer]
    return Residual(
        name=f"{node.layer + '/' if node.layer else ''}{node.primitive}#{v}", value=v,
        shape=val.shape, dtype=val.dtype, nbytes=val.nbytes, layer=node.layer,
        primitive=node.primitive, kind=node.kind, readers=(), recompute_flops=node.flops,
        recompute_bytes=node.bytes_moved, chain=(node.index,), produced_at=node.index)
