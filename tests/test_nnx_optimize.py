"""jaxmem.flax.nnx.optimize: flax's own nnx training loop, with nnx.jit's semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jaxmem.program import TraceError

import jaxmem
import jaxmem.flax
from jaxmem import measure
from tests._compiles import one_rewrite_plan


class Net(nnx.Module):
    """Wide activations (GELU, LayerNorm, dropout) between matmuls: residual-dominated."""

    def __init__(self, rngs: nnx.Rngs, d: int = 32, h: int = 128, depth: int = 2):
        self.ups = nnx.List([nnx.Linear(d, h, rngs=rngs) for _ in range(depth)])
        self.downs = nnx.List([nnx.Linear(h, d, rngs=rngs) for _ in range(depth)])
        self.norms = nnx.List([nnx.LayerNorm(h, rngs=rngs) for _ in range(depth)])
        self.bn = nnx.BatchNorm(d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(d, 4, rngs=rngs)

    def __call__(self, x):
        x = self.bn(x)
        for up, norm, down in zip(self.ups, self.norms, self.downs, strict=True):
            x = x + down(self.drop(nnx.gelu(norm(up(x)))))
        return self.head(x)


def train_step(model, optimizer, x, y):
    """The loop of flax's nnx docs."""
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


X = jax.random.normal(jax.random.key(1), (64, 32))
Y = jax.random.normal(jax.random.key(2), (64, 4))


def _setup():
    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _numpy(tree):
    def conv(a):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jax.random.key_data(a)
        return np.asarray(a)
    return jax.tree_util.tree_map(conv, tree)


def _train(step, steps=2):
    model, optimizer = _setup()
    losses = [float(step(model, optimizer, X, Y)) for _ in range(steps)]
    return losses, _numpy(nnx.state((model, optimizer)))


@pytest.fixture(scope="module")
def reference():
    return _train(nnx.jit(train_step))


def test_docs_loop_matches_nnx_jit(reference, monkeypatch):
    one_rewrite_plan(monkeypatch)  # nnx.jit's semantics, whichever plan runs
    ref_losses, ref_state = reference
    step = jaxmem.flax.nnx.optimize(train_step)
    losses, state = _train(step)
    assert losses[-1] < losses[0]  # it trains
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state, ref_state)
    # and lower or equal compiled peak than nnx.jit with the same donation
    model, optimizer = _setup()
    plan = step.plan(model, optimizer, X, Y)
    jitted = nnx.jit(train_step, donate_argnums=(0, 1))
    ref = measure.figures(measure.compile(jitted.lower(model, optimizer, X, Y)))
    assert plan.compiled.peak <= ref.peak, (plan.compiled, ref)


def test_budget_and_no_donation(reference):
    ref_losses, ref_state = reference
    step = jaxmem.flax.nnx.optimize(train_step, budget=0.8, donate=False)
    model, optimizer = _setup()
    before = nnx.state(model, nnx.Param)
    losses = [float(step(model, optimizer, X, Y)) for _ in range(2)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree_util.tree_map(np.asarray, before)  # donate=False: the old arrays are alive
    plan = step.plan(model, optimizer, X, Y)
    assert plan.compiled.peak <= plan.baseline.peak


def test_shared_variable_stays_shared():
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(8, 8, rngs=rngs)
            self.dec = nnx.Linear(8, 8, rngs=rngs)
            self.dec.kernel = self.enc.kernel  # one Variable, two modules

        def __call__(self, x):
            return self.dec(jnp.tanh(self.enc(x)))

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = jnp.ones((4, 8))
    runs = []
    for wrap in (nnx.jit, jaxmem.flax.nnx.optimize):
        model = Tied(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        with pytest.warns(UserWarning) if wrap is not nnx.jit else _nothing():
            losses = [float(wrap(step)(model, optimizer, x)) for _ in range(2)]
        assert model.dec.kernel is model.enc.kernel
        runs.append((losses, np.asarray(model.enc.kernel[...])))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6)
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=1e-5, atol=1e-7)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_plain_optimize_refuses_nnx_nodes():
    model, optimizer = _setup()
    with pytest.raises(TypeError, match=r"args\[0\] is an nnx Net.*jaxmem.flax.nnx.optimize"):
        jaxmem.optimize(train_step)(model, optimizer, X, Y)
    with pytest.raises(TypeError, match=r"kwargs\['v'\] is an nnx Param"):
        jaxmem.optimize(lambda v: v[...] * 2)(v=model.head.kernel)


def test_nnx_errors():
    def returns_model(model, optimizer, x, y):
        train_step(model, optimizer, x, y)
        return model

    model, optimizer = _setup()
    with pytest.raises((TypeError, TraceError), match="returned an nnx graph node"):
        jaxmem.flax.nnx.optimize(returns_model)(model, optimizer, X, Y)
    with pytest.raises(TypeError, match="does not take static_argnums"):
        jaxmem.flax.nnx.optimize(train_step, static_argnums=(2,))


def test_plain_optimize_accepts_split_state():
    """The functional API (nnx.split state in, new state out) is a plain pytree step."""
    model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.gelu,
                           nnx.Linear(64, 4, rngs=nnx.Rngs(1)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, rest, x, y):
        def loss(p):
            return jnp.mean((nnx.merge(graphdef, p, rest)(x) - y) ** 2)
        val, g = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, g), val

    new, loss = jaxmem.optimize(step, donate_argnums=(), verify=False)(params, rest, X, Y)
    ref_new, ref_loss = jax.jit(step)(params, rest, X, Y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(ref_new)
