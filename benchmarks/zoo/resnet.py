"""``resnet`` and ``resnet_bottleneck``: CIFAR-style ResNets, sgd with momentum.

- ``resnet``: basic blocks (BN, relu, skip adds, strided 1×1 projection).
- ``resnet_bottleneck``: bottleneck blocks (1×1 reduce → 3×3 → 1×1 expand to 4× the width,
  BN, relu, skip adds, strided 1×1 projection).
"""

from __future__ import annotations

import functools
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


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-relu-conv-BN, plus a (strided 1x1 conv-BN) skip, relu."""

    channels: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        bn = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9)
        s = (self.strides, self.strides)
        y = nn.Conv(self.channels, (3, 3), s, use_bias=False, name="conv1")(x)
        y = nn.relu(bn(name="bn1")(y))
        y = nn.Conv(self.channels, (3, 3), use_bias=False, name="conv2")(y)
        y = bn(name="bn2", scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.channels, (1, 1), s, use_bias=False, name="proj")(x)
            x = bn(name="proj_bn")(x)
        return nn.relu(x + y)


class BottleneckBlock(nn.Module):
    """ResNet bottleneck block: 1x1 reduce, 3x3 (strided), 1x1 expand to ``expansion * channels``,
    each conv followed by BN (relu after the first two), plus a (strided 1x1 conv-BN) skip, relu.
    """

    channels: int
    strides: int = 1
    expansion: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        bn = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9)
        s = (self.strides, self.strides)
        out = self.channels * self.expansion
        y = nn.Conv(self.channels, (1, 1), use_bias=False, name="conv1")(x)
        y = nn.relu(bn(name="bn1")(y))
        y = nn.Conv(self.channels, (3, 3), s, use_bias=False, name="conv2")(y)
        y = nn.relu(bn(name="bn2")(y))
        y = nn.Conv(out, (1, 1), use_bias=False, name="conv3")(y)
        y = bn(name="bn3", scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(out, (1, 1), s, use_bias=False, name="proj")(x)
            x = bn(name="proj_bn")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """CIFAR-style ResNet: 3x3 stem, stages of ``block`` s, global pool, Dense.

    ``block`` is :class:`BasicBlock` (``channels[s]`` wide) or :class:`BottleneckBlock`
    (``channels[s]`` inside, ``4 * channels[s]`` out); the stem is ``channels[0]`` wide.
    """

    channels: Sequence[int]
    blocks_per_stage: int
    classes: int
    policy: Policy | None = None
    block: type[nn.Module] = BasicBlock

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block = maybe_remat(self.block, self.policy)
        x = nn.Conv(self.channels[0], (3, 3), use_bias=False, name="stem")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="stem_bn")(x))
        for s, c in enumerate(self.channels):
            for i in range(self.blocks_per_stage):
                strides = 2 if s and i == 0 else 1
                x = block(c, strides, name=f"stage{s}_block{i}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes, name="head")(x)


def build(*, key, rng, seed, policy, abstract, batch, image, channels, blocks_per_stage,
          classes, block: type[nn.Module] = BasicBlock) -> Built:
    """The ``resnet`` train step, or with ``block=BottleneckBlock`` ``resnet_bottleneck``."""
    kd, km = jax.random.split(key)
    data = image_data(kd, batch, image, classes)
    model = ResNet(tuple(channels), blocks_per_stage, classes, policy, block)
    step, grads, state = linen_train_step(model, sgd(), km, rng, data, batch_norm=True,
                                          abstract=abstract)
    return Built(step, grads, state, data, len(channels) * blocks_per_stage)


MODELS = {
    "resnet": ModelSpec(
        build,
        {
            "test": dict(batch=4, image=16, channels=(8, 16), blocks_per_stage=1, classes=10),
            "bench": dict(batch=32, image=32, channels=(16, 32, 64), blocks_per_stage=2,
                          classes=10),
        },
        "CIFAR ResNet: basic blocks (BN, relu, skip add, strided 1x1 proj); sgd+momentum",
    ),
    "resnet_bottleneck": ModelSpec(
        functools.partial(build, block=BottleneckBlock),
        {
            "test": dict(batch=4, image=16, channels=(8, 16), blocks_per_stage=1, classes=10),
            "bench": dict(batch=16, image=32, channels=(16, 32, 64), blocks_per_stage=2,
                          classes=10),
        },
        "CIFAR ResNet: bottleneck blocks (1x1→3x3→1x1, BN, relu, skip add); sgd",
    ),
}
