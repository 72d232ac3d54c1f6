"""``densenet``: a DenseNet-style net (feature maps concatenated), BN-relu-conv layers and
transitions with average pooling; sgd with momentum."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks.zoo._common import (
    Built,
    ModelSpec,
    Policy,
    image_data,
    linen_train_step,
    maybe_remat,
    sgd,
)


class DenseLayer(nn.Module):
    """``concat([x, Conv3x3(relu(BN(x)))])``: the input feature maps are kept and grown."""

    growth: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn")(x))
        y = nn.Conv(self.growth, (3, 3), use_bias=False, name="conv")(y)
        return jnp.concatenate([x, y], axis=-1)


class Transition(nn.Module):
    """``avg_pool(Conv1x1(relu(BN(x))))`` halving the channels and the resolution."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn")(x))
        y = nn.Conv(x.shape[-1] // 2, (1, 1), use_bias=False, name="conv")(y)
        return nn.avg_pool(y, (2, 2), strides=(2, 2))


class DenseNet(nn.Module):
    """Stem conv, dense blocks of :class:`DenseLayer` s with :class:`Transition` s between."""

    growth: int
    layers_per_block: Sequence[int]
    stem: int
    classes: int
    policy: Policy | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layer = maybe_remat(DenseLayer, self.policy)
        transition = maybe_remat(Transition, self.policy)
        x = nn.Conv(self.stem, (3, 3), use_bias=False, name="stem")(x)
        for b, n in enumerate(self.layers_per_block):
            if b:
                x = transition(name=f"transition{b}")(x)
            for i in range(n):
                x = layer(self.growth, name=f"block{b}_layer{i}")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="final_bn")(x))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes, name="head")(x)


def build(*, key, rng, seed, policy, abstract, batch, image, growth, layers_per_block, stem,
          classes) -> Built:
    """The ``densenet`` train step (see :class:`benchmarks.zoo._common.ModelSpec`)."""
    kd, km = jax.random.split(key)
    data = image_data(kd, batch, image, classes)
    model = DenseNet(growth, tuple(layers_per_block), stem, classes, policy)
    step, grads, state = linen_train_step(model, sgd(), km, rng, data, batch_norm=True,
                                          abstract=abstract)
    n_blocks = sum(layers_per_block) + len(layers_per_block) - 1
    return Built(step, grads, state, data, n_blocks)


MODELS = {
    "densenet": ModelSpec(
        build,
        {
            "test": dict(batch=4, image=16, growth=4, layers_per_block=(2, 2), stem=8,
                         classes=10),
            "bench": dict(batch=32, image=32, growth=12, layers_per_block=(3, 3, 3), stem=24,
                          classes=10),
        },
        "DenseNet: BN→relu→conv3x3 layers concatenated, 1x1+avgpool transitions; sgd",
    ),
}
