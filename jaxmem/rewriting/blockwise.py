"""Per-block ``jax.checkpoint`` of a loss, its blocks read from the name stack.

What a user gets by editing the model (``nn.remat`` / ``nnx.remat`` / ``eqx.filter_checkpoint``
around every block, with a policy such as ``dots_saveable``), done to the unedited loss:
:func:`checkpoint_blocks` traces the loss, cuts its top-level equations into the runs that
share a layer-path prefix (one *block*: ``blocks/3``, ``Block_3``), and evaluates each run
under ``jax.checkpoint(policy=...)``. JAX's own partial evaluation then decides what each
block keeps for the backward pass, exactly as for the edited model; nothing is rewritten by
jaxmem. ``jaxmem.optimize`` compiles this as one of its candidates (``"jax.checkpoint per
block"``), so that its automatic plan is never above the per-block built-in policy on the
step's compiler, where the step's names give blocks.

Blocks are found at the shallowest layer-path depth at which at least three distinct
prefixes hold a heavy equation (matmul, convolution), none more than half of them
(:func:`depths`; :func:`jaxmem.planning.strategies.block_depths` cuts a whole program the same way,
``balanced=True``). Every run with a prefix is checkpointed, light ones too (a stem's
BatchNorm under a name of its own: on the bottleneck ResNet, H100 target, batch 38, leaving
it out compiled 4.7 MiB above ``nn.remat(nothing_saveable)`` around the blocks, with it the
same bytes to 256). Equations outside every block (the embedding's key split, the loss
head) and equations with effects run as they are.
A loss whose name stack gives fewer than three blocks is left as it is, and says so
(:func:`checkpoint_blocks` records ``None``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem import _jax
from jaxmem.tracing.blocks import block_depth, blocks_of, depths

__all__ = ["block_depth", "blocks_of", "checkpoint_blocks", "depths"]

def _bind(eqn: Any, ins: Sequence[Any], prefix: Any) -> list[Any]:
    """Bind ``eqn`` on ``ins`` under its traceback and name stack (after ``prefix``)."""
    with _jax.user_context(eqn.source_info.traceback,
                           _jax.concat_name_stack(prefix, _jax.name_stack(eqn))):
        return _jax.bind(eqn, *ins)


def _read(env: dict[Any, Any], x: Any) -> Any:
    return _jax.literal_value(x) if _jax.is_literal(x) else env[x]


def _run(eqns: Sequence[Any], env: dict[Any, Any], prefix: Any) -> None:
    """Bind ``eqns`` in order, reading and writing their values in ``env``."""
    for eqn in eqns:
        outs = _bind(eqn, [_read(env, x) for x in eqn.invars], prefix)
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not _jax.is_dropvar(v):
                env[v] = o


def _evaluate(closed: Any, args: Sequence[Any], policy: Any, depth: int) -> list[Any]:
    """Evaluate ``closed`` on ``args`` with each block's run under ``jax.checkpoint``."""
    jaxpr = closed.jaxpr
    prefix = _jax.current_name_stack()
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    runs = blocks_of(jaxpr, depth)
    # A value a later run or the outputs read is an output of the run that makes it.
    read_after: list[set[Any]] = [set() for _ in runs]
    later = {v for v in jaxpr.outvars if not _jax.is_literal(v)}
    for i in range(len(runs) - 1, -1, -1):
        read_after[i] = set(later)
        for eqn in runs[i][1]:
            later.update(v for v in eqn.invars if not _jax.is_literal(v))
    for (key, eqns), after in zip(runs, read_after, strict=True):
        if key is None:
            _run(eqns, env, prefix)
            continue
        made: set[Any] = set()
        ins: list[Any] = []
        for eqn in eqns:
            for x in eqn.invars:
                if not _jax.is_literal(x) and x not in made and x not in ins:
                    ins.append(x)
            made.update(v for v in eqn.outvars if not _jax.is_dropvar(v))
        outs = [v for e in eqns for v in e.outvars if v in after and not _jax.is_dropvar(v)]

        def block(*xs: Any, eqns: list[Any] = eqns, ins: list[Any] = ins,
                  outs: list[Any] = outs) -> list[Any]:
            local = dict(zip(ins, xs, strict=True))
            _run(eqns, local, _jax.current_name_stack())
            return [local[v] for v in outs]

        with _jax.extend_name_stack("/".join(key)):
            env.update(zip(outs, jax.checkpoint(block, policy=policy)(
                *[_read(env, x) for x in ins]), strict=True))
    return [_read(env, v) for v in jaxpr.outvars]


def checkpoint_blocks(fun: Callable[..., Any], policy: Any,
                      found: list[int | None] | None = None) -> Callable[..., Any]:
    """``fun`` with each of its blocks under ``jax.checkpoint(policy=policy)``.

    The same values and derivatives as ``fun``: each block's equations run as traced, and
    ``jax.checkpoint`` only changes what the backward pass keeps. ``found``: if given, the
    block depth of each trace is appended to it (``None``: fewer than :data:`MIN_BLOCKS`
    blocks, and ``fun`` ran as it is).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def loss(ws, x):
      ...     for i, w in enumerate(ws):
      ...         with jax.named_scope(f"block{i}"):
      ...             x = x + jnp.tanh(x @ w)
      ...     return jnp.sum(x ** 2)
      >>> ws, x = [jnp.eye(4) * 0.5] * 3, jnp.ones((2, 4))
      >>> g = jax.grad(checkpoint_blocks(loss, jax.checkpoint_policies.dots_saveable))(ws, x)
      >>> bool(jnp.allclose(g[0], jax.grad(loss)(ws, x)[0]))
      True
    """

    @functools.wraps(fun)
    def blocked(*args: Any, **kwargs: Any) -> Any:
        closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args, **kwargs)
        depth = block_depth(closed.jaxpr)
        if found is not None:
            found.append(depth)
        if depth is None:
            return fun(*args, **kwargs)
        flat = jax.tree_util.tree_leaves((args, kwargs))
        outs = _evaluate(closed, flat, policy, depth)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)

    return blocked
