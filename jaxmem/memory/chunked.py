"""Bottleneck layers as chunked, double-buffered scans.

A layer whose working set sets the peak (one very wide dense layer, the LM head and its
softmax over a large vocabulary) does not need all of that working set at once when it is
independent along some axis (batch, tokens, or its own output features). :func:`chunked`
runs such a layer as a ``lax.scan`` over chunks of that axis with a checkpointed body, so the
forward and the backward pass each hold about two chunks of the intermediate instead of all
of it (MEDL's "fine-grained double buffering" for bottleneck layers). :func:`chunked_cross_entropy`
is the reduction form for the LM head: the logits are never materialised, in the forward or
the backward pass (Cut Cross-Entropy, Liger's fused linear cross-entropy, MaxText's
``num_vocab_tiling``).

What overlaps is decided by XLA; see ``docs/chunking.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

# chunked_cross_entropy lives in jaxmem.memory.chunked_ce (its own custom VJP); it is re-exported
# here, where it was first documented.
from jaxmem.memory.chunked_ce import chunked_cross_entropy

__all__ = ["chunked", "chunked_cross_entropy"]


class _Broadcast:
    """Marker for a leaf that is passed whole to every chunk (``in_axes`` None)."""

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return "<broadcast>"


_BCAST = _Broadcast()
_DEFAULT = object()


# --- layout: which leaves are cut, and how ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the chunked axis of length ``n`` is cut: ``full`` pieces of ``size``, one tail."""

    n: int
    size: int
    full: int
    tail: int


def _arg_names(fn: Callable[..., Any], nargs: int) -> list[str]:
    names = [f"args[{i}]" for i in range(nargs)]
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return names
    for i in range(nargs):
        if i < len(params) and params[i].kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names[i] = params[i].name
    return names


def _leaf_axes(args: tuple[Any, ...], in_axes: Any, names: list[str]) -> list[Any]:
    """One entry per leaf of ``args``: an axis (int) or ``_BCAST``. ``in_axes`` is a prefix."""
    if in_axes is None or isinstance(in_axes, int):
        per_arg = [in_axes] * len(args)
    elif isinstance(in_axes, tuple | list):
        if len(in_axes) != len(args):
            raise ValueError(
                f"chunked: in_axes has {len(in_axes)} entries but the function was called "
                f"with {len(args)} positional arguments; give one entry per positional "
                "argument (an int, None to broadcast, or a pytree prefix of the argument)."
            )
        per_arg = list(in_axes)
    else:
        raise TypeError(
            f"chunked: in_axes must be an int, None, or a tuple/list with one entry per "
            f"positional argument; got {type(in_axes).__name__}."
        )
    out: list[Any] = []
    for arg, ax, name in zip(args, per_arg, names, strict=True):
        try:
            full = jax.tree_util.tree_map(
                lambda a, sub: jax.tree_util.tree_map(
                    lambda _: _BCAST if a is None else a, sub
                ),
                ax,
                arg,
                is_leaf=lambda x: x is None,
            )
        except ValueError as e:
            raise ValueError(
                f"chunked: in_axes entry {ax!r} for argument {name!r} is not a pytree prefix "
                f"of that argument ({jax.tree_util.tree_structure(arg)}): {e}"
            ) from None
        out.extend(jax.tree_util.tree_leaves(full))
    return out


def _layout(
    names: list[str], leaves: list[Any], axes: list[Any], chunks: int
) -> tuple[_Layout, list[Any]]:
    """Validate the chunked leaves; return their layout and the normalised axes."""
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"chunked: chunks must be an int >= 1; got {chunks!r}.")
    if chunks < 1:
        raise ValueError(f"chunked: chunks={chunks} is < 1; use chunks >= 1 (1 = no split).")
    n = None
    first = None
    norm: list[Any] = []
    for name, leaf, ax in zip(names, leaves, axes, strict=True):
        if ax is _BCAST:
            norm.append(_BCAST)
            continue
        shape = getattr(leaf, "shape", None)
        if shape is None:
            raise ValueError(
                f"chunked: argument {name} is a {type(leaf).__name__}, not an array, but is "
                f"chunked along axis {ax}; pass None for it in in_axes to broadcast it."
            )
        ndim = len(shape)
        if not -ndim <= ax < ndim:
            raise ValueError(
                f"chunked: argument {name} has shape {tuple(shape)} and no axis {ax} to chunk; "
                f"use an axis in [{-ndim}, {ndim - 1}] for it in in_axes (or None to "
                "broadcast it)."
            )
        ax = ax % ndim
        if n is None:
            n, first = shape[ax], (name, tuple(shape), ax)
        elif shape[ax] != n:
            raise ValueError(
                f"chunked: chunked axes differ in length: argument {first[0]} has shape "
                f"{first[1]} (axis {first[2]} has {n}) but argument {name} has shape "
                f"{tuple(shape)} (axis {ax} has {shape[ax]}); every chunked argument must "
                "have the same length along its chunked axis (use in_axes None for "
                "arguments that are not split, e.g. weights)."
            )
        norm.append(ax)
    if n is None:
        raise ValueError(
            "chunked: no argument is chunked (every in_axes entry is None); chunk at least "
            "one array argument."
        )
    if chunks > n:
        raise ValueError(
            f"chunked: chunks={chunks} is more than the {n} elements along axis {first[2]} of "
            f"argument {first[0]} (shape {first[1]}); use chunks <= {n}."
        )
    size = -(-n // chunks)  # ceil: no piece is bigger than n / chunks rounded up
    full = n // size
    return _Layout(n=n, size=size, full=full, tail=n - full * size), norm


def _named_leaves(args: tuple[Any, ...], names: list[str]) -> list[str]:
    out = []
    for arg, name in zip(args, names, strict=True):
        for path, _ in jax.tree_util.tree_flatten_with_path(arg)[0]:
            out.append(name + jax.tree_util.keystr(path))
    return out


def _stack(x: jax.Array, ax: int, layout: _Layout) -> jax.Array:
    """``x`` without its tail, as ``[full, ..., size, ...]`` (the chunk index leading)."""
    if layout.tail:
        x = lax.slice_in_dim(x, 0, layout.full * layout.size, axis=ax)
    x = x.reshape(x.shape[:ax] + (layout.full, layout.size) + x.shape[ax + 1 :])
    return jnp.moveaxis(x, ax, 0)


def _unstack(y: jax.Array, ax: int, layout: _Layout) -> jax.Array:
    """Inverse of :func:`_stack` for an output: ``[full, .., size, ..]`` -> ``[.., n, ..]``."""
    y = jnp.moveaxis(y, 0, ax)
    return y.reshape(y.shape[:ax] + (layout.full * layout.size,) + y.shape[ax + 2 :])


def _out_axes(out_shape: Any, out_axes: Any) -> list[Any]:
    """One entry per output leaf: an axis or ``_BCAST`` (= summed over chunks)."""
    try:
        full = jax.tree_util.tree_map(
            lambda a, sub: jax.tree_util.tree_map(lambda _: _BCAST if a is None else a, sub),
            out_axes,
            out_shape,
            is_leaf=lambda x: x is None,
        )
    except ValueError as e:
        raise ValueError(
            f"chunked: out_axes {out_axes!r} is not a pytree prefix of the function's output "
            f"({jax.tree_util.tree_structure(out_shape)}): {e}"
        ) from None
    return jax.tree_util.tree_leaves(full)


def _reduced_out_axes(reduce: str | None, out_axes: Any, axis: int) -> Any:
    """:func:`chunked`'s ``out_axes`` once ``reduce`` is applied: ``None`` everywhere (add the
    chunks' values) with ``reduce="sum"``, else as given, by default ``axis``."""
    if reduce not in (None, "sum"):
        raise ValueError(f"chunked: reduce must be None or 'sum'; got {reduce!r}.")
    if reduce == "sum":
        if out_axes is not _DEFAULT and out_axes is not None:
            raise ValueError(
                f"chunked: reduce='sum' adds every output up; do not also give out_axes "
                f"({out_axes!r})."
            )
        return None
    return axis if out_axes is _DEFAULT else out_axes


# --- the loop ----------------------------------------------------------------------------------


def _stage(x: jax.Array) -> jax.Array:
    """Bring a chunk to device memory if it lives on the host (no-op otherwise)."""
    space = getattr(jax.typeof(x), "memory_space", None)
    if space == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def _loop(
    step: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
    xs: Any,
    length: int,
    prefetch: bool,
    unroll: int | bool,
) -> tuple[Any, Any]:
    """``lax.scan(step, carry, xs)``; with ``prefetch`` chunk i+1 is staged while i computes.

    The prefetching form is a software pipeline: the carry holds the already staged input of
    the current chunk; the body computes on it and, independently, slices (and for a host
    resident input, copies to the device) the input of the next chunk. The two are data
    independent inside one loop iteration, which is what lets XLA's scheduler overlap them;
    whether it does is XLA's decision.
    """
    if not prefetch or length < 2:
        return lax.scan(step, carry, xs, length=length, unroll=unroll)
    stage = lambda t: jax.tree_util.tree_map(_stage, t)
    first = stage(jax.tree_util.tree_map(lambda a: a[0], xs))
    rest = jax.tree_util.tree_map(lambda a: a[1:], xs)

    def piped(c, x_next):
        inner, cur = c
        inner, y = step(inner, cur)
        return (inner, stage(x_next)), y

    (carry, last), ys = lax.scan(piped, (carry, first), rest, length=length - 1, unroll=unroll)
    carry, y_last = step(carry, last)
    ys = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b[None]]), ys, y_last)
    return carry, ys


def _checked_out_axes(
    out_shape: Any, out_axes: Any, out_names: str, layout: _Layout
) -> tuple[list[Any], list[Any], Any]:
    """The output leaves' concatenation axes (normalised; ``_BCAST`` = summed), their shapes
    for one chunk and the output tree; a clear error for an axis that is not the chunked one."""
    oaxes = _out_axes(out_shape, out_axes)
    out_leaves_shape, out_tree = jax.tree_util.tree_flatten(out_shape)
    for j, (a, s) in enumerate(zip(oaxes, out_leaves_shape, strict=True)):
        if a is not _BCAST and not -len(s.shape) <= a < len(s.shape):
            raise ValueError(
                f"chunked: output leaf {j} of {out_names} has shape {s.shape} and no axis {a} "
                f"to concatenate the chunks along; set out_axes to an axis in "
                f"[{-len(s.shape)}, {len(s.shape) - 1}] for it, or None (reduce='sum') to add "
                "the chunks' values."
            )
        if a is not _BCAST and s.shape[a % len(s.shape)] != layout.size:
            raise ValueError(
                f"chunked: output leaf {j} of {out_names} has shape {s.shape} for a chunk of "
                f"{layout.size}, so its axis {a} is not the chunked one; set out_axes to the "
                "output axis that follows the input's chunks, or None to add the chunks' values."
            )
    oaxes = [
        a if a is _BCAST else a % len(s.shape)
        for a, s in zip(oaxes, out_leaves_shape, strict=True)
    ]
    return oaxes, out_leaves_shape, out_tree


def _chunk_shapes(
    leaves: list[Any], axes: list[Any], cut: list[int], layout: _Layout
) -> list[jax.ShapeDtypeStruct]:
    """The shapes of one chunk of each cut leaf (``cut``: their positions in ``leaves``)."""
    return [
        jax.ShapeDtypeStruct(
            leaves[i].shape[: axes[i]] + (layout.size,) + leaves[i].shape[axes[i] + 1 :],
            leaves[i].dtype,
        )
        for i in cut
    ]


def _run(
    body: Callable[..., tuple[Any, Any]],
    carry: Any,
    leaves: list[Any],
    axes: list[Any],
    layout: _Layout,
    *,
    out_axes: Any,
    out_names: str,
    remat: bool,
    policy: Callable[..., Any] | None,
    prevent_cse: bool,
    prefetch: bool,
    unroll: int | bool,
) -> tuple[Any, Any]:
    """Run ``body(carry, leaves) -> (carry, out)`` chunk by chunk; concatenate or sum ``out``.

    The engine behind :func:`chunked` and the flax wrappers. ``carry`` is threaded through the
    chunks in order (e.g. the RNG and batch-statistics state of an nnx module).
    """
    cut = [i for i, a in enumerate(axes) if a is not _BCAST]

    def with_chunk(chunk: list[Any], c: Any) -> tuple[Any, Any]:
        full_leaves = list(leaves)
        for i, x in zip(cut, chunk, strict=True):
            full_leaves[i] = x
        return body(c, full_leaves)

    def call(c: Any, chunk: list[Any]) -> tuple[Any, Any]:
        return with_chunk(chunk, c)

    if remat:
        call = jax.checkpoint(call, policy=policy, prevent_cse=prevent_cse)

    carry_shape, out_shape = jax.eval_shape(call, carry, _chunk_shapes(leaves, axes, cut, layout))
    del carry_shape
    oaxes, out_leaves_shape, out_tree = _checked_out_axes(out_shape, out_axes, out_names,
                                                         layout)
    summed = [j for j, a in enumerate(oaxes) if a is _BCAST]

    def step(state: tuple[Any, list[Any]], chunk: list[Any]) -> tuple[Any, list[Any]]:
        c, acc = state
        c, out = call(c, chunk)
        outs = jax.tree_util.tree_leaves(out)
        acc = [a + outs[j] for a, j in zip(acc, summed, strict=True)]
        return (c, acc), [o for j, o in enumerate(outs) if j not in summed]

    acc0 = [jnp.zeros(out_leaves_shape[j].shape, out_leaves_shape[j].dtype) for j in summed]
    xs = [_stack(leaves[i], axes[i], layout) for i in cut]
    (carry, acc), ys = _loop(step, (carry, acc0), xs, layout.full, prefetch, unroll)
    cat_axes = [a for a in oaxes if a is not _BCAST]
    ys = [_unstack(y, a, layout) for y, a in zip(ys, cat_axes, strict=True)]
    if layout.tail:
        lo, hi = layout.n - layout.tail, layout.n
        tail = [lax.slice_in_dim(leaves[i], lo, hi, axis=axes[i]) for i in cut]
        carry, out = call(carry, tail)
        outs = jax.tree_util.tree_leaves(out)
        acc = [a + outs[j] for a, j in zip(acc, summed, strict=True)]
        rest = [o for j, o in enumerate(outs) if j not in summed]
        ys = [
            jnp.concatenate([y, t], axis=a) for y, t, a in zip(ys, rest, cat_axes, strict=True)
        ]
    it_acc, it_ys = iter(acc), iter(ys)
    out_leaves = [next(it_acc) if a is _BCAST else next(it_ys) for a in oaxes]
    return carry, jax.tree_util.tree_unflatten(out_tree, out_leaves)


# --- public API --------------------------------------------------------------------------------


def chunked(
    fn: Callable[..., Any] | None = None,
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
    unroll: int | bool = 1,
) -> Callable[..., Any]:
    """Run ``fn`` chunk by chunk along an axis it is independent along, as a checkpointed scan.

    ``chunked(fn, chunks=8)(x, w)`` computes ``fn(x, w)`` by cutting ``x`` into 8 pieces along
    ``axis``, calling ``fn`` on each piece (with ``w`` whole, if ``in_axes=(0, None)``) inside
    a ``lax.scan`` whose body is a ``jax.checkpoint``, and concatenating the outputs along the
    same axis. Under ``jax.grad`` the forward pass then keeps only the inputs of each chunk,
    and the backward pass recomputes one chunk at a time, so both hold about two chunks of
    ``fn``'s intermediates instead of all of them (MEDL's double-buffered bottleneck layers).
    The price is one extra forward of ``fn`` in the backward pass (as with ``jax.checkpoint``).

    ``fn`` must be independent along the chunked axis: row ``i`` of the output may only depend
    on row ``i`` of the chunked inputs (batch, tokens), or - with ``reduce="sum"`` - the output
    must be a sum of per-chunk terms (the hidden features of an MLP ``gelu(x @ w1) @ w2``
    chunked along ``w1``'s columns and ``w2``'s rows; a loss summed over tokens).

    Args:
      fn: the layer. Usable as a decorator: ``@chunked(chunks=8)``.
      chunks: how many pieces to cut the axis into (>= 1, <= the axis length). When it does not
        divide the length ``n``, pieces have ``ceil(n / chunks)`` elements and a last, shorter
        piece is computed by one more (checkpointed) call after the scan.
      axis: the default chunked axis of every positional argument and of every output.
      in_axes: like ``jax.vmap``'s: an int, ``None`` (broadcast: passed whole to every chunk,
        e.g. weights), or a tuple with one entry per positional argument, each an int, ``None``
        or a pytree prefix of that argument. Default: ``axis`` for every argument. Keyword
        arguments are always broadcast (and may be non-array values).
      out_axes: the axis of each output to concatenate the chunks along (an int or a pytree
        prefix of the output); ``None`` for an output means its chunk values are added up.
        Default: ``axis``, or ``None`` everywhere if ``reduce="sum"``.
      reduce: ``"sum"`` to add the chunks' outputs instead of concatenating them (same as
        ``out_axes=None``).
      remat: checkpoint the body (default). ``False`` keeps the scan but lets the forward save
        every chunk's residuals, which saves much less memory.
      policy: a ``jax.checkpoint`` policy for the body; the default ``None`` saves nothing but
        the chunk's inputs.
      prevent_cse: passed to ``jax.checkpoint``.
      prefetch: software-pipeline the scan: chunk ``i + 1``'s input is sliced (and, if it
        lives in host memory, ``device_put`` to the device) in the same loop iteration that
        computes chunk ``i``, so the two can overlap. Costs one more chunk of input in flight.
        The host-to-device overlap can only happen on GPU/TPU and is not verified on CPU.
      unroll: passed to ``lax.scan``.

    Returns:
      A function with ``fn``'s signature and outputs.

    Raises:
      ValueError: an axis missing from an argument, chunks < 1 or > the axis length, chunked
        arguments of different lengths, ``in_axes`` / ``out_axes`` that do not fit.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> def mlp(x, w1, w2):
      ...     return jax.nn.gelu(x @ w1) @ w2
      >>> x, w1, w2 = jnp.ones((64, 8)), jnp.ones((8, 256)) / 8, jnp.ones((256, 8)) / 256
      >>> rows = jaxmem.chunked(mlp, chunks=4, in_axes=(0, None, None))   # over the batch
      >>> feats = jaxmem.chunked(mlp, chunks=4, in_axes=(None, 1, 0), reduce="sum")
      >>> bool(jnp.allclose(rows(x, w1, w2), mlp(x, w1, w2)))
      True
      >>> bool(jnp.allclose(feats(x, w1, w2), mlp(x, w1, w2)))
      True
      >>> g = jax.grad(lambda w1: rows(x, w1, w2).sum())(w1)   # the backward is chunked too
    """
    if fn is None:
        return functools.partial(
            chunked,
            chunks=chunks,
            axis=axis,
            in_axes=in_axes,
            out_axes=out_axes,
            reduce=reduce,
            remat=remat,
            policy=policy,
            prevent_cse=prevent_cse,
            prefetch=prefetch,
            unroll=unroll,
        )
    out_axes = _reduced_out_axes(reduce, out_axes, axis)
    if in_axes is _DEFAULT:
        in_axes = axis
    fn_name = getattr(fn, "__name__", type(fn).__name__)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        names = _arg_names(fn, len(args))
        leaves, treedef = jax.tree_util.tree_flatten(args)
        axes = _leaf_axes(args, in_axes, names)
        layout, axes = _layout(_named_leaves(args, names), leaves, axes, chunks)

        def body(carry: None, chunk_leaves: list[Any]) -> tuple[None, Any]:
            return carry, fn(*jax.tree_util.tree_unflatten(treedef, chunk_leaves), **kwargs)

        _, out = _run(
            body,
            None,
            leaves,
            axes,
            layout,
            out_axes=out_axes,
            out_names=f"{fn_name}",
            remat=remat,
            policy=policy,
            prevent_cse=prevent_cse,
            prefetch=prefetch,
            unroll=unroll,
        )
        return out

    return wrapper
