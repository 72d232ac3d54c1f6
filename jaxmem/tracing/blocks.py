"""Blocks read from the name stack: the runs of a jaxpr's equations that share a layer path.

What a user would wrap in ``nn.remat`` / ``nnx.remat`` / ``eqx.filter_checkpoint`` one block at
a time (``blocks/3``, ``Block_3``), found from the names JAX records when the step is traced.
Blocks are found at the shallowest layer-path depth at which at least three distinct
prefixes hold a heavy equation (matmul, convolution), none more than half of them
(:func:`depths`). The planners cut a whole program this way
(:func:`jaxmem.planning.strategies.block_depths`) and :mod:`jaxmem.rewriting.blockwise`
checkpoints a loss block by block along the same cut.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from jaxmem import _jax
from jaxmem.tracing import primitives as P

__all__ = ["MIN_BLOCKS", "block_depth", "blocks_of", "depths"]

#: Fewest blocks worth checkpointing one by one (as ``jaxmem.planning.strategies.block_depths``).
MIN_BLOCKS = 3


def _heavy(eqn: Any) -> bool:
    """Whether an equation is, or holds, a matmul or a convolution."""
    if P.classify(eqn.primitive.name) is P.Kind.HEAVY:
        return True
    return any(_heavy(e) for j in _jax.sub_jaxprs(eqn) for e in j.eqns)


def _key(eqn: Any, depth: int) -> tuple[str, ...] | None:
    scopes = _jax.scopes(eqn)
    if len(scopes) < depth or eqn.effects:
        return None
    return scopes[:depth]


def depths(paths: Sequence[Sequence[str]], *, balanced: bool = True) -> tuple[int, ...]:
    """The layer-path depths that cut heavy equations at ``paths`` into blocks, shallowest
    first: at least :data:`MIN_BLOCKS` distinct prefixes (a path shorter than the depth is
    its own prefix) and, if ``balanced``, none holding more than half of the heavy
    equations (``blocks`` of ``embed / blocks/0..3 / head`` is a list of blocks, not one).

    Example:
      >>> paths = [("embed",), *[("blocks", str(i), "up") for i in range(4)], ("head",)]
      >>> depths(paths), depths(paths, balanced=False)
      ((2, 3), (1, 2, 3))
    """
    paths = [tuple(p) for p in paths]
    deepest = max((len(p) for p in paths), default=0)
    out = []
    for d in range(1, deepest + 1):
        sizes = Counter(p[:d] for p in paths)
        if len(sizes) >= MIN_BLOCKS and (not balanced or 2 * max(sizes.values()) <= len(paths)):
            out.append(d)
    return tuple(out)


def block_depth(jaxpr: Any) -> int | None:
    """The shallowest of :func:`depths` for ``jaxpr``'s top-level heavy equations (an
    equation holding a matmul or convolution counts as one); ``None`` if there is none.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def loss(ws, x):
      ...     for i, w in enumerate(ws):
      ...         with jax.named_scope(f"block{i}"):
      ...             x = x + jnp.tanh(x @ w)
      ...     return jnp.sum(x ** 2)
      >>> block_depth(jax.make_jaxpr(loss)([jnp.eye(4)] * 3, jnp.ones((2, 4))).jaxpr)
      1
    """
    found = depths([_jax.scopes(e) for e in jaxpr.eqns if _heavy(e)])
    return found[0] if found else None


def blocks_of(jaxpr: Any, depth: int) -> list[tuple[tuple[str, ...] | None, list[Any]]]:
    """``jaxpr``'s top-level equations as runs that share a key: a block's layer-path
    prefix at ``depth``, or ``None`` (outside every block, or an equation with effects)."""
    runs: list[tuple[tuple[str, ...] | None, list[Any]]] = []
    for eqn in jaxpr.eqns:
        k = _key(eqn, depth)
        if runs and runs[-1][0] == k:
            runs[-1][1].append(eqn)
        else:
            runs.append((k, [eqn]))
    return runs
