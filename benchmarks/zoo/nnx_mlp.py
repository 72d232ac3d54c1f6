"""``nnx_mlp``: a flax nnx residual MLP with dropout, trained through ``nnx.split`` /
``nnx.merge`` in a pure step, its forward under ``jaxmem.flax.nnx.named_scopes``; adam."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from benchmarks.zoo._common import (
    Batch,
    Built,
    ModelSpec,
    Policy,
    PyTree,
    State,
    cross_entropy,
    vector_data,
)


class NNXBlock(nnx.Module):
    """``x + LayerNorm(Dropout(Dense(gelu(Dense(x)))))`` in flax nnx."""

    def __init__(self, width: int, hidden: int, dropout: float, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(width, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(dropout)

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        h = self.down(nnx.gelu(self.up(x)))
        h = self.drop(h, rngs=key)
        return x + self.norm(h)


class NNXMLP(nnx.Module):
    """Embedding Linear, a list of :class:`NNXBlock` s, classifier head (flax nnx)."""

    def __init__(self, features, width, hidden, depth, classes, dropout, *, rngs: nnx.Rngs):
        self.embed = nnx.Linear(features, width, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(width, hidden, dropout, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x: jax.Array, key: jax.Array, policy: Policy | None = None) -> jax.Array:
        x = self.embed(x)
        keys = jax.random.split(key, len(self.blocks))
        for block, k in zip(self.blocks, keys, strict=True):
            if policy is None:
                x = block(x, k)
            else:
                x = nnx.remat(lambda b, h, kk: b(h, kk), policy=policy)(block, x, k)
        return self.head(x)


def build(*, key, rng, seed, policy, abstract, batch, features, width, hidden, depth, classes,
          dropout) -> Built:
    """The ``nnx_mlp`` train step (see :class:`benchmarks.zoo._common.ModelSpec`)."""
    from jaxmem.flax.nnx import named_scopes

    kd, km = jax.random.split(key)
    data = vector_data(kd, batch, features, classes)
    make = lambda: NNXMLP(features, width, hidden, depth, classes, dropout, rngs=nnx.Rngs(km))
    model = nnx.eval_shape(make) if abstract else make()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(1e-3)

    def loss_fn(params, rest, batch, dropout_key):
        model = nnx.merge(graphdef, params, rest)
        # Layer paths in the name stack (``blocks/3/up``), as nnx users are told to do
        # (docs/entry_points.md): what linen gives for free, and what block plans need.
        with named_scopes(model):
            logits = model(batch["x"], dropout_key, policy)
        return cross_entropy(logits, batch["y"])

    def loss_and_grads(state: State, batch: Batch) -> tuple[jax.Array, PyTree]:
        _, dropout_key = jax.random.split(state["rng"])
        return jax.value_and_grad(loss_fn)(state["params"], state["rest"], batch, dropout_key)

    def step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        rng, dropout_key = jax.random.split(state["rng"])
        loss, grads = jax.value_and_grad(loss_fn)(
            state["params"], state["rest"], batch, dropout_key
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = dict(
            state,
            params=optax.apply_updates(state["params"], updates),
            opt_state=opt_state,
            step=state["step"] + 1,
            rng=rng,
        )
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    state: State = {
        "params": params,
        "rest": rest,
        "opt_state": jax.eval_shape(tx.init, params) if abstract else tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": rng,
    }
    return Built(step, loss_and_grads, state, data, depth)


MODELS = {
    "nnx_mlp": ModelSpec(
        build,
        {
            "test": dict(batch=16, features=32, width=32, hidden=64, depth=3, classes=10,
                         dropout=0.1),
            "bench": dict(batch=512, features=256, width=256, hidden=1024, depth=8, classes=100,
                          dropout=0.1),
        },
        "flax nnx residual MLP with dropout, nnx.split/merge in a pure step, forward "
        "under jaxmem.flax.nnx.named_scopes; adam",
    ),
}
