"""``unet``: a U-Net for per-pixel classification (Conv-BN-relu ×2 stages, max pooling down,
ConvTranspose up, encoder features concatenated in the decoder, 1×1 conv head), per-pixel
cross-entropy; adam."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.zoo._common import (
    Built,
    ModelSpec,
    Policy,
    linen_train_step,
    maybe_remat,
    segmentation_data,
)


class DoubleConv(nn.Module):
    """Two ``relu(BatchNorm(Conv3x3(x)))``: one U-Net encoder, bottleneck or decoder stage."""

    channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(2):
            x = nn.Conv(self.channels, (3, 3), use_bias=False, name=f"conv{i}")(x)
            x = nn.BatchNorm(use_running_average=False, momentum=0.9, name=f"bn{i}")(x)
            x = nn.relu(x)
        return x


class UpBlock(nn.Module):
    """U-Net decoder stage: 2x2 stride-2 ConvTranspose, skip concatenated, :class:`DoubleConv`."""

    channels: int

    @nn.compact
    def __call__(self, x: jax.Array, skip: jax.Array) -> jax.Array:
        x = nn.ConvTranspose(self.channels, (2, 2), strides=(2, 2), name="up")(x)
        x = jnp.concatenate([skip, x], axis=-1)
        return DoubleConv(self.channels, name="conv")(x)


class UNet(nn.Module):
    """U-Net: :class:`DoubleConv` encoder stages with 2x2 max pooling, a bottleneck stage,
    :class:`UpBlock` decoder stages concatenating the matching encoder features, 1x1 conv head
    giving per-pixel class logits. ``channels[-1]`` is the bottleneck's width."""

    channels: Sequence[int]
    classes: int
    policy: Policy | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        down = maybe_remat(DoubleConv, self.policy)
        up = maybe_remat(UpBlock, self.policy)
        skips = []
        for s, c in enumerate(self.channels[:-1]):
            x = down(c, name=f"down{s}")(x)
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = down(self.channels[-1], name="bottleneck")(x)
        for s in reversed(range(len(self.channels) - 1)):
            x = up(self.channels[s], name=f"up{s}")(x, skips[s])
        return nn.Conv(self.classes, (1, 1), name="head")(x)


def build(*, key, rng, seed, policy, abstract, batch, image, channels, classes) -> Built:
    """The ``unet`` train step (see :class:`benchmarks.zoo._common.ModelSpec`)."""
    if image % 2 ** (len(channels) - 1):
        raise ValueError(f"unet: image {image} is not divisible by 2**{len(channels) - 1}")
    kd, km = jax.random.split(key)
    data = segmentation_data(kd, batch, image, classes)
    model = UNet(tuple(channels), classes, policy)
    step, grads, state = linen_train_step(model, optax.adam(1e-3), km, rng, data,
                                          batch_norm=True, abstract=abstract)
    return Built(step, grads, state, data, 2 * len(channels) - 1)


MODELS = {
    "unet": ModelSpec(
        build,
        {
            "test": dict(batch=2, image=16, channels=(8, 16), classes=4),
            "bench": dict(batch=8, image=64, channels=(16, 32, 64, 128), classes=4),
        },
        "U-Net segmentation: conv-BN-relu, maxpool, convT up, skip concat; per-pixel CE; adam",
    ),
}
