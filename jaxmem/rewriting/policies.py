"""``jax.checkpoint`` policies that apply jaxmem's decisions (MEDL's rule and jaxmem plans).

Fourth box of the data flow for code still to be differentiated (``Plan -> jax.checkpoint
policy``), beside the joint rewrite of :mod:`jaxmem.rewriting.rewrite`. A policy is what
``jax.checkpoint(fn, policy=...)``, ``flax.linen.remat`` and ``nnx.remat`` take: a function
called once per primitive of the differentiated body as ``policy(primitive, *input_avals,
**params)``, answering whether that primitive's outputs may be kept for the backward pass
(``Saveable`` / ``True``), must be recomputed (``Recompute`` / ``False``) or moved to host
memory (``Offloadable(src, dst)``). A policy sees no name stack and no module path: identity
comes only from ``jax.ad_checkpoint.checkpoint_name`` tags.

- :func:`utility` — MEDL's rule (:func:`jaxmem.planning.strategies.medl_keeps`) by primitive: keep
  the outputs of *heavy* layers (matmuls, convolutions; see :mod:`jaxmem.primitives`),
  recompute the outputs of *utility* layers (activations, normalisation, dropout, adds,
  pooling) and of free ones (reshapes, casts).
  Batched matmuls (``dot_general`` with batch dimensions, e.g. attention scores
  ``[B, H, T, T]``) count as heavy and are kept: recomputing them costs a matmul, and this is
  what ``jax.checkpoint_policies.dots_saveable`` does too.
- :func:`utility_no_batch_dims` — the same, but batched matmuls (attention scores and the
  attention-weighted sum) are recomputed: less memory for long sequences, more FLOPs (the
  semantics of ``dots_with_no_batch_dims_saveable``; convolutions are still kept).
- :func:`save_heavy_and_names` — :func:`utility` plus named values to keep or offload.
- :func:`from_plan` — the policy that carries out a :class:`jaxmem.Plan` made by
  :func:`jaxmem.checkpoint` (save / recompute / offload each tagged value).
- :func:`combine` — keep a value if any of several policies keeps it (offload wins over
  recompute); composes with ``jax.checkpoint_policies``.

Unknown primitives (in no table of :mod:`jaxmem.primitives`) and collectives are kept: the
conservative choice, as in :func:`jaxmem.planning.strategies.plan_auto`.

Example:
  >>> import jax, jax.numpy as jnp, jaxmem.policies
  >>> block = lambda w, x: jnp.tanh(x @ w) * 2.0
  >>> f = jax.checkpoint(block, policy=jaxmem.policies.utility)
  >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
  >>> g = jax.grad(lambda w: f(w, x).sum())(w)
  >>> bool(jnp.allclose(g, jax.grad(lambda w: block(w, x).sum())(w)))
  True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from jaxmem import _jax
from jaxmem.planning.plan import Decision, Plan
from jaxmem.planning.strategies import medl_keeps_primitive

__all__ = [
    "Policy", "TAG_PREFIX", "combine", "from_plan", "is_jaxmem_tag", "save_heavy_and_names",
    "tag", "utility", "utility_no_batch_dims",
]

#: A ``jax.checkpoint`` policy: ``policy(primitive, *input_avals, **params)``.
Policy = Callable[..., Any]

#: Prefix of the ``checkpoint_name`` tags that :func:`jaxmem.checkpoint` inserts.
TAG_PREFIX = "jaxmem#"

_HOST = Offloadable(src="device", dst="pinned_host")


def tag(value: int) -> str:
    """The ``checkpoint_name`` jaxmem gives value ``value`` of a traced function.

    Example:
      >>> tag(3)
      'jaxmem#3'
    """
    return f"{TAG_PREFIX}{int(value)}"


def is_jaxmem_tag(name: str) -> bool:
    """Whether ``name`` is a tag inserted by :func:`jaxmem.checkpoint`."""
    return isinstance(name, str) and name.startswith(TAG_PREFIX)


def _keep_by_primitive(prim: Any, params: dict[str, Any], batched_dots: bool) -> bool:
    if prim is _jax.name_p:
        return False  # the tagged value's producer decides
    return medl_keeps_primitive(getattr(prim, "name", str(prim)), params,
                                batched_dots=batched_dots)


def utility(prim: Any, *avals: Any, **params: Any) -> Any:
    """MEDL's rule as a ``jax.checkpoint`` policy: keep heavy outputs, recompute the rest.

    Saveable: ``dot_general`` (batched ones too), ``conv_general_dilated`` and the other
    heavy primitives of :mod:`jaxmem.primitives`, plus unknown primitives. Recompute:
    elementwise ops, reductions (normalisation statistics), dropout masks, pooling,
    reshapes. ``checkpoint_name`` tags are recomputed from their producer (free), so a
    tag never changes this policy's decision; use :func:`save_heavy_and_names` for that.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem.policies
      >>> from jax.ad_checkpoint import Saveable, Recompute
      >>> from jax.extend.core.primitives import dot_general_p, tanh_p
      >>> jaxmem.policies.utility(dot_general_p) is Saveable
      True
      >>> jaxmem.policies.utility(tanh_p) is Recompute
      True
    """
    del avals
    return Saveable if _keep_by_primitive(prim, params, batched_dots=True) else Recompute


def utility_no_batch_dims(prim: Any, *avals: Any, **params: Any) -> Any:
    """:func:`utility`, but matmuls with batch dimensions (attention) are recomputed.

    Attention scores ``[B, H, T, T]`` grow with the square of the sequence length; this
    policy recomputes them (and the attention-weighted sum) in the backward pass, trading
    two batched matmuls per layer for that memory. Convolutions are still kept.
    """
    del avals
    return Saveable if _keep_by_primitive(prim, params, batched_dots=False) else Recompute


def _names(names: Iterable[str] | str | None, what: str) -> frozenset[str]:
    if names is None:
        return frozenset()
    if isinstance(names, str):
        return frozenset({names})
    out = frozenset(names)
    bad = [n for n in out if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{what} must be checkpoint_name strings, got {bad!r}")
    return out


def save_heavy_and_names(save: Iterable[str] | str | None = None,
                         offload: Iterable[str] | str | None = None,
                         *, batched_dots: bool = True,
                         offload_src: str = "device",
                         offload_dst: str = "pinned_host") -> Policy:
    """:func:`utility` plus values tagged with ``checkpoint_name``: kept, or offloaded.

    Args:
      save: names (``jax.ad_checkpoint.checkpoint_name``) whose values are kept.
      offload: names whose values are moved to ``offload_dst`` after the forward pass and
        brought back for the backward pass (on CPU this is the same as keeping them).
      batched_dots: keep matmuls with batch dimensions (``False``: recompute them, as in
        :func:`utility_no_batch_dims`).

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem.policies
      >>> from jax.ad_checkpoint import checkpoint_name
      >>> policy = jaxmem.policies.save_heavy_and_names(save=["h"])
      >>> f = jax.checkpoint(lambda x: jnp.sin(checkpoint_name(jnp.cos(x), "h")), policy=policy)
      >>> round(float(jax.grad(f)(1.0)), 4)
      -0.7216
    """
    keep, off = _names(save, "save"), _names(offload, "offload")
    both = keep & off
    if both:
        raise ValueError(f"names {sorted(both)} are in both save= and offload=; pick one")
    dst = Offloadable(src=offload_src, dst=offload_dst)

    def policy(prim: Any, *avals: Any, **params: Any) -> Any:
        if prim is _jax.name_p:
            name = params.get("name")
            if name in off:
                return dst
            return Saveable if name in keep else Recompute
        return Saveable if _keep_by_primitive(prim, params, batched_dots) else Recompute

    policy.__name__ = "save_heavy_and_names"
    policy.__qualname__ = policy.__name__
    return policy


def from_plan(plan: Plan, *, fallback: Policy | None = None,
              offload_src: str = "device", offload_dst: str = "pinned_host") -> Policy:
    """The policy that carries out ``plan``: SAVE / RECOMPUTE / OFFLOAD per tagged value.

    ``plan`` is one made by :func:`jaxmem.checkpoint` (``wrapped.plan(*args)``): its
    residuals are values jaxmem tagged ``jaxmem#<value>`` with ``checkpoint_name``. A tag the
    plan saves is ``Saveable``, one it offloads is ``Offloadable(offload_src,
    offload_dst)``, everything else is recomputed, unless ``fallback`` (any other policy,
    e.g. ``jax.checkpoint_policies.dots_saveable``) keeps it.

    Raises:
      TypeError: ``plan`` is not a :class:`jaxmem.Plan`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem.policies
      >>> from jaxmem.rewriting.remat import checkpoint
      >>> f = checkpoint(lambda w, x: jnp.tanh(x @ w))
      >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
      >>> policy = jaxmem.policies.from_plan(f.plan(w, x))
      >>> callable(policy)
      True
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"from_plan expects a jaxmem.Plan (e.g. jaxmem.checkpoint(fn).plan("
                        f"*args)), got {type(plan).__name__}")
    if fallback is not None and not callable(fallback):
        raise TypeError(f"fallback must be a jax.checkpoint policy, got {fallback!r}")
    decisions: dict[str, Decision] = {}
    for c in plan.choices:
        if c.residual.is_activation:
            decisions[tag(c.residual.value)] = c.decision
    dst = Offloadable(src=offload_src, dst=offload_dst)

    def policy(prim: Any, *avals: Any, **params: Any) -> Any:
        if prim is _jax.name_p:
            d = decisions.get(params.get("name"))
            if d is Decision.SAVE:
                return Saveable
            if d is Decision.OFFLOAD:
                return dst
            if d is Decision.RECOMPUTE:
                return Recompute
        if fallback is not None:
            return fallback(prim, *avals, **params)
        return Recompute

    policy.__name__ = "from_plan"
    policy.__qualname__ = policy.__name__
    policy.plan = plan  # type: ignore[attr-defined]
    return policy


def _enum(x: Any) -> Any:
    if x is True or x is Saveable:
        return Saveable
    if x is False or x is Recompute or x is None:
        return Recompute
    if isinstance(x, Offloadable):
        return x
    raise TypeError(f"a remat policy returned {x!r}; expected a bool, Saveable, Recompute "
                    "or an Offloadable(src, dst) instance")


def combine(*policies: Policy) -> Policy:
    """A policy keeping what any of ``policies`` keeps; offload beats recompute.

    Like ``jax.checkpoint_policies.save_from_both_policies``, for any number of policies
    and aware of ``Offloadable``.

    Example:
      >>> import jax, jaxmem.policies
      >>> p = jaxmem.policies.combine(jaxmem.policies.utility,
      ...                             jax.checkpoint_policies.save_only_these_names("h"))
      >>> callable(p)
      True
    """
    if not policies:
        raise ValueError("combine needs at least one policy")
    bad = [p for p in policies if not callable(p)]
    if bad:
        raise TypeError(f"combine: not policies (callables): {bad!r}")

    def policy(prim: Any, *avals: Any, **params: Any) -> Any:
        out = Recompute
        for p in policies:
            r = _enum(p(prim, *avals, **params))
            if r is Saveable:
                return Saveable
            if isinstance(r, Offloadable):
                out = r
        return out

    policy.__name__ = "combine"
    policy.__qualname__ = policy.__name__
    return policy


# JAX's own policies, re-exported for discoverability (``jaxmem.policies.dots_saveable``).
dots_saveable = jax.checkpoint_policies.dots_saveable
nothing_saveable = jax.checkpoint_policies.nothing_saveable
everything_saveable = jax.checkpoint_policies.everything_saveable
