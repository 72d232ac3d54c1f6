"""equinox models under jaxmem.optimize: non-array leaves are static, as under eqx.filter_jit."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem
from tests._compiles import one_rewrite_plan

OPTIM = optax.adam(1e-2)


def make_step(model, opt_state, x, y):
    """The step of equinox's own examples."""
    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = OPTIM.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss, grads


class ConvNet(eqx.Module):
    convs: list
    norms: list
    head: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key, channels=16, depth=3):
        keys = jax.random.split(key, depth + 2)
        self.convs = [eqx.nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1, key=k)
                      for i, k in enumerate(keys[:depth])]
        self.norms = [eqx.nn.GroupNorm(4, channels) for _ in range(depth)]
        self.head = eqx.nn.Linear(channels, 4, key=keys[-1])
        self.dropout = eqx.nn.Dropout(0.1, inference=True)  # a bool and a float: static

    def __call__(self, x):
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = self.dropout(jax.nn.gelu(norm(conv(x))))
        return self.head(jnp.mean(x, axis=(1, 2)))


def _models():
    mlp = eqx.nn.MLP(16, 4, width_size=64, depth=3, activation=jax.nn.gelu,
                     key=jax.random.key(0))
    mlp_batch = (jax.random.normal(jax.random.key(1), (1024, 16)), jnp.ones((1024, 4)))
    conv = ConvNet(jax.random.key(2))
    conv_batch = (jax.random.normal(jax.random.key(3), (8, 3, 16, 16)), jnp.ones((8, 4)))
    return {"mlp": (mlp, mlp_batch), "conv": (conv, conv_batch)}


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_same_results_as_filter_jit_and_lower_peak(name, monkeypatch):
    one_rewrite_plan(monkeypatch)  # equinox's idioms, and a plan below plain: any plan's
    model, (x, y) = _models()[name]
    opt_state = OPTIM.init(eqx.filter(model, eqx.is_array))
    ref = eqx.filter_jit(make_step)(model, opt_state, x, y)
    step = jaxmem.optimize(make_step, donate_argnums=())
    out = step(model, opt_state, x, y)
    # the same tree, static leaves (activations, Dropout's flags) included
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)
    new_model = out[0]
    assert new_model.layers[0].weight.shape == model.layers[0].weight.shape if name == "mlp" \
        else new_model.dropout.inference is True
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(out[3]), jax.tree_util.tree_leaves(ref[3]),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(eqx.filter(out[0], eqx.is_array)),
                    jax.tree_util.tree_leaves(eqx.filter(ref[0], eqx.is_array)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # the updated model trains on: a second call hits the cache (same static leaves)
    step(out[0], out[1], x, y)
    assert len(step._cache) == 1
    plan = step.plan(model, opt_state, x, y)
    # plain: eqx.filter_jit's program (jax.jit of the same step), compiled the same way
    plain = plan.baseline
    assert plan.compiled.peak <= plain.peak
    # activations (GELU, GroupNorm outputs) dominate: recomputing them lowers the peak
    assert plan.compiled.peak < plain.peak


class Config(eqx.Module):
    act: object
    scale: float
    name: str


def test_static_leaf_rules():
    seen = []

    def step(cfg, w, x, lr):
        seen.append((type(cfg.scale), type(lr)))
        loss, g = jax.value_and_grad(lambda w: jnp.sum(cfg.act(x @ w) * cfg.scale))(w)
        return w - lr * g, loss, cfg

    fast = jaxmem.optimize(step, donate_argnums=(), verify=False)
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    new_w, loss, cfg = fast(Config(jnp.tanh, 2.0, "run"), w, x, 0.1)
    assert cfg == Config(jnp.tanh, 2.0, "run")  # static outputs come back as they were
    ref = step(Config(jnp.tanh, 2.0, "run"), w, x, 0.1)
    np.testing.assert_allclose(new_w, ref[0], rtol=1e-6)
    np.testing.assert_allclose(loss, ref[1], rtol=1e-6)
    # inside an equinox Module a Python float is static (eqx.filter_jit); outside it is
    # traced (jax.jit)
    assert seen[0][0] is float and issubclass(seen[0][1], jax.core.Tracer)
    fast(Config(jnp.tanh, 2.0, "run"), w, x, 0.2)
    assert len(fast._cache) == 1
    fast(Config(jnp.sin, 2.0, "run"), w, x, 0.1)  # another static leaf: another trace
    assert len(fast._cache) == 2
    with pytest.raises(TypeError, match=r"not hashable.*eqx.filter_jit"):
        fast(Config(jnp.tanh, 2.0, _Unhashable()), w, x, 0.1)
    with pytest.raises(TypeError, match=r"leaf.*str.*static_argnums"):
        fast(Config(jnp.tanh, 2.0, "run"), w, x, "outside a Module: jax.jit's rule")


class _Unhashable:
    __hash__ = None
