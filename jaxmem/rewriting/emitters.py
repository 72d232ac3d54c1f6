"""What the rewrite's replay emits through (fourth box).

:class:`jaxmem.rewriting.rewrite._Replay` walks a program and emits, for each node, its
primitive bound again (or its substitute), ``optimization_barrier``\\ s and copies between
memory spaces. It does so through an *emitter*: :class:`Traced` under a JAX trace (the
rewrite that is compiled), :class:`jaxmem.rewriting.symbolic.Symbolic` onto a program under
construction (the rewrite that is analysed, without a trace).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from jaxmem import _jax
from jaxmem.tracing.program import Node

__all__ = ["Traced"]


class Traced:
    """What the replay emits through, when JAX traces it: each node's primitive bound
    again under its name stack and traceback, ``lax.optimization_barrier`` and
    ``jax.device_put`` between memory spaces. :class:`jaxmem.rewriting.symbolic.Symbolic`
    builds the same program's nodes without JAX tracing anything."""

    def bind(self, eqn: Any, ins: list[Any]) -> list[Any]:
        return _jax.bind(eqn, *ins)

    def substitute(self, fn: Callable[..., list[Any]], ins: list[Any]) -> list[Any]:
        return fn(*ins)

    def barrier(self, tree: Any) -> Any:
        return lax.optimization_barrier(tree)

    def to_host(self, x: Any) -> Any:
        return jax.device_put(x, _jax.host_space())

    def to_device(self, x: Any) -> Any:
        return jax.device_put(x, _jax.device_space())

    def context(self, n: Node) -> Any:
        return _jax.user_context(n.eqn.source_info.traceback, n.stack)

    def const(self, v: Any) -> Any:
        return v.const
