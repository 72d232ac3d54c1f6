"""jaxmem's own FLOP count (jaxmem.xla.measure.count_flops), the figure beside every peak
compiled for a GPU target without the device."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem import _jax
from jaxmem.planning import strategies
from jaxmem.rewriting.rewrite import apply
from jaxmem.tracing.program import from_jaxpr
from jaxmem.xla.measure import count_flops


def test_equations_no_output_depends_on_are_not_counted():
    x = jnp.ones((16, 16))

    def with_dead(x):
        _ = jnp.exp(x) @ x  # nothing reads it: XLA removes it
        return (x @ x).sum()

    assert count_flops(with_dead, x) == count_flops(lambda x: (x @ x).sum(), x)


def test_a_rewrites_dropped_residuals_made_in_its_forward_pass_are_not_counted():
    """The rewrite replays the user's forward pass whole; a residual it drops is still made
    there, and read by nothing (its backward readers read the re-created copy). GELU's
    derivative coefficient (exp of the input) is such a value: made in the forward pass
    only for the backward. The count is over what the outputs depend on."""
    import jaxmem

    w = jnp.eye(64) * 0.1
    x = jnp.ones((32, 64))

    def step(w, x):
        def loss(w):
            h = x
            for _ in range(3):
                h = jax.nn.gelu(h @ w, approximate=False)
            return jnp.sum(h ** 2)
        return jax.grad(loss)(w)

    analysis = jaxmem.analyze(step, w, x)
    plan = strategies.plan_auto(analysis, max_recompute_fraction=0.5)
    assert plan.recompute
    fn = apply(analysis.program, plan)
    raw = from_jaxpr(jax.make_jaxpr(fn)(w, x)).flops
    live = from_jaxpr(_jax.live_only(jax.make_jaxpr(fn)(w, x))).flops
    assert live < raw
    assert count_flops(fn, w, x) == live
    assert count_flops(step, w, x) <= count_flops(fn, w, x)
