"""``cnn_bn``: a CNN with BatchNorm (mutable ``batch_stats``), relu, max/avg pooling, Dense
head; sgd with momentum."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from benchmarks.zoo._common import (
    Built,
    ModelSpec,
    Policy,
    image_data,
    linen_train_step,
    maybe_remat,
    sgd,
)


class ConvBN(nn.Module):
    """``relu(BatchNorm(Conv3x3(x)))``, batch statistics updated in training."""

    channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.channels, (3, 3), use_bias=False, name="conv")(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn")(x)
        return nn.relu(x)


class CNN(nn.Module):
    """Stages of :class:`ConvBN`, max pooling then average pooling between stages, Dense head."""

    channels: Sequence[int]
    convs_per_stage: int
    classes: int
    policy: Policy | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block = maybe_remat(ConvBN, self.policy)
        for s, c in enumerate(self.channels):
            if s:
                pool = nn.max_pool if s % 2 else nn.avg_pool
                x = pool(x, (2, 2), strides=(2, 2))
            for i in range(self.convs_per_stage):
                x = block(c, name=f"stage{s}_conv{i}")(x)
        x = nn.avg_pool(x, x.shape[1:3])  # global average pooling via reduce_window
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(self.classes, name="head")(x)


def build(*, key, rng, seed, policy, abstract, batch, image, channels, convs_per_stage,
          classes) -> Built:
    """The ``cnn_bn`` train step (see :class:`benchmarks.zoo._common.ModelSpec`)."""
    kd, km = jax.random.split(key)
    data = image_data(kd, batch, image, classes)
    model = CNN(tuple(channels), convs_per_stage, classes, policy)
    step, grads, state = linen_train_step(model, sgd(), km, rng, data, batch_norm=True,
                                          abstract=abstract)
    return Built(step, grads, state, data, len(channels) * convs_per_stage)


MODELS = {
    "cnn_bn": ModelSpec(
        build,
        {
            "test": dict(batch=4, image=16, channels=(8, 16), convs_per_stage=2, classes=10),
            "bench": dict(batch=32, image=32, channels=(32, 64, 128), convs_per_stage=2,
                          classes=10),
        },
        "CNN: Conv→BatchNorm→relu, max/avg pooling, Dense head; sgd+momentum",
    ),
}
