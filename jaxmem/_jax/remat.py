"""Checkpoint and remat internals (bottom layer, :mod:`jaxmem._jax`).

JAX's own residual list for a function (``saved_residuals``), whether JAX is tracing or
differentiating right now, and the two trace-time patches ``jaxmem.optimize`` applies
without editing the model: every ``lax.scan`` body under ``jax.checkpoint``
(:func:`checkpointed_scan_bodies`), and every loss differentiated under ``jax.checkpoint``
(:func:`checkpointed_losses`). Each patch holds a lock for one trace and always restores
what it swapped.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
from jax._src.ad_checkpoint import saved_residuals as _saved_residuals


def saved_residuals(fn: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, str]]:
    """JAX's own residual list for ``fn``: ``[(aval, description)]`` (semi-private)."""
    return list(_saved_residuals(fn, *args, **kwargs))


def trace_context() -> Any:
    """This thread's JAX trace configuration (thread-local context managers such as
    ``jax.default_matmul_precision`` and ``enable_x64`` included): equal on two threads
    when both would trace a function the same way (semi-private ``jax._src.config``)."""
    from jax._src import config as jax_config

    return jax_config.trace_context()


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


_SCAN_PATCH_LOCK = __import__("threading").RLock()


def tracing() -> bool:
    """Whether JAX is tracing right now (inside ``jit``, ``make_jaxpr``, a transform)."""
    from jax._src import core

    return not core.trace_state_clean()


def under_differentiation() -> bool:
    """Whether JAX is tracing for a derivative right now (a JVP or linearize trace)."""
    from jax._src import core
    from jax._src.interpreters import ad

    kinds = tuple(k for k in (getattr(ad, "JVPTrace", None), getattr(ad, "LinearizeTrace", None))
                  if k is not None)
    return isinstance(core.trace_ctx.trace, kinds)


@contextlib.contextmanager
def checkpointed_scan_bodies(policy: Any, plan_body: Any = None) -> Iterator[None]:
    """While tracing, run every ``lax.scan`` body under ``jax.checkpoint(policy=policy)``.

    The joint-jaxpr rewrite keeps a scan whole, so per-layer remat inside a scanned stack
    (``nn.scan``, ``nnx.scan``, hand-written ``lax.scan``) must be asked for before AD runs.
    JAX has no global hook for that; this swaps ``jax.lax.scan`` (and the ``scan`` that
    ``fori_loop`` calls) for a wrapper for the duration of one trace, under a lock, and
    always restores it. Callers that imported ``scan`` by name before this runs are not
    affected (flax and jaxmem look it up on ``jax.lax`` at call time).

    ``plan_body(f, init, xs, kwargs)``, if given, is asked first about every scan met outside
    differentiation; a function it returns replaces the body (a body that holds its own
    forward and backward: gradient accumulation), ``None`` keeps the policy.
    """
    import functools

    from jax._src.lax.control_flow import loops

    original, original_loops = jax.lax.scan, loops.scan

    def wrap(orig: Any) -> Any:
        @functools.wraps(orig)
        def scan(f: Any, *args: Any, **kwargs: Any) -> Any:
            if plan_body is not None and not under_differentiation():
                planned = plan_body(f, args, kwargs)
                if planned is not None:
                    return orig(planned, *args, **kwargs)
            name = getattr(policy, "layer_input_name", None)
            if name:
                f = _layer_input_named(f, name)
            return orig(jax.checkpoint(f, policy=policy, prevent_cse=False), *args, **kwargs)
        return scan

    with _SCAN_PATCH_LOCK:
        jax.lax.scan, loops.scan = wrap(original), wrap(original_loops)
        try:
            yield
        finally:
            jax.lax.scan, loops.scan = original, original_loops


def _layer_input_named(f: Any, name: str) -> Any:
    """``f(carry, x)`` with each floating leaf of ``carry`` tagged ``checkpoint_name(...,
    name)`` (the policy's :attr:`jaxmem.rewriting.scans.BodyPolicy.layer_input_name`): under
    ``jax.checkpoint`` a policy that offloads the tagged copy leaves the untagged input
    unread by the backward pass, so the layer's input is parked in host memory, as MaxText
    does with a layer that tags its own ``decoder_layer_input``."""
    import functools

    from jax.ad_checkpoint import checkpoint_name

    from jaxmem._jax.avals import is_floating

    def tag(c: Any) -> Any:
        return checkpoint_name(c, name) if is_floating(c) else c

    @functools.wraps(f)
    def named(carry: Any, x: Any) -> Any:
        return f(jax.tree.map(tag, carry), x)
    return named


_GRAD_PATCH_LOCK = __import__("threading").RLock()


@contextlib.contextmanager
def checkpointed_losses(policy: Any, checkpoint: Any = None) -> Iterator[list[str]]:
    """While tracing, differentiate every loss under ``jax.checkpoint(policy=policy)``.

    What a user does by hand to save memory without editing the model: ``jax.value_and_grad
    (jax.checkpoint(loss, policy=...))``. A train step already calls ``jax.value_and_grad``
    (or ``jax.grad``; flax nnx, equinox and optax-style steps do so through them), so for the
    duration of one trace this swaps the two for wrappers that differentiate the loss under
    ``jax.checkpoint`` instead, under a lock, and always restores them. A gradient function
    built before the trace (``grad_fn = jax.value_and_grad(loss)`` at module level, as
    Keras' JAX training loop writes it) was made by the unpatched functions: it reaches
    ``jax._src.api.vjp`` (semi-private: what ``value_and_grad`` calls), which is swapped
    too, so its loss is wrapped the same way. ``jax.vjp`` called by hand is not (the public
    name is bound to the unswapped function). Only a differentiation started outside any
    other is wrapped (a gradient taken inside the loss is left alone). Yields the names of
    the losses wrapped: empty when the step differentiates none of them this way, so the
    trace is the plain step's.

    ``checkpoint(fun, policy, found)``: how to checkpoint the loss instead of
    ``jax.checkpoint(fun, policy=policy)``, e.g. each block under its own
    (:func:`jaxmem.rewriting.blockwise.checkpoint_blocks`); a trace that appends ``None`` to
    ``found``
    ran the loss as written, and the loss is not named.
    """
    from jax._src import api

    wrapped: list[str] = []
    depth = [0]  # inside a wrapped differentiation: its loss's own gradients stay as written

    def remat_of(fun: Any) -> tuple[Any, list[int | None]]:
        found: list[int | None] = []
        return (checkpoint(fun, policy, found) if checkpoint is not None
                else jax.checkpoint(fun, policy=policy)), found

    def outermost(plain: Any, remat: Any, found: list[int | None], name: str) -> Any:
        """``remat`` for a differentiation outside any other (named when it ran so)."""
        def call(*a: Any, **k: Any) -> Any:
            if depth[0] or under_differentiation():
                return plain(*a, **k)
            depth[0] += 1
            try:
                out = remat(*a, **k)
            finally:
                depth[0] -= 1
            if not found or found[-1] is not None:
                wrapped.append(name)
            return out
        return call

    def wrap(orig: Any) -> Any:
        @functools.wraps(orig)
        def transform(fun: Any, *args: Any, **kwargs: Any) -> Any:
            plain = orig(fun, *args, **kwargs)
            checkpointed, found = remat_of(fun)
            return functools.wraps(plain)(outermost(
                plain, orig(checkpointed, *args, **kwargs), found, _name(fun)))
        return transform

    def vjp(fun: Any, *primals: Any, **kwargs: Any) -> Any:  # value_and_grad's own call
        checkpointed, found = remat_of(fun)
        return outermost(functools.partial(originals["vjp"], fun),
                         functools.partial(originals["vjp"], checkpointed),
                         found, _name(fun))(*primals, **kwargs)

    with _GRAD_PATCH_LOCK:
        originals = {"grad": jax.grad, "value_and_grad": jax.value_and_grad,
                     "vjp": api.vjp}
        jax.grad, jax.value_and_grad = (wrap(originals["grad"]),
                                        wrap(originals["value_and_grad"]))
        api.vjp = vjp
        try:
            yield wrapped
        finally:
            jax.grad, jax.value_and_grad = originals["grad"], originals["value_and_grad"]
            api.vjp = originals["vjp"]


def _name(fun: Any) -> str:
    """The loss's name: ``fun``'s, or, for ``value_and_grad``'s partial application of it
    (``f_wrapped``), the name of the function it closes over."""
    name = getattr(fun, "__name__", type(fun).__name__)
    if name == "f_wrapped":
        for cell in getattr(fun, "__closure__", None) or ():
            inner = cell.cell_contents
            if callable(inner) and hasattr(inner, "__name__"):
                return inner.__name__
    return name
