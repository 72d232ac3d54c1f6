"""``mlp``: a deep residual MLP (Dense → gelu → Dense → LayerNorm, residual add), adam."""

from __future__ import annotations

import flax.linen as nn
import jax
import optax

from benchmarks.zoo._common import (
    Built,
    ModelSpec,
    Policy,
    linen_train_step,
    maybe_remat,
    vector_data,
)


class MLPBlock(nn.Module):
    """``x + LayerNorm(Dense(gelu(Dense(x))))``."""

    width: int
    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(self.hidden, name="up")(x)
        h = nn.gelu(h)
        h = nn.Dense(self.width, name="down")(h)
        h = nn.LayerNorm(name="norm")(h)
        return x + h


class MLP(nn.Module):
    """Embedding Dense, ``depth`` residual :class:`MLPBlock` s, classifier head."""

    width: int
    hidden: int
    depth: int
    classes: int
    policy: Policy | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block = maybe_remat(MLPBlock, self.policy)
        x = nn.Dense(self.width, name="embed")(x)
        for i in range(self.depth):
            x = block(self.width, self.hidden, name=f"block{i}")(x)
        return nn.Dense(self.classes, name="head")(x)


def build(*, key, rng, seed, policy, abstract, batch, features, width, hidden, depth,
          classes) -> Built:
    """The ``mlp`` train step (see :class:`benchmarks.zoo._common.ModelSpec`)."""
    kd, km = jax.random.split(key)
    data = vector_data(kd, batch, features, classes)
    model = MLP(width, hidden, depth, classes, policy)
    step, grads, state = linen_train_step(model, optax.adam(1e-3), km, rng, data,
                                          abstract=abstract)
    return Built(step, grads, state, data, depth)


MODELS = {
    "mlp": ModelSpec(
        build,
        {
            "test": dict(batch=16, features=32, width=32, hidden=64, depth=3, classes=10),
            "bench": dict(batch=512, features=256, width=256, hidden=1024, depth=8, classes=100),
        },
        "residual MLP: Dense→gelu→Dense→LayerNorm + skip, per block; adam",
    ),
}
