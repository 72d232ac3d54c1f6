"""jaxmem.flax.linen / jaxmem.flax.nnx: remat, intercept, named_scopes."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxmem.flax
from benchmarks import policies as bench
from jaxmem import measure
from tests._fast_compile import fast_run


def _rel(a, b):
    """Largest difference relative to the largest gradient in the whole tree.

    Per leaf would be wrong: a bias feeding BatchNorm has a true gradient of exactly zero,
    so its computed gradient is float noise (~1e-8) and any reordering changes it by ~100%.
    """
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(a) == len(b) and a
    scale = max(float(jnp.max(jnp.abs(y))) for y in b) + 1e-30
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b, strict=True)) / scale


# --- linen -------------------------------------------------------------------------------------

class LBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(32)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
        h = nn.Dropout(0.3, deterministic=not train)(nn.relu(h))
        return x + nn.Dense(x.shape[-1])(h)


class LNet(nn.Module):
    block: type = LBlock

    @nn.compact
    def __call__(self, x, train: bool = True):
        for i in range(3):
            x = self.block(name=f"block{i}")(x, train=train)
        return nn.Dense(1)(x)


X = jax.random.normal(jax.random.key(0), (16, 8))
KEY = jax.random.key(7)


def _linen_loss(model):
    def loss(params, stats, key):
        y, upd = model.apply({"params": params, "batch_stats": stats}, X, train=True,
                             rngs={"dropout": key}, mutable=["batch_stats"])
        return jnp.mean(y**2), upd["batch_stats"]
    return jax.value_and_grad(loss, has_aux=True)


@pytest.fixture(scope="module")
def linen_ref():
    v = LNet().init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, X)
    args = (v["params"], v["batch_stats"], jax.random.key(3))
    return args, fast_run(_linen_loss(LNet()), *args)


# The value tests compile both sides the fast way (tests/_fast_compile.py): values only.
def test_linen_remat_bn_dropout(linen_ref):
    args, ((l0, s0), g0) = linen_ref
    (l1, s1), g1 = fast_run(_linen_loss(LNet(block=jaxmem.flax.linen.remat(LBlock))), *args)
    assert abs(float(l1 - l0)) <= 1e-6 * abs(float(l0))
    assert _rel(g1, g0) < 1e-6 and _rel(s1, s0) < 1e-6


def test_linen_intercept_bn_dropout_init_and_apply(linen_ref):
    args, ((l0, s0), g0) = linen_ref
    with jaxmem.flax.linen.intercept(LBlock):
        v = LNet().init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, X)
        jaxpr = jax.make_jaxpr(lambda *a: jax.jit(_linen_loss(LNet()))(*a))(*args)
        (l1, s1), g1 = fast_run(_linen_loss(LNet()), *args)
    assert _rel(v["params"], args[0]) == 0.0
    assert "remat" in str(jaxpr)
    assert _rel(g1, g0) < 1e-6 and _rel(s1, s0) < 1e-6


def test_linen_errors():
    with pytest.raises(TypeError, match="not a flax.linen Module"):
        jaxmem.flax.linen.remat(int)
    with pytest.raises(TypeError, match="policy must be"):
        jaxmem.flax.linen.remat(LBlock, policy="dots")
    with pytest.raises(TypeError, match="Module subclasses"), \
            jaxmem.flax.linen.intercept(nnx.Linear):
        pass


def test_linen_nn_scan_stack_grads_equal():
    cfg = dict(bench.SIZES["test"], layers=2)
    params, x, key = bench.stack_inputs(cfg)
    ref = fast_run(jax.value_and_grad(bench.stack_loss(cfg)), params, x, key)
    body = lambda cls: jaxmem.flax.linen.remat(cls, prevent_cse=False)
    out = fast_run(jax.value_and_grad(bench.stack_loss(cfg, body)), params, x, key)
    assert _rel(out, ref) < 1e-6


def test_linen_resnet_memory():
    cfg = bench.SIZES["test"]
    params, stats, x = bench.resnet_inputs(cfg)
    # a fresh function per trace: jax.jit caches traces, and intercept acts while tracing
    loss = lambda: jax.value_and_grad(bench.resnet_loss(cfg), has_aux=True)
    base = measure.measure(loss(), params, stats, x)
    with jaxmem.flax.linen.intercept(bench.BasicBlock):
        wrapped = measure.measure(loss(), params, stats, x)
    assert wrapped.peak <= 0.75 * base.peak, (wrapped, base)
    assert wrapped.flops <= base.flops * 1.01  # convs kept: no matmul recomputed


# --- nnx ---------------------------------------------------------------------------------------

class NBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.fc1 = nnx.Linear(d, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.fc2 = nnx.Linear(32, d, rngs=rngs)

    def __call__(self, x, key):
        return x + self.fc2(self.drop(nnx.relu(self.bn(self.fc1(x))), rngs=key))


class NNet(nnx.Module):
    def __init__(self, rngs, block=NBlock):
        self.blocks = nnx.List([block(8, rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, key=KEY):
        for i, b in enumerate(self.blocks):
            x = b(x, jax.random.fold_in(key, i))
        return self.head(x)


def _nnx_grads(model, ctx=None):
    def loss(m):
        return jnp.mean(m(X) ** 2)
    if ctx is None:
        return nnx.value_and_grad(loss)(model)
    with ctx:
        return nnx.value_and_grad(loss)(model)


def test_nnx_remat_class_and_intercept_bn_dropout():
    ref_model = NNet(nnx.Rngs(0, dropout=1))
    (l0, g0) = _nnx_grads(ref_model)
    m1 = NNet(nnx.Rngs(0, dropout=1), block=jaxmem.flax.nnx.remat(NBlock))
    assert isinstance(m1.blocks[0], NBlock)
    (l1, g1) = _nnx_grads(m1)
    m2 = NNet(nnx.Rngs(0, dropout=1))
    (l2, g2) = _nnx_grads(m2, jaxmem.flax.nnx.intercept(NBlock))
    for loss, g, m in ((l1, g1, m1), (l2, g2, m2)):
        assert abs(float(loss - l0)) <= 1e-6 * abs(float(l0))
        assert _rel(g, g0) < 1e-6
        # BatchNorm statistics were updated the same way
        assert _rel(nnx.state(m, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat)) < 1e-6
    assert "__call__" not in NBlock.__dict__ or NBlock.__call__.__name__ == "__call__"


def test_nnx_named_scopes_show_paths():
    model = NNet(nnx.Rngs(0, dropout=1))
    # Evaluation mode: under plain jax.value_and_grad nnx refuses to update batch statistics
    # that were not differentiated (TraceContextError); this test is about the paths.
    model.eval()
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)

    def loss(state, rest):
        m = nnx.merge(graphdef, state, rest)
        with jaxmem.flax.nnx.named_scopes(m):
            return jnp.mean(m(X) ** 2)

    analysis = jaxmem.analyze(loss, state, rest)
    layers = {n.layer for n in analysis.program.nodes}
    assert {"blocks/0/fc1", "blocks/1/fc2", "blocks/1/bn"} <= layers, layers
    assert "blocks/1/bn" in {r.layer for r in analysis.residuals}
    # rematted blocks keep their paths
    def loss2(state, rest):
        m = nnx.merge(graphdef, state, rest)
        with jaxmem.flax.nnx.named_scopes(m), jaxmem.flax.nnx.intercept(NBlock):
            return jnp.mean(m(X) ** 2)
    def stacks_of(jaxpr):
        for e in jaxpr.eqns:
            yield str(e.source_info.name_stack)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from stacks_of(sub)

    stacks = set(stacks_of(jax.make_jaxpr(loss2)(state, rest).jaxpr))
    assert any("blocks/1" in s for s in stacks), stacks
    assert NBlock.__call__ is NBlock.__dict__["__call__"]  # patches removed


def test_nnx_scan_stack_grads_equal():
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.up = nnx.Linear(16, 64, rngs=rngs)
            self.down = nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(self.norm(x))))

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Layer(rngs)

    layers = make(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 16))

    def run(body):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def stack(h, layer):
            return body(layer, h)
        return nnx.value_and_grad(lambda ls: jnp.sum(stack(x, ls) ** 2))(layers)

    plain = run(lambda layer, h: layer(h))
    remat = run(jaxmem.flax.nnx.remat(lambda layer, h: layer(h), prevent_cse=False))
    assert _rel(remat, plain) < 1e-6


def test_nnx_errors():
    with pytest.raises(TypeError, match="module instance"):
        jaxmem.flax.nnx.remat(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="not an nnx.Module"):
        jaxmem.flax.nnx.remat(LBlock)
    with pytest.raises(TypeError, match="nnx.Module instance"), \
            jaxmem.flax.nnx.named_scopes(LBlock()):
        pass
