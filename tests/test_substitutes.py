"""Lean primitive substitutes (jaxmem.rewriting.substitutes): max-pooling's derivative.

The rewrite emits :func:`jaxmem.rewriting.substitutes.select_and_scatter_add` in place of the
primitive
XLA:CPU expands into int32 iota planes of the pooled input. These tests hold it to the
primitive's values — bit-identical where pooling windows do not overlap (ties and NaN
included), equal to float rounding where they do — and check the memory it saves.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmem import measure, program
from jaxmem.rewriting import substitutes
from jaxmem.rewriting.rewrite import rewrite


def _pool_loss(window, strides, padding, op="max"):
    red, init = (lax.max, -np.inf) if op == "max" else (lax.min, np.inf)

    def loss(x):
        # The cotangent reaching the pool is a constant of the shape of its output; no other
        # float arithmetic, so any difference would be the substitute's.
        y = lax.reduce_window(x, np.array(init, x.dtype), red, window, strides, padding)
        weights = np.random.default_rng(1).normal(size=y.shape).astype(y.dtype)
        return jnp.sum(y * weights)

    return loss


def _data(shape, kind, dtype=np.float32):
    rng = np.random.default_rng(0)
    if kind == "ties":  # zeros and ones: most windows hold equal maxima
        x = rng.integers(0, 2, size=shape).astype(np.float32)
    else:
        x = rng.normal(size=shape).astype(np.float32)
    if kind == "nonfinite":
        x.flat[::7] = np.nan
        x.flat[3::11] = np.inf
        x.flat[5::13] = -np.inf
    return jnp.asarray(x, dtype)


def _rewritten_grad(fn, x):
    prog = program.trace(jax.grad(fn), x)
    assert any(n.primitive == "select_and_scatter_add" for n in prog.nodes)
    out = rewrite(prog)
    return prog, jax.jit(lambda x: out(x)[0])


NON_OVERLAPPING = [
    ((4, 8, 8, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID", "max"),
    ((4, 9, 7, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID", "max"),  # uncovered edge rows
    ((4, 9, 7, 3), (1, 2, 2, 1), (1, 2, 2, 1), "SAME", "max"),  # padded windows
    ((4, 9, 8, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID", "min"),
    ((4, 16, 3), (1, 4, 1), (1, 4, 1), "VALID", "max"),  # 1-d
    ((2, 4, 6, 6, 3), (1, 2, 2, 2, 1), (1, 2, 2, 2, 1), "VALID", "max"),  # 3-d
]


@pytest.mark.parametrize("kind", ["random", "ties", "nonfinite"])
@pytest.mark.parametrize("shape,window,strides,padding,op", NON_OVERLAPPING)
def test_non_overlapping_pool_gradient_is_bit_identical(shape, window, strides, padding, op,
                                                        kind):
    fn = _pool_loss(window, strides, padding, op)
    x = _data(shape, kind)
    _, lean = _rewritten_grad(fn, x)
    want = np.asarray(jax.jit(jax.grad(fn))(x))
    got = np.asarray(lean(x))
    np.testing.assert_array_equal(got, want)  # NaN == NaN for assert_array_equal
    lowered = lean.lower(x).as_text()
    assert "select_and_scatter" not in lowered and "select-and-scatter" not in lowered


def test_bfloat16_pool_gradient_is_bit_identical():
    fn = _pool_loss((1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    x = _data((4, 8, 8, 3), "ties", jnp.bfloat16)
    _, lean = _rewritten_grad(fn, x)
    np.testing.assert_array_equal(np.asarray(lean(x), np.float32),
                                  np.asarray(jax.jit(jax.grad(fn))(x), np.float32))


@pytest.mark.parametrize("kind", ["random", "ties", "nonfinite"])
@pytest.mark.parametrize("window,strides,padding", [
    ((1, 3, 3, 1), (1, 2, 2, 1), "SAME"),  # a ResNet stem's pool
    ((1, 3, 3, 1), (1, 1, 1, 1), "SAME"),
    ((1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0))),
])
def test_overlapping_pool_gradient_equals_to_rounding(window, strides, padding, kind):
    fn = _pool_loss(window, strides, padding)
    x = _data((4, 9, 8, 3), kind)
    _, lean = _rewritten_grad(fn, x)
    want = np.asarray(jax.jit(jax.grad(fn))(x))
    got = np.asarray(lean(x))
    # Overlapping windows sum several cotangents into one element, maybe in another order.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


def test_substitute_can_be_turned_off_and_unsupported_windows_fall_back():
    fn = _pool_loss((1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    x = _data((2, 8, 8, 2), "random")
    prog = program.trace(jax.grad(fn), x)
    kept = jax.jit(lambda x: rewrite(prog, substitute=False)(x)[0]).lower(x).as_text()
    assert "select_and_scatter" in kept
    big = _pool_loss((1, 9, 9, 1), (1, 9, 9, 1), "VALID")  # 81 window positions > 64
    xb = _data((1, 18, 18, 1), "random")
    pb = program.trace(jax.grad(big), xb)
    sas = [n for n in pb.nodes if n.primitive == "select_and_scatter_add"]
    assert sas and substitutes.substitute_for(sas[0].eqn) is None
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: rewrite(pb)(x)[0])(xb)),
                                  np.asarray(jax.jit(jax.grad(big))(xb)))


class _PoolNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for c in (8, 16):
            x = nn.relu(nn.Conv(c, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return jnp.mean(x)


def test_substitute_lowers_a_pooling_cnn_step_peak():
    """Same step, same compile: XLA:CPU's expansion of the pool derivative holds one int32
    plane of the pooled input per dimension; the substitute holds no more than the input."""
    net = _PoolNet()
    x = jnp.ones((16, 32, 32, 4))
    params = net.init(jax.random.key(0), x)
    step = jax.value_and_grad(lambda p, x: net.apply(p, x))
    prog = program.trace(step, params, x)
    flat = jax.tree.leaves((params, x))

    def peak(substitute: bool) -> int:
        fn = rewrite(prog, substitute=substitute)
        return measure.figures(measure.compile(jax.jit(fn).lower(*flat))).peak

    pooled_input = 16 * 32 * 32 * 8 * 4
    lean, expanded = peak(True), peak(False)
    assert lean < expanded
    # Four int32 planes of the first pool's input: the saving is at least one of them.
    assert expanded - lean >= pooled_input
    out_lean = rewrite(prog)(*flat)
    out_plain = jax.tree.leaves(step(params, x))
    for a, b in zip(out_lean, out_plain, strict=True):  # convolutions may fuse differently
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
