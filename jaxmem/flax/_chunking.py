"""Flax wrappers that run a submodule's ``__call__`` chunk by chunk (see :func:`jaxmem.chunked`).

- :func:`linen_chunked` (exported as ``jaxmem.flax.linen.chunked``): a lifted transform, like
  ``nn.remat``: give it a module class (or instance) and get one whose ``__call__`` is a
  checkpointed ``nn.scan`` over chunks. Parameters keep their names and shapes: the wrapped
  module's variables are the unwrapped module's.
- :func:`nnx_chunked` (exported as ``jaxmem.flax.nnx.chunked``): wraps an nnx module
  instance; the wrapper splits the module, scans the pure function over chunks and writes
  the module's non-parameter state (RNG counts, batch statistics) back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxmem.memory.chunked import (
    _BCAST,
    _DEFAULT,
    _arg_names,
    _layout,
    _leaf_axes,
    _named_leaves,
    _out_axes,
    _run,
    _stack,
    _unstack,
)

__all__ = ["linen_chunked", "nnx_chunked", "NnxChunked"]


def _out_axes_default(axis: int, out_axes: Any, reduce: str | None) -> Any:
    if reduce not in (None, "sum"):
        raise ValueError(f"chunked: reduce must be None or 'sum'; got {reduce!r}.")
    if reduce == "sum":
        return None
    return axis if out_axes is _DEFAULT else out_axes


# --- linen -------------------------------------------------------------------------------------


def _linen_chunked_call(
    orig: Callable[..., Any],
    *,
    chunks: int,
    in_axes: Any,
    out_axes: Any,
    remat: bool,
    policy: Callable[..., Any] | None,
    prevent_cse: bool,
    variable_broadcast: Any,
    split_rngs: Mapping[str, bool],
) -> Callable[..., Any]:
    """The ``__call__`` of :func:`linen_chunked`'s class: ``orig`` through an ``nn.scan`` over
    chunks (plus one call for a shorter last chunk), outputs concatenated or summed."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        names = _arg_names(orig, len(args) + 1)[1:]
        leaves, treedef = jax.tree_util.tree_flatten(args)
        axes = _leaf_axes(args, in_axes, names)
        layout, axes = _layout(_named_leaves(args, names), leaves, axes, chunks)
        cut = [i for i, a in enumerate(axes) if a is not _BCAST]

        def call(mdl: nn.Module, chunk: list[Any]) -> Any:
            full = list(leaves)
            for i, x in zip(cut, chunk, strict=True):
                full[i] = x
            return orig(mdl, *jax.tree_util.tree_unflatten(treedef, full), **kwargs)

        def body(mdl: nn.Module, carry: Any, chunk: list[Any]) -> tuple[Any, Any]:
            return carry, call(mdl, chunk)

        def tail_call(mdl: nn.Module, chunk: list[Any]) -> Any:
            return call(mdl, chunk)

        if remat:
            body = nn.remat(body, prevent_cse=prevent_cse, policy=policy)
            tail_call = nn.remat(tail_call, prevent_cse=prevent_cse, policy=policy)
        scan = nn.scan(
            body,
            variable_broadcast=variable_broadcast,
            split_rngs=split_rngs,
            length=layout.full,
            in_axes=0,
            out_axes=0,
        )
        _, ys = scan(self, 0, [_stack(leaves[i], axes[i], layout) for i in cut])
        y_leaves, out_tree = jax.tree_util.tree_flatten(ys)
        oaxes = _out_axes(ys, out_axes)
        outs = []
        for y, a in zip(y_leaves, oaxes, strict=True):
            outs.append(y.sum(0) if a is _BCAST else _unstack(y, a % (y.ndim - 1), layout))
        if layout.tail:
            lo, hi = layout.n - layout.tail, layout.n
            tail = [lax.slice_in_dim(leaves[i], lo, hi, axis=axes[i]) for i in cut]
            t_leaves = jax.tree_util.tree_leaves(tail_call(self, tail))
            outs = [
                o + t if a is _BCAST else jnp.concatenate([o, t], axis=a % t.ndim)
                for o, t, a in zip(outs, t_leaves, oaxes, strict=True)
            ]
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return __call__


def linen_chunked(
    target: type[nn.Module] | nn.Module,
    *,
    chunks: int,
    axis: int = 0,
    in_axes: Any = _DEFAULT,
    out_axes: Any = _DEFAULT,
    reduce: Literal["sum"] | None = None,
    remat: bool = True,
    policy: Callable[..., Any] | None = None,
    prevent_cse: bool = True,
    variable_broadcast: Any = "params",
    split_rngs: Mapping[str, bool] | None = None,
) -> Any:
    """A linen module whose ``__call__`` runs chunk by chunk along ``axis`` (lifted transform).

    Like ``nn.remat(MLP)``: ``jaxmem.flax.linen.chunked(MLP, chunks=8)`` is a module class with
    ``MLP``'s fields, parameters and outputs, whose ``__call__`` cuts its positional arguments
    into ``chunks`` pieces along ``axis`` and runs them through an ``nn.scan`` of an
    ``nn.remat`` body (plus one call for a shorter last piece when ``chunks`` does not divide
    the axis). Parameters are broadcast to every chunk (``variable_broadcast="params"``); by
    default each chunk draws its own ``dropout`` RNG (``split_rngs={"params": False,
    "dropout": True}``), so dropout masks differ between chunks as they would across the
    rows of an unchunked call (but are not the same bits).

    ``in_axes``, ``out_axes``, ``reduce``, ``remat``, ``policy`` and ``prevent_cse`` mean what
    they mean for :func:`jaxmem.chunked`; keyword arguments (``deterministic=...``) are passed
    whole. ``reduce="sum"`` here stacks the chunks' outputs and then adds them (``chunks``
    copies of the summed output are live at once). Variables other than parameters (e.g.
    ``batch_stats``) would need ``variable_broadcast``/``variable_carry`` choices and are not
    supported. Give an instance to get an instance with the same fields.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmem.flax
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return nn.Dense(4)(nn.gelu(nn.Dense(64)(x)))
      >>> ChunkedMLP = jaxmem.flax.linen.chunked(MLP, chunks=4)
      >>> x = jnp.ones((32, 4))
      >>> params = MLP().init(jax.random.key(0), x)
      >>> y = ChunkedMLP().apply(params, x)     # same parameters, same output
      >>> bool(jnp.allclose(y, MLP().apply(params, x), atol=1e-6))
      True
    """
    if isinstance(target, nn.Module):
        cls = linen_chunked(
            type(target), chunks=chunks, axis=axis, in_axes=in_axes, out_axes=out_axes,
            reduce=reduce, remat=remat, policy=policy, prevent_cse=prevent_cse,
            variable_broadcast=variable_broadcast, split_rngs=split_rngs,
        )
        fields = {
            f.name: getattr(target, f.name)
            for f in dataclasses.fields(target)
            if f.init and f.name not in ("parent",)
        }
        return cls(**fields)
    if not (isinstance(target, type) and issubclass(target, nn.Module)):
        raise TypeError(
            f"jaxmem.flax.linen.chunked: expected a flax.linen Module class or instance, got "
            f"{target!r}; for an nnx module use jaxmem.flax.nnx.chunked."
        )
    out_axes = _out_axes_default(axis, out_axes, reduce)
    in_axes = axis if in_axes is _DEFAULT else in_axes
    split_rngs = {"params": False, "dropout": True} if split_rngs is None else dict(split_rngs)
    orig = target.__call__
    __call__ = _linen_chunked_call(
        orig, chunks=chunks, in_axes=in_axes, out_axes=out_axes, remat=remat, policy=policy,
        prevent_cse=prevent_cse, variable_broadcast=variable_broadcast, split_rngs=split_rngs,
    )
    __call__.__doc__ = orig.__doc__
    return type(
        f"Chunked{target.__name__}",
        (target,),
        {"__call__": __call__, "__module__": target.__module__},
    )


# --- nnx ---------------------------------------------------------------------------------------


class NnxChunked(nnx.Module):
    """An nnx module that calls ``module`` chunk by chunk; see :func:`nnx_chunked`."""

    def __init__(
        self,
        module: nnx.Module,
        *,
        chunks: int,
        axis: int = 0,
        in_axes: Any = _DEFAULT,
        out_axes: Any = _DEFAULT,
        reduce: Literal["sum"] | None = None,
        remat: bool = True,
        policy: Callable[..., Any] | None = None,
        prevent_cse: bool = True,
        prefetch: bool = False,
    ):
        self.module = module
        self._opts = dict(
            chunks=chunks,
            in_axes=axis if in_axes is _DEFAULT else in_axes,
            out_axes=_out_axes_default(axis, out_axes, reduce),
            remat=remat,
            policy=policy,
            prevent_cse=prevent_cse,
            prefetch=prefetch,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        o = self._opts
        call = type(self.module).__call__
        names = _arg_names(call, len(args) + 1)[1:]
        leaves, treedef = jax.tree_util.tree_flatten(args)
        axes = _leaf_axes(args, o["in_axes"], names)
        layout, axes = _layout(_named_leaves(args, names), leaves, axes, o["chunks"])
        graphdef, params, rest = nnx.split(self.module, nnx.Param, ...)

        def body(state: Any, chunk_leaves: list[Any]) -> tuple[Any, Any]:
            m = nnx.merge(graphdef, params, state)
            out = m(*jax.tree_util.tree_unflatten(treedef, chunk_leaves), **kwargs)
            return nnx.split(m, nnx.Param, ...)[2], out

        rest, out = _run(
            body, rest, leaves, axes, layout,
            out_axes=o["out_axes"], out_names=type(self.module).__name__,
            remat=o["remat"], policy=o["policy"], prevent_cse=o["prevent_cse"],
            prefetch=o["prefetch"], unroll=1,
        )
        nnx.update(self.module, rest)
        return out


def nnx_chunked(module: nnx.Module, **options: Any) -> NnxChunked:
    """Wrap an nnx module so its ``__call__`` runs chunk by chunk (see :func:`jaxmem.chunked`).

    ``jaxmem.flax.nnx.chunked(mlp, chunks=8)`` returns a module holding ``mlp`` (as
    ``.module``) whose call cuts the positional arguments into ``chunks`` pieces along
    ``axis`` and runs ``mlp`` on each inside a ``lax.scan`` with a checkpointed body. The
    parameters are passed whole to every chunk; the rest of the module's state (RNG stream
    counts, batch statistics) is carried from chunk to chunk and written back, so each chunk
    draws fresh dropout bits (batch statistics are updated once per chunk, not once per
    call). Keyword arguments are passed whole; pass RNGs at construction
    (``nnx.Dropout(0.1, rngs=rngs)``), not as call arguments. Options: ``chunks``, ``axis``,
    ``in_axes``, ``out_axes``, ``reduce``, ``remat``, ``policy``, ``prevent_cse``,
    ``prefetch``, as for :func:`jaxmem.chunked`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem.flax
      >>> from flax import nnx
      >>> mlp = nnx.Sequential(nnx.Linear(4, 64, rngs=nnx.Rngs(0)), nnx.gelu,
      ...                      nnx.Linear(64, 4, rngs=nnx.Rngs(1)))
      >>> x = jnp.ones((32, 4))
      >>> wrapped = jaxmem.flax.nnx.chunked(mlp, chunks=4)
      >>> bool(jnp.allclose(wrapped(x), mlp(x), atol=1e-6))
      True
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"jaxmem.flax.nnx.chunked: expected an nnx.Module instance, got {module!r}; for a "
            "linen module use jaxmem.flax.linen.chunked."
        )
    return NnxChunked(module, **options)
