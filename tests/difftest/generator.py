"""A seeded generator of random differentiable train steps, for differential testing.

A case is a list of *ops*, each a map ``(B, D) -> (B, D)`` (float) drawn from one primitive
family, so any sub-list of a case is again a valid case: the shrinker (:mod:`.shrink`) removes
ops freely. The step built from a case looks like a user's::

    def step(state, batch):
        params, opt_state, stats = state
        (loss, (aux, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ...)
        params, opt_state = update(params, grads, opt_state)      # SGD, momentum or optax
        return (params, opt_state, stats), {"loss": loss, "grads": grads, "aux": aux}

Shapes are tiny (B=32, D=8) so a compile takes tens of milliseconds; the batch is wider than
the parameters so that activations, which plans drop, outweigh them, as in real steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

B, D = 32, 8  # batch rows > width: activations (what plans drop) outweigh the parameters

#: family -> (needs a parameter, weight in the draw)
FAMILIES: dict[str, tuple[bool, float]] = {
    "dense": (True, 3.0),
    "dense_act": (True, 3.0),
    "batched_dot": (True, 1.5),
    "attention": (False, 1.0),
    "conv": (True, 1.5),
    "layernorm": (True, 1.5),
    "logsumexp": (False, 1.0),
    "elementwise": (False, 3.0),
    "broadcast": (True, 1.0),
    "reshape_transpose": (True, 1.0),
    "concat_split": (True, 1.0),
    "slice_pad": (False, 1.0),
    "gather": (False, 1.0),
    "dynamic_slice": (False, 1.0),
    "where": (False, 1.0),
    "cumsum": (False, 0.7),
    "sort": (False, 0.7),
    "int_bool": (False, 1.0),
    "scan": (True, 1.0),
    "cond": (True, 0.8),
    "while": (False, 0.6),
    "custom_jvp": (False, 0.7),
    "custom_vjp": (False, 0.7),
    "nested_jit": (True, 0.8),
    "checkpoint": (True, 0.8),
    "checkpoint_name": (False, 0.8),
    "offload_name": (False, 0.4),
    "dropout": (False, 1.0),
    "batchnorm": (True, 1.0),
    "low_precision": (True, 0.8),
    "residual": (True, 1.5),
}

_UNARY = ("tanh", "sin", "relu", "gelu", "sigmoid", "softplus", "square_scaled", "exp_neg",
          "sqrt1p", "abs", "log1p_sq")


@dataclasses.dataclass(frozen=True)
class Op:
    family: str
    arg: int  # a family-specific choice (unary op, axis, trip count...), drawn with the op

    def __str__(self) -> str:
        return f"{self.family}({self.arg})"


@dataclasses.dataclass(frozen=True)
class Case:
    """One generated train step: its ops and the step's shape choices."""

    seed: int
    ops: tuple[Op, ...]
    update: str = "sgd"          # "sgd" | "momentum" | "adam" (optax)
    detached: bool = False       # the loss reads no parameter: no backward pass to plan
    loss: str = "mse"            # "mse" | "xent"
    batch: int = B               # rows of the batch (regressions keep the one they failed at)

    def __str__(self) -> str:
        return (f"Case(seed={self.seed}, update={self.update!r}, detached={self.detached}, "
                f"loss={self.loss!r}, batch={self.batch}, "
                f"ops=[{', '.join(map(str, self.ops))}])")

    def replace(self, **kw: Any) -> Case:
        return dataclasses.replace(self, **kw)


def generate(seed: int, max_ops: int = 6) -> Case:
    """The case of ``seed``: 1..max_ops ops drawn by family weight, an update rule, a loss."""
    rng = np.random.default_rng(seed)
    names = list(FAMILIES)
    w = np.array([FAMILIES[n][1] for n in names])
    n = int(rng.integers(1, max_ops + 1))
    ops = tuple(Op(names[int(rng.choice(len(names), p=w / w.sum()))], int(rng.integers(0, 64)))
                for _ in range(n))
    update = str(rng.choice(["sgd", "sgd", "momentum", "adam"]))
    detached = bool(rng.random() < 0.04)
    loss = str(rng.choice(["mse", "mse", "xent"]))
    return Case(seed, ops, update, detached, loss)


# -- parameters ---------------------------------------------------------------------------------
def _param_shapes(op: Op) -> dict[str, tuple[int, ...]]:
    f = op.family
    if f in ("dense", "dense_act", "nested_jit", "checkpoint", "residual", "low_precision"):
        return {"w": (D, D), "b": (D,)}
    if f == "batched_dot":
        return {"w": (2, D // 2, D // 2)}
    if f == "conv":
        return {"k": (1, 1, 3)}
    if f in ("layernorm", "batchnorm"):
        return {"g": (D,), "b": (D,)}
    if f == "broadcast":
        return {"b": (D,), "s": ()}
    if f in ("reshape_transpose", "concat_split"):
        return {"w": (D // 2,)}
    if f == "scan":
        return {"w": (1 + op.arg % 3, D, D)}
    if f == "cond":
        return {"w": (D, D)}
    return {}


def init(case: Case) -> tuple[Any, Any]:
    """``(state, batch)`` for ``case``: deterministic in the seed."""
    key = jax.random.PRNGKey(case.seed)
    params: dict[str, dict[str, jax.Array]] = {}
    stats: dict[str, dict[str, jax.Array]] = {}
    for i, op in enumerate(case.ops):
        shapes = _param_shapes(op)
        if shapes:
            p = {}
            for name, shape in sorted(shapes.items()):
                key, k = jax.random.split(key)
                scale = 1.0 / np.sqrt(shape[-1]) if len(shape) >= 2 else 0.5
                p[name] = scale * jax.random.normal(k, shape, jnp.float32)
                if name == "g":
                    p[name] = p[name] + 1.0
            params[f"op{i}"] = p
        if op.family == "batchnorm":
            stats[f"op{i}"] = {"mean": jnp.zeros((D,)), "var": jnp.ones((D,))}
    key, k = jax.random.split(key)
    params["head"] = {"w": jax.random.normal(k, (D, D), jnp.float32) / np.sqrt(D)}
    k1, k2, k3 = jax.random.split(key, 3)
    n = case.batch
    batch = {"x": jax.random.normal(k1, (n, D), jnp.float32),
             "y": jax.random.normal(k2, (n, D), jnp.float32),
             "label": jax.random.randint(k3, (n,), 0, D),
             "rng": jax.random.PRNGKey(case.seed + 1)}
    opt_state = _opt_init(case, params)
    return (params, opt_state, stats), batch


# -- ops ----------------------------------------------------------------------------------------
def _unary(k: int, h: jax.Array) -> jax.Array:
    name = _UNARY[k % len(_UNARY)]
    if name == "tanh":
        return jnp.tanh(h)
    if name == "sin":
        return jnp.sin(h)
    if name == "relu":
        return jax.nn.relu(h)
    if name == "gelu":
        return jax.nn.gelu(h)
    if name == "sigmoid":
        return jax.nn.sigmoid(h)
    if name == "softplus":
        return jax.nn.softplus(h)
    if name == "square_scaled":
        return 0.5 * h * h
    if name == "exp_neg":
        return jnp.exp(-jnp.abs(h))
    if name == "sqrt1p":
        return jnp.sqrt(1.0 + h * h)
    if name == "abs":
        return jnp.abs(h)
    return jnp.log1p(h * h)


@jax.custom_jvp
def _soft_clip(x: jax.Array) -> jax.Array:
    return jnp.tanh(x) * 2.0


@_soft_clip.defjvp
def _soft_clip_jvp(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    y = _soft_clip(x)
    return y, t * 2.0 * (1.0 - jnp.tanh(x) ** 2)


@jax.custom_vjp
def _grad_scale(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


def _grad_scale_fwd(x: jax.Array) -> Any:
    return jnp.sin(x), jnp.cos(x)


def _grad_scale_bwd(c: jax.Array, g: jax.Array) -> Any:
    return (jnp.clip(g * c, -1.0, 1.0),)


_grad_scale.defvjp(_grad_scale_fwd, _grad_scale_bwd)


@jax.jit
def _inner_jit(h: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.tanh(h @ w + b)


def _apply_op(i: int, op: Op, h: jax.Array, p: dict[str, jax.Array], ctx: dict[str, Any]
              ) -> jax.Array:
    f, a = op.family, op.arg
    B = h.shape[0]  # noqa: N806 - the batch of this case
    if f == "dense":
        return h @ p["w"] + p["b"]
    if f == "dense_act":
        return _unary(a, h @ p["w"] + p["b"])
    if f == "residual":
        with jax.named_scope("inner"):
            return h + jax.nn.relu(h @ p["w"] + p["b"])
    if f == "batched_dot":
        g = h.reshape(B, 2, D // 2)
        out = jnp.einsum("bgi,gij->bgj", g, p["w"])
        return out.reshape(B, D)
    if f == "attention":
        q = h.reshape(B, 2, D // 2)
        s = jnp.einsum("bhi,bgi->bhg", q, q) / np.sqrt(D // 2)
        return jnp.einsum("bhg,bgi->bhi", jax.nn.softmax(s, axis=-1), q).reshape(B, D)
    if f == "conv":
        x = h.reshape(B, 1, D)
        y = lax.conv_general_dilated(x, p["k"], (1,), "SAME")
        return y.reshape(B, D)
    if f == "layernorm":
        mu = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
        return (h - mu) * lax.rsqrt(var + 1e-5) * p["g"] + p["b"]
    if f == "logsumexp":
        m = jnp.max(h, axis=-1 if a % 2 else 0, keepdims=True)
        return h - m - jnp.log(jnp.sum(jnp.exp(h - m), axis=-1 if a % 2 else 0, keepdims=True))
    if f == "elementwise":
        for k in range(1 + a % 3):
            h = _unary(a + 5 * k, h)
        return h
    if f == "broadcast":
        return h * p["s"] + p["b"][None, :] + jnp.mean(h, axis=0, keepdims=True)
    if f == "reshape_transpose":
        g = h.reshape(B, 2, D // 2) * p["w"]
        return jnp.transpose(g, (0, 2, 1)).reshape(B, D)
    if f == "concat_split":
        x1, x2 = jnp.split(h, 2, axis=-1)
        return jnp.concatenate([x2 * p["w"], jnp.tanh(x1)], axis=-1)
    if f == "slice_pad":
        k = 1 + a % 3
        return jnp.pad(h[:, k:], ((0, 0), (0, k))) + jnp.pad(h[:, :k], ((0, 0), (D - k, 0)))
    if f == "gather":
        perm = np.random.default_rng(a).permutation(D)
        idx = jnp.argmax(lax.stop_gradient(h), axis=-1)       # data-dependent int index
        return h[:, perm] + 0.1 * jnp.take_along_axis(h, idx[:, None], axis=-1)
    if f == "dynamic_slice":
        start = jnp.argmax(lax.stop_gradient(h[0])) % 3
        hp = jnp.pad(h, ((0, 0), (1, 2)))
        out = lax.dynamic_slice(hp, (0, start), (B, D))
        return lax.dynamic_update_slice(out, jnp.tanh(h[:, :2]), (0, start % 2))
    if f == "where":
        return jnp.where(h > 0, h, 0.1 * h) + jnp.where(h > 1.0, jnp.sin(h), 0.0)
    if f == "cumsum":
        return jnp.cumsum(h, axis=-1 if a % 2 else 0) / D
    if f == "sort":
        return jnp.sort(h, axis=-1) + 0.5 * h
    if f == "int_bool":
        mask = h > jnp.mean(h)
        count = jnp.sum(mask.astype(jnp.int32))
        ctx["aux"][f"count{i}"] = count
        ctx["aux"][f"any{i}"] = jnp.any(mask, axis=-1)
        return jnp.where(mask, h, 0.0) * (1.0 + count.astype(h.dtype) / (B * D))
    if f == "scan":
        def body(c: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
            c = jnp.tanh(c @ w) + c
            return c, jnp.sum(c)
        h, ys = lax.scan(body, h, p["w"])
        return h + 0.01 * jnp.sum(ys)
    if f == "cond":
        return lax.cond(jnp.sum(ctx["x"]) > 0, lambda z: jnp.tanh(z @ p["w"]),
                        lambda z: jnp.sin(z) @ p["w"], h)
    if f == "while":
        # a loop on a stopped value: a normaliser found by halving (not differentiated)
        def cond(c: tuple[jax.Array, jax.Array]) -> jax.Array:
            return (c[0] > 1.0) & (c[1] < 20)

        def body(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            return c[0] / 2.0, c[1] + 1

        m, n = lax.while_loop(cond, body, (jnp.max(jnp.abs(lax.stop_gradient(h))),
                                           jnp.int32(0)))
        ctx["aux"][f"halvings{i}"] = n
        return h / (2.0 ** n.astype(h.dtype)) + 0.0 * m
    if f == "custom_jvp":
        return _soft_clip(h)
    if f == "custom_vjp":
        return _grad_scale(h)
    if f == "nested_jit":
        return _inner_jit(h, p["w"], p["b"])
    if f == "checkpoint":
        fn = jax.checkpoint(lambda z, w, b: jax.nn.gelu(jnp.tanh(z @ w) @ w + b),
                            policy=(None if a % 2 else
                                    jax.checkpoint_policies.dots_with_no_batch_dims_saveable))
        return fn(h, p["w"], p["b"])
    if f == "checkpoint_name":
        return checkpoint_name(jnp.tanh(h), f"t{i}") * 2.0
    if f == "offload_name":
        import jaxmem
        return jnp.sin(jaxmem.offload_name(jnp.tanh(h), f"o{i}")) + h
    if f == "dropout":
        key = jax.random.fold_in(ctx["rng"], i)
        keep = jax.random.bernoulli(key, 0.8, h.shape)
        return jnp.where(keep, h / 0.8, 0.0)
    if f == "batchnorm":
        mu = jnp.mean(h, axis=0)
        var = jnp.var(h, axis=0)
        st = ctx["stats"][f"op{i}"]
        ctx["new_stats"][f"op{i}"] = {
            "mean": 0.9 * st["mean"] + 0.1 * lax.stop_gradient(mu),
            "var": 0.9 * st["var"] + 0.1 * lax.stop_gradient(var)}
        return (h - mu) * lax.rsqrt(var + 1e-5) * p["g"] + p["b"]
    if f == "low_precision":
        dt = jnp.bfloat16 if a % 2 else jnp.float16
        y = jnp.tanh(h.astype(dt) @ p["w"].astype(dt) + p["b"].astype(dt))
        return y.astype(jnp.float32)
    raise ValueError(f"unknown family {f!r}")


# -- the step -----------------------------------------------------------------------------------
def _opt_init(case: Case, params: Any) -> Any:
    if case.update == "sgd":
        return ()
    if case.update == "momentum":
        return jax.tree_util.tree_map(jnp.zeros_like, params)
    import optax
    return optax.adam(1e-2).init(params)


def _update(case: Case, params: Any, grads: Any, opt_state: Any) -> tuple[Any, Any]:
    if case.update == "sgd":
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), opt_state
    if case.update == "momentum":
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, opt_state, grads)
        return jax.tree_util.tree_map(lambda p, m: p - 0.05 * m, params, m), m
    import optax
    updates, opt_state = optax.adam(1e-2).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def make_step(case: Case) -> Callable[..., Any]:
    """The train step of ``case``: ``step(state, batch) -> (state, metrics)``."""

    def loss_fn(params: Any, stats: Any, batch: Any) -> tuple[jax.Array, Any]:
        ctx = {"aux": {}, "stats": stats, "new_stats": dict(stats), "rng": batch["rng"],
               "x": batch["x"]}
        if case.detached:
            params = lax.stop_gradient(params)
        h = batch["x"]
        for i, op in enumerate(case.ops):
            with jax.named_scope(f"op{i}_{op.family}"):   # layer names, as flax gives them
                h = _apply_op(i, op, h, params.get(f"op{i}", {}), ctx)
        out = h @ params["head"]["w"]
        if case.loss == "xent":
            logp = jax.nn.log_softmax(out, axis=-1)
            loss = -jnp.mean(jnp.take_along_axis(logp, batch["label"][:, None], axis=-1))
        else:
            loss = jnp.mean((out - batch["y"]) ** 2)
        return loss, (ctx["aux"], ctx["new_stats"])

    def step(state: Any, batch: Any) -> Any:
        params, opt_state, stats = state
        (loss, (aux, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, stats, batch)
        params, opt_state = _update(case, params, grads, opt_state)
        return (params, opt_state, new_stats), {"loss": loss, "grads": grads, "aux": aux}

    step.__name__ = f"step_seed{case.seed}"
    return step

