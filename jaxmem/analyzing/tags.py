"""``jaxmem.offload_name``: values the user tags for host offload, and where the tags are.

Written in the model code, read after the second box of the data flow (an
:class:`~jaxmem.analyzing.analysis.Analysis`): the planners (:mod:`jaxmem.planning.strategies`,
:mod:`jaxmem.planning.budget`) plan every tagged residual as OFFLOAD, whatever the budget. A tag is
a
``jax.ad_checkpoint.checkpoint_name`` with the reserved prefix :data:`OFFLOAD_PREFIX`.
"""

from __future__ import annotations

from typing import Any

from jax.ad_checkpoint import checkpoint_name

from jaxmem import _jax
from jaxmem.analyzing.analysis import Analysis

__all__ = ["OFFLOAD_PREFIX", "offload_name", "offload_tagged", "offload_tags_out_of_reach"]

#: The checkpoint-name prefix that marks a value for offloading (see :func:`offload_name`).
OFFLOAD_PREFIX = "jaxmem_offload:"


def offload_name(x: Any, name: str) -> Any:
    """Tag ``x`` to be offloaded to host memory between its forward and backward use.

    A thin wrapper over ``jax.ad_checkpoint.checkpoint_name(x, "jaxmem_offload:" + name)``:
    ``jaxmem.optimize`` (and jaxmem's analysis) recognise the reserved prefix and plan the
    tagged value as OFFLOAD whatever the budget. Use it inside the loss/model code.

    Example:
      >>> import jax.numpy as jnp
      >>> h = offload_name(jnp.ones(3), "mlp_hidden")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"offload_name needs a non-empty string name, got {name!r}")
    return checkpoint_name(x, OFFLOAD_PREFIX + name)


def offload_tagged(analysis: Analysis) -> frozenset[int]:
    """Residual value ids the user tagged with :func:`offload_name`."""
    prog = analysis.program
    tagged: set[int] = set()
    for n in prog.nodes:
        if n.primitive == "name" and str(n.eqn.params.get("name", "")).startswith(
                OFFLOAD_PREFIX):
            tagged.update(n.outputs)
            tagged.update(n.inputs)
    return frozenset(r.value for r in analysis.residuals
                     if r.value in tagged and r.is_activation)


def offload_tags_out_of_reach(analysis: Analysis) -> list[tuple[str, str, str]]:
    """``(tag, unit primitive, layer)`` for each :func:`offload_name` tag inside a
    control-flow unit (a ``lax.scan``/``while``/``cond`` body, a custom-derivative call): the
    joint rewrite keeps units whole, so such a value stays on the device."""
    out: list[tuple[str, str, str]] = []
    for n in analysis.program.nodes:
        for sub in _jax.sub_jaxprs(n.eqn):
            _tags_in(sub, n.primitive, n.layer, out)
    return out


def _tags_in(jaxpr: Any, unit: str, layer: str, out: list[tuple[str, str, str]]) -> None:
    """:func:`offload_tags_out_of_reach`'s walk of one body, nested bodies included."""
    for e in jaxpr.eqns:
        name = str(e.params.get("name", "")) if e.primitive.name == "name" else ""
        if name.startswith(OFFLOAD_PREFIX):
            out.append((name[len(OFFLOAD_PREFIX):], unit, layer))
        for sub in _jax.sub_jaxprs(e):
            _tags_in(sub, unit, layer, out)
