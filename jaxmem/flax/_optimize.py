"""``jaxmem.flax.nnx.optimize``: :func:`jaxmem.optimize` with ``nnx.jit``'s semantics.

An nnx train step mutates its arguments: ``optimizer.update(model, grads)`` writes new
parameters into the model's Variables, BatchNorm writes its running statistics, ``nnx.Rngs``
advance their counters. A jit-like transform must thread that state through the compiled
function and write it back, as ``nnx.jit`` does. This module does it with nnx's public
graph API: ``nnx.split`` of every graph node among the arguments (jointly, so a Variable
shared by two nodes is one input), a pure step that ``nnx.merge``-s them, runs the user's
step and ``nnx.split``-s them again, :func:`jaxmem.optimize` on that pure step, and
``nnx.update`` of the caller's own objects with the new state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxmem.optimized import Optimized
from jaxmem.planning.plan import Plan
from jaxmem.tracing.arguments import is_nnx_node


class NnxOptimized:
    """An nnx train step wrapped by :func:`optimize`. Call it like the original step."""

    def __init__(self, fn: Callable[..., Any], *, donate: bool = True,
                 **optimize_kwargs: Any) -> None:
        for k in ("static_argnums", "static_argnames", "donate_argnums"):
            if k in optimize_kwargs:
                raise TypeError(
                    f"jaxmem.flax.nnx.optimize does not take {k}: graph nodes are split into "
                    "their state (traced) and graph definition (static), other arguments are "
                    "traced; pass Python configuration through functools.partial, and "
                    "donate=False to keep the Variables' old arrays alive")
        self.fn = fn
        self.donate = donate
        # Dynamic arguments of the pure step: (state, leaves); index 0 is the static part.
        def pure(static: _Static, state: Any, leaves: Sequence[Any]) -> Any:
            return self._pure(static, state, leaves)
        pure.__name__ = pure.__qualname__ = getattr(fn, "__name__", "step")
        self._optimized = Optimized(pure, static_argnums=(0,),
                                    donate_argnums=(0,) if donate else (),
                                    **optimize_kwargs)
        functools.update_wrapper(self, fn)

    # -- public -----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        nodes, static, state, leaves = _split(args, kwargs)
        out, new_state = self._optimized(static, state, leaves)
        nnx.update(nodes, jax.tree_util.tree_unflatten(static.statedef, new_state))
        return out

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The :class:`~jaxmem.planning.plan.Plan` for these arguments, with compiled figures."""
        _, static, state, leaves = _split(args, kwargs)
        return self._optimized.plan(static, state, leaves)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Like ``nnx.jit(f).lower``; ``.compile()`` applies jaxmem's compiler options."""
        _, static, state, leaves = _split(args, kwargs)
        return self._optimized.lower(static, state, leaves)

    def analysis(self, *args: Any, **kwargs: Any) -> Any:
        """The :class:`~jaxmem.analyzing.analysis.Analysis` the plan was made from."""
        _, static, state, leaves = _split(args, kwargs)
        return self._optimized.analysis(static, state, leaves)

    # -- the pure step jaxmem optimises -----------------------------------------------------
    def _pure(self, static: _Static, state: Any, leaves: Sequence[Any]) -> Any:
        nodes = nnx.merge(static.graphdef,
                          jax.tree_util.tree_unflatten(static.statedef, state))
        it_nodes, it_leaves = iter(nodes), iter(leaves)
        flat = [next(it_nodes) if is_node else next(it_leaves) for is_node in static.mask]
        args, kwargs = jax.tree_util.tree_unflatten(static.treedef, flat)
        out = self.fn(*args, **kwargs)
        name = getattr(self.fn, "__name__", "fn")
        for path, leaf in jax.tree_util.tree_flatten_with_path(out, is_leaf=is_nnx_node)[0]:
            if is_nnx_node(leaf):
                raise TypeError(
                    f"jaxmem.flax.nnx.optimize({name}) returned an nnx graph node at "
                    f"{jax.tree_util.keystr(path) or 'the top level'} ({type(leaf).__name__}); "
                    "return arrays (the loss, metrics) and let the step update the model and "
                    "optimizer it was given in place: those updates are written back")
        graphdef, new_state = nnx.split(nodes)
        new_state, statedef = jax.tree_util.tree_flatten(new_state)
        if graphdef != static.graphdef or statedef != static.statedef:
            raise ValueError(
                f"jaxmem.flax.nnx.optimize({name}) changed the structure of its modules "
                "(added, removed or replaced a submodule or Variable); only Variable values "
                "may change inside an optimized step. Make the structural change outside it.")
        return out, new_state


class _Static:
    """Hashable static part of an nnx call: the graph definition of its nodes, the structure
    of their state (its leaves are the traced arrays: no Variable reaches the jaxpr), and
    where in the argument tree the nodes and the other leaves sit."""

    def __init__(self, graphdef: Any, statedef: Any, treedef: Any,
                 mask: tuple[bool, ...]) -> None:
        self.graphdef, self.statedef, self.treedef, self.mask = graphdef, statedef, treedef, mask

    def _key(self) -> Any:
        return (self.graphdef, self.statedef, self.treedef, self.mask)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key() == other._key()


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list, _Static, Any, list]:
    flat, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)), is_leaf=is_nnx_node)
    mask = tuple(is_nnx_node(x) for x in flat)
    nodes = [x for x, m in zip(flat, mask, strict=True) if m]
    leaves = [x for x, m in zip(flat, mask, strict=True) if not m]
    graphdef, state = nnx.split(nodes)
    state, statedef = jax.tree_util.tree_flatten(state)
    return nodes, _Static(graphdef, statedef, treedef, mask), state, leaves


def optimize(fn: Callable[..., Any] | None = None, *, donate: bool = True,
             **optimize_kwargs: Any) -> Any:
    """:func:`jaxmem.optimize` for nnx train steps, with ``nnx.jit``'s semantics.

    Modules, optimizers and Variables among the arguments are passed by reference: what the
    step writes into them (``optimizer.update(model, grads)``, BatchNorm statistics, RNG
    counters) is written back into the caller's objects after the call, and a Variable
    shared between two of them stays shared. The step itself is optimised like any train
    step (recompute or offload per residual, budgets, ``.plan``).

    Args:
      fn: the train step; works as a decorator, with or without arguments.
      donate: donate the nodes' state to the step (default), so XLA updates parameters and
        optimizer state in place: the arrays the Variables held before the call are deleted.
        ``False`` keeps them alive (``nnx.jit``'s default), at the cost of a second copy.
      **optimize_kwargs: ``budget``, ``offload``, ``strategy``, ``verify``, ... as in
        :func:`jaxmem.optimize`.

    Returns:
      A callable like ``nnx.jit(fn)``, with ``.plan``, ``.lower`` and ``.analysis``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmem
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> @jaxmem.flax.nnx.optimize
      ... def train_step(model, optimizer, x, y):
      ...     loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
      ...     loss, grads = nnx.value_and_grad(loss_fn)(model)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> loss = train_step(model, optimizer, jnp.ones((3, 4)), jnp.zeros((3, 2)))
    """
    if fn is None:
        return lambda f: NnxOptimized(f, donate=donate, **optimize_kwargs)
    if not callable(fn):
        raise TypeError(f"optimize expects a callable, got {type(fn).__name__}")
    return NnxOptimized(fn, donate=donate, **optimize_kwargs)
