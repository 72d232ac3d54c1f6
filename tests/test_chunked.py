"""jaxmem.chunked, jaxmem.chunked_cross_entropy and the flax chunking wrappers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmem
import jaxmem.flax
from jaxmem import measure
from jaxmem.memory.chunked import chunked, chunked_cross_entropy

RTOL = 1e-5


def _close(a, b, rtol=RTOL):
    """Relative to the largest magnitude of the reference, leaf by leaf."""
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape
        scale = max(np.abs(y).max(), 1e-30)
        err = np.abs(x - y).max() / scale
        assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def _mlp(x, w1, w2):
    return jax.nn.gelu(x @ w1) @ w2


@pytest.fixture(scope="module")
def mlp_args():
    k = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(k[0], (30, 8)),
        jax.random.normal(k[1], (8, 48)) / 3,
        jax.random.normal(k[2], (48, 8)) / 7,
    )


def _grads(f, args):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(
        *args
    )


# --- exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 3, 30])
def test_rows_exact(mlp_args, chunks):
    f = chunked(_mlp, chunks=chunks, in_axes=(0, None, None))
    _close(jax.jit(f)(*mlp_args), _mlp(*mlp_args))
    _close(_grads(f, mlp_args), _grads(_mlp, mlp_args))


@pytest.mark.parametrize("chunks", [4, 7, 11])
def test_rows_remainder_exact(mlp_args, chunks):
    # 30 rows: 4 -> 4 pieces of 8 = 3 + tail 6; 7 -> 6 of 5; 11 -> 10 of 3: tail cases and not
    f = chunked(_mlp, chunks=chunks, in_axes=(0, None, None))
    _close(f(*mlp_args), _mlp(*mlp_args))
    _close(_grads(f, mlp_args), _grads(_mlp, mlp_args))


@pytest.mark.parametrize("chunks", [1, 2, 4, 5, 48])
def test_features_reduce_sum_exact(mlp_args, chunks):
    f = chunked(_mlp, chunks=chunks, in_axes=(None, 1, 0), reduce="sum")
    _close(f(*mlp_args), _mlp(*mlp_args))
    _close(_grads(f, mlp_args), _grads(_mlp, mlp_args))


def test_axis_pytree_args_mixed_outputs_and_kwargs():
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (2, 10, 4))  # [batch, tokens, d], chunked over tokens
    params = {"w": jax.random.normal(k[1], (4, 4)), "b": jnp.arange(4.0)}
    mask = jax.random.bernoulli(k[2], 0.7, (2, 10))

    def layer(x, params, mask, *, scale):
        y = jnp.tanh(x @ params["w"] + params["b"]) * scale
        return {"y": y, "aux": jnp.sum(y * mask[..., None])}

    f = chunked(
        layer, chunks=3, axis=1, in_axes=(1, None, 1), out_axes={"y": 1, "aux": None}
    )
    want = layer(x, params, mask, scale=2.0)
    got = f(x, params, mask, scale=2.0)
    _close(got, want)
    loss = lambda fn: lambda x, p: fn(x, p, mask, scale=2.0)["aux"]
    _close(jax.grad(loss(f), (0, 1))(x, params), jax.grad(loss(layer), (0, 1))(x, params))


def test_decorator_negative_axis_prefetch_policy(mlp_args):
    x, w1, w2 = mlp_args
    xt = x.T  # chunk the last axis

    @chunked(chunks=4, axis=-1, in_axes=(-1, None, None), prefetch=True,
             policy=jax.checkpoint_policies.dots_saveable)
    def f(xt, w1, w2):
        return _mlp(xt.T, w1, w2).T

    _close(f(xt, w1, w2), _mlp(x, w1, w2).T)
    _close(_grads(f, (xt, w1, w2)), _grads(lambda a, b, c: _mlp(a.T, b, c).T, (xt, w1, w2)))


def test_no_remat_and_prefetch_with_remainder(mlp_args):
    for kw in ({"remat": False}, {"prefetch": True}, {"prefetch": True, "unroll": 2}):
        f = chunked(_mlp, chunks=4, in_axes=(0, None, None), **kw)
        _close(_grads(f, mlp_args), _grads(_mlp, mlp_args))


def test_prefetch_host_input_stages_to_device(mlp_args):
    x, w1, w2 = mlp_args
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    xh = jax.device_put(x, host)
    f = chunked(_mlp, chunks=3, in_axes=(0, None, None), prefetch=True)
    _close(jax.jit(f)(xh, w1, w2), _mlp(x, w1, w2))
    # On CPU the copy vanishes in compilation; lowered for CUDA, each staging is a device
    # placement: the first chunk before the loop and the next chunk inside it.
    st = jax.jit(f).trace(xh, w1, w2).lower(lowering_platforms=("cuda",)).as_text()
    assert st.count('_xla_buffer_placement = "device"') == 2


# --- argument errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, args, match",
    [
        ({"chunks": 0, "in_axes": (0, None, None)}, "ok", r"chunks=0 is < 1"),
        ({"chunks": 31, "in_axes": (0, None, None)}, "ok",
         r"chunks=31 is more than the 30 elements along axis 0 of argument"
         r" x \(shape \(30, 8\)\); use chunks <= 30"),
        ({"chunks": 2, "in_axes": (2, None, None)}, "ok",
         r"argument x has shape \(30, 8\) and no axis 2"),
        ({"chunks": 2, "in_axes": (0, 0, None)}, "ok",
         r"argument x has shape \(30, 8\) \(axis 0 has 30\) but argument w1 has shape \(8, 48\)"),
        ({"chunks": 2, "in_axes": (0, None)}, "ok", r"in_axes has 2 entries"),
        ({"chunks": 2, "in_axes": None}, "ok", r"no argument is chunked"),
        ({"chunks": 2, "in_axes": (0, None, None)}, "float", r"is a float, not an array"),
        ({"chunks": 2, "in_axes": (0, None, None), "out_axes": 1}, "ok",
         r"so its axis 1 is not the chunked one"),
        ({"chunks": 2, "reduce": "mean"}, "ok", r"reduce must be None or 'sum'"),
    ],
)
def test_argument_errors(mlp_args, kwargs, args, match):
    x, w1, w2 = mlp_args
    if args == "float":
        x = 1.0
    with pytest.raises(ValueError, match=match):
        chunked(_mlp, **kwargs)(x, w1, w2)


def test_chunks_type_error(mlp_args):
    with pytest.raises(TypeError, match="chunks must be an int"):
        chunked(_mlp, chunks=2.0)(*mlp_args)


# --- chunked cross-entropy ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ce_args():
    k = jax.random.split(jax.random.key(3), 4)
    h = jax.random.normal(k[0], (3, 14, 16))
    w = jax.random.normal(k[1], (16, 50)) / 2
    b = jax.random.normal(k[2], (50,))
    y = jax.random.randint(k[3], (3, 14), 0, 50)
    return h, w, b, y


def _ref_ce(h, w, b, y, reduction="mean", ignore_index=None):
    losses = optax.softmax_cross_entropy_with_integer_labels(h @ w + b, y)
    if ignore_index is not None:
        valid = y != ignore_index
        losses = jnp.where(valid, losses, 0.0)
        if reduction == "mean":
            return losses.sum() / valid.sum()
    return {"mean": jnp.mean, "sum": jnp.sum, "none": lambda a: a}[reduction](losses)


@pytest.mark.parametrize(
    "tc, vc, reduction",
    [(1, 1, "mean"), (6, 1, "sum"), (5, 1, "mean"), (5, 1, "none"), (4, 3, "mean"),
     (4, 3, "none"), (42, 7, "sum"), (8, 50, "mean")],  # 5 tokens / 3 vocab chunks: remainders
)
def test_cross_entropy_exact(ce_args, tc, vc, reduction):
    h, w, b, y = ce_args
    ct = jax.random.normal(jax.random.key(9), y.shape)  # a cotangent for reduction="none"

    def loss(fn):
        def f(h, w, b):
            out = fn(h, w, b)
            return jnp.sum(out * ct) if reduction == "none" else out
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    got = loss(lambda h, w, b: chunked_cross_entropy(
        h, w, y, bias=b, token_chunks=tc, vocab_chunks=vc, reduction=reduction))(h, w, b)
    want = loss(lambda h, w, b: _ref_ce(h, w, b, y, reduction))(h, w, b)
    _close(got, want)


def test_cross_entropy_ignore_index_and_no_bias(ce_args):
    h, w, _, y = ce_args
    y = y.at[0, :5].set(-100)
    for red in ("mean", "sum", "none"):
        got = jax.grad(lambda h, w, red=red: jnp.sum(chunked_cross_entropy(
            h, w, y, token_chunks=4, vocab_chunks=2, reduction=red,
            ignore_index=-100)), (0, 1))(h, w)
        want = jax.grad(lambda h, w, red=red: jnp.sum(
            _ref_ce(h, w, 0.0, y, red, ignore_index=-100)), (0, 1))(h, w)
        _close(got, want)
    assert float(chunked_cross_entropy(h, w, y, reduction="none", ignore_index=-100)[0, 0]) == 0


def test_cross_entropy_in_an_optax_step(ce_args):
    h, w, b, y = ce_args
    params = {"w": w, "b": b}
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, state):
        loss, g = jax.value_and_grad(lambda p: chunked_cross_entropy(
            h, p["w"], y, bias=p["b"], token_chunks=6))(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = opt.init(params)
    losses = []
    for _ in range(5):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"token_chunks": 0}, r"token_chunks=0 must be an int in \[1, 42\]"),
        ({"vocab_chunks": 51}, r"vocab_chunks=51 must be an int in \[1, 50\]"),
        ({"reduction": "avg"}, r"reduction must be 'mean', 'sum' or 'none'"),
    ],
)
def test_cross_entropy_errors(ce_args, kwargs, match):
    h, w, _, y = ce_args
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(h, w, y, **kwargs)


def test_cross_entropy_shape_errors(ce_args):
    h, w, _, y = ce_args
    with pytest.raises(ValueError, match=r"labels has shape \(3, 13\)"):
        chunked_cross_entropy(h, w, y[:, :13])
    with pytest.raises(ValueError, match=r"pass embedding.T"):
        chunked_cross_entropy(h, w.T, y)
    with pytest.raises(ValueError, match=r"labels must be integers"):
        chunked_cross_entropy(h, w, y.astype(jnp.float32))


# --- memory relations (compiled peak, the jaxmem way) ------------------------------------------


def test_memory_wide_mlp_rows():
    k = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(k[0], (512, 64))
    w1 = jax.random.normal(k[1], (64, 4096)) / 8  # hidden 512 x 4096 f32 = 8 MiB
    w2 = jax.random.normal(k[2], (4096, 64)) / 64
    loss = lambda f: jax.jit(jax.grad(lambda x, a, b: jnp.sum(f(x, a, b) ** 2), (0, 1, 2)))
    base = measure.measure(loss(_mlp), x, w1, w2)
    rows = measure.measure(loss(chunked(_mlp, chunks=16, in_axes=(0, None, None))), x, w1, w2)
    feats = measure.measure(
        loss(chunked(_mlp, chunks=16, in_axes=(None, 1, 0), reduce="sum")), x, w1, w2)
    assert rows.peak < 0.5 * base.peak, (rows, base)
    assert feats.peak < 0.6 * base.peak, (feats, base)


def test_memory_lm_head_cross_entropy():
    k = jax.random.split(jax.random.key(5), 3)
    h = jax.random.normal(k[0], (1024, 64))
    w = jax.random.normal(k[1], (64, 4096)) / 8  # logits 1024 x 4096 f32 = 16 MiB
    y = jax.random.randint(k[2], (1024,), 0, 4096)
    grad = lambda f: jax.jit(jax.grad(f, (0, 1)))
    base = measure.measure(grad(lambda h, w: _ref_ce(h, w, 0.0, y)), h, w)
    fused = measure.measure(
        grad(lambda h, w: chunked_cross_entropy(h, w, y, token_chunks=16)), h, w)
    tiled = measure.measure(
        grad(lambda h, w: chunked_cross_entropy(h, w, y, token_chunks=4, vocab_chunks=4)), h, w)
    assert fused.peak < 0.5 * base.peak, (fused, base)
    assert tiled.peak < 0.5 * base.peak, (tiled, base)
    # the forward alone (no grad: custom_vjp's primal) never holds the logits either
    fwd = measure.measure(lambda h, w: chunked_cross_entropy(h, w, y, token_chunks=16), h, w)
    assert fwd.temp < 4 << 20, fwd


# --- flax ----------------------------------------------------------------------------------------


class _Block(nn.Module):
    hidden: int = 64
    rate: float = 0.5

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        h = nn.gelu(nn.Dense(self.hidden)(x))
        h = nn.Dropout(self.rate)(h, deterministic=deterministic)
        return nn.Dense(x.shape[-1])(h)


def test_linen_wrapper_params_outputs_grads():
    x = jax.random.normal(jax.random.key(6), (20, 8))
    params = _Block().init(jax.random.key(0), x, deterministic=True)
    for chunks in (4, 3):  # 3 -> pieces of 7 and a tail of 6
        wrapped = jaxmem.flax.linen.chunked(_Block, chunks=chunks)()
        assert jax.tree_util.tree_structure(
            wrapped.init(jax.random.key(0), x, deterministic=True)
        ) == jax.tree_util.tree_structure(params)

        def loss(m):
            return lambda p: jnp.sum(jnp.sin(m.apply(p, x, deterministic=True)))

        want = jax.value_and_grad(loss(_Block()))(params)
        _close(jax.value_and_grad(loss(wrapped))(params), want)


def test_linen_wrapper_dropout_rng():
    x = jax.random.normal(jax.random.key(6), (16, 8))
    params = _Block().init(jax.random.key(0), x, deterministic=True)
    rngs = {"dropout": jax.random.key(1)}

    def grads(remat):
        m = jaxmem.flax.linen.chunked(_Block(rate=0.5), chunks=4, remat=remat)
        return jax.jit(jax.value_and_grad(
            lambda p: jnp.sum(m.apply(p, x, deterministic=False, rngs=rngs) ** 2)))(params)

    # The recomputation in the backward pass must see the same dropout bits as the forward.
    _close(grads(True), grads(False))
    # Identical rows in every chunk: each chunk must still draw its own dropout mask.
    xs = jnp.tile(x[:4], (4, 1))
    y = jaxmem.flax.linen.chunked(_Block, chunks=4)().apply(
        params, xs, deterministic=False, rngs=rngs)
    assert not np.allclose(y[:4], y[4:8])


def _nnx_block(seed: int, rate: float = 0.0):
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    return nnx.Sequential(
        nnx.Linear(8, 64, rngs=rngs), nnx.gelu, nnx.Dropout(rate, rngs=rngs),
        nnx.Linear(64, 8, rngs=rngs),
    )


def test_nnx_wrapper_outputs_grads():
    x = jax.random.normal(jax.random.key(7), (20, 8))
    for chunks in (4, 3):
        plain = _nnx_block(0)
        wrapped = jaxmem.flax.nnx.chunked(_nnx_block(0), chunks=chunks)
        loss = lambda m: jnp.sum(jnp.sin(m(x)))
        lw, gw = nnx.value_and_grad(loss)(wrapped)
        lp, gp = nnx.value_and_grad(loss)(plain)
        _close(lw, lp)
        _close(nnx.state(gw, nnx.Param)["module"], nnx.state(gp, nnx.Param))


def test_nnx_wrapper_dropout_state_threads_through_chunks():
    x = jax.random.normal(jax.random.key(7), (16, 8))

    def run(remat):
        m = jaxmem.flax.nnx.chunked(_nnx_block(0, rate=0.5), chunks=4, remat=remat)
        loss, g = nnx.jit(nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2)))(m)
        return m, loss, nnx.state(g, nnx.Param)

    m, *res_remat = run(True)
    _, *res_plain = run(False)
    _close(res_remat, res_plain)
    # four chunks drew four dropout keys; the count is written back to the module
    assert int(m.module.layers[2].rngs.count[...]) == 4


def test_wrapper_type_errors():
    with pytest.raises(TypeError, match="nnx.chunked"):
        jaxmem.flax.linen.chunked(_nnx_block(0), chunks=2)
    with pytest.raises(TypeError, match="linen.chunked"):
        jaxmem.flax.nnx.chunked(_Block(), chunks=2)
