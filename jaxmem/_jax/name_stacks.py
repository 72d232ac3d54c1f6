"""Name stacks (bottom layer, :mod:`jaxmem._jax`): the semi-private
``source_info.name_stack`` of an equation, read and re-emitted.

Reading: the transforms (``jvp``, ``transpose``) that say whether an equation is forward or
backward, and the user scopes (flax module paths, ``jax.named_scope``) that say which layer
made it. Re-emitting: binding under an equation's traceback and name stack, an inlined
equation's stack (outer + inner), and the stack JAX is binding under right now, so that
profiles of a rewritten program keep reading like the original.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jax._src import source_info_util as _siu

from jaxmem._jax.jaxprs import JaxprEqn


def name_stack(eqn: JaxprEqn) -> Any:
    """The equation's ``NameStack`` (semi-private ``source_info.name_stack``)."""
    return eqn.source_info.name_stack


def transforms(eqn: JaxprEqn) -> tuple[str, ...]:
    """Names of the transforms in an equation's name stack, outermost first."""
    return tuple(
        s.name for s in name_stack(eqn).stack if type(s).__name__ == "Transform"
    )


def scopes(eqn: JaxprEqn) -> tuple[str, ...]:
    """User scopes (flax module paths, ``jax.named_scope``) in an equation's name stack."""
    out = []
    for s in name_stack(eqn).stack:
        if type(s).__name__ == "Scope":
            out.extend(p for p in s.name.split("/") if p)
    return tuple(out)


def name_stack_str(eqn: JaxprEqn) -> str:
    return str(name_stack(eqn))


def is_backward(eqn: JaxprEqn) -> bool:
    """True for equations made by transposition (the backward pass)."""
    return "transpose" in transforms(eqn)


def is_forward(eqn: JaxprEqn) -> bool:
    """True for equations made by the JVP that are not transposed (the forward pass)."""
    t = transforms(eqn)
    return "jvp" in t and "transpose" not in t


@contextlib.contextmanager
def source_context(eqn: JaxprEqn) -> Iterator[None]:
    """Re-emit under the equation's traceback and name stack, so profiles keep reading."""
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack(eqn)):
        yield


@contextlib.contextmanager
def extend_name_stack(name: str) -> Iterator[None]:
    with _siu.extend_name_stack(name):
        yield


def concat_name_stack(outer: Any, inner: Any) -> Any:
    """The name stack of an equation inlined from a nested jaxpr (outer + inner)."""
    import dataclasses

    return dataclasses.replace(outer, stack=tuple(outer.stack) + tuple(inner.stack))


def transforms_of(stack: Any) -> tuple[str, ...]:
    return tuple(s.name for s in stack.stack if type(s).__name__ == "Transform")


def scopes_of(stack: Any) -> tuple[str, ...]:
    out: list[str] = []
    for s in stack.stack:
        if type(s).__name__ == "Scope":
            out.extend(p for p in s.name.split("/") if p)
    return tuple(out)


@contextlib.contextmanager
def user_context(traceback: Any, stack: Any) -> Iterator[None]:
    """Bind primitives under a given traceback and name stack."""
    with _siu.user_context(traceback, name_stack=stack):
        yield


def current_name_stack() -> Any:
    """The name stack JAX is binding under right now (outer transforms and scopes)."""
    return _siu.current_name_stack()
