"""Gradient-accumulation loops: a scan or fori_loop whose body is a train step of its own
(jaxmem.rewriting.scans.TrainBodies) is planned recursively."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from tests._compiles import one_rewrite_plan

MICRO, B, D = 4, 256, 64


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x)))
        return x + nn.Dense(D)(h)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = _Block(name=f"block{i}")(x)
        return x


_NET = _Net()


def _loss(params, x):
    return jnp.mean(_NET.apply(params, x) ** 2)


def _scan_step(params, xs):
    def body(acc, x):
        loss, g = jax.value_and_grad(_loss)(params, x)
        return jax.tree.map(jnp.add, acc, g), loss
    grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), xs)
    return jax.tree.map(lambda p, g: p - 0.1 * g / MICRO, params, grads), losses.mean()


def _fori_step(params, xs):
    def body(i, carry):
        acc, total = carry
        loss, g = jax.value_and_grad(_loss)(params, xs[i])
        return jax.tree.map(jnp.add, acc, g), total + loss
    zero = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()))
    grads, total = jax.lax.fori_loop(0, MICRO, body, zero)
    return jax.tree.map(lambda p, g: p - 0.1 * g / MICRO, params, grads), total / MICRO


@pytest.fixture(scope="module")
def args():
    xs = jax.random.normal(jax.random.key(1), (MICRO, B, D))
    return _NET.init(jax.random.key(0), xs[0]), xs


@pytest.mark.parametrize("step", [_scan_step, _fori_step], ids=["scan", "fori_loop"])
def test_accumulation_body_is_planned_with_a_lower_peak_and_equal_results(step, args,
                                                                        monkeypatch):
    one_rewrite_plan(monkeypatch)  # the body is planned, below plain, whichever plan it is
    fast = jaxmem.optimize(step, donate_argnums=())
    plan = fast.plan(*args)
    assert plan.strategy == "auto: inside loops"
    assert any("planned as a train step" in n for n in plan.notes), plan.notes
    assert plan.compiled.peak < plan.baseline.peak, plan
    (new, loss), (ref, loss_ref) = fast(*args), jax.jit(step)(*args)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
