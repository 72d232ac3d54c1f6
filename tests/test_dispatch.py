"""Optimized.__call__ when the cached executable rejects the arguments (issue 18): the step
is compiled again for them through measure.compile (jaxmem's options), once per placement,
never run as a plain jit (which on CPU would drop the barriers and the plan's recompute)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import measure


def _step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2))(w)
    return w - 0.1 * g, loss


class _NoPlainCall:
    """A jitted step that may be lowered (then compiled by jaxmem) but never called."""

    def __init__(self, jitted):
        self.jitted = jitted

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        raise AssertionError("ran a jit compiled without jaxmem's compiler options")


def _reject(*args):
    raise ValueError("this executable rejects these arguments")


@pytest.fixture
def opt_and_args():
    args = (jnp.full((16, 16), 0.1), jnp.ones((8, 16)))
    opt = jaxmem.optimize(_step, donate_argnums=(), verify=False)   # the rewritten step
    opt(*args)
    (entry,) = opt._cache.values()
    assert entry.plan.recompute
    entry.jitted = _NoPlainCall(entry.jitted)
    entry.compiled = _reject
    return opt, entry, args


def test_rejected_arguments_are_compiled_again_the_jaxmem_way(opt_and_args, monkeypatch):
    opt, entry, args = opt_and_args
    seen = []
    real = measure.compile

    def counting(lowered, options=None):
        seen.append(measure.compiler_options(measure._platform_of(lowered)))
        return real(lowered, options)

    monkeypatch.setattr(measure, "compile", counting)
    out = opt(*args)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(jax.jit(_step)(*args)), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    opt(*args)
    assert len(seen) == 1 and len(entry.placed) == 1   # compiled once for this placement
    assert seen[0] == measure.compiler_options(jax.default_backend())


def test_a_second_rejection_is_a_clear_error(opt_and_args, monkeypatch):
    opt, _, args = opt_and_args
    monkeypatch.setattr(measure, "compile", lambda lowered, options=None: _reject)
    with pytest.raises(ValueError, match="jaxmem.optimize.*devices and shardings"):
        opt(*args)
