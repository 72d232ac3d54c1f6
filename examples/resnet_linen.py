"""A flax linen ResNet on synthetic CIFAR-shaped data, trained with ``@jaxmem.optimize``.

Run:  python examples/resnet_linen.py            (batch 128, 32x32x3 images, a few steps)
      python examples/resnet_linen.py --small    (the CI size: batch 8, narrow, 2 steps)
      python -m jaxmem plan examples/resnet_linen.py:make_step

The train step is an ordinary one: BatchNorm statistics in a mutable collection, softmax
cross-entropy, SGD with momentum. The only jaxmem line is the decorator. The plan printed
first says which residuals (BatchNorm outputs, relus, skip adds: MEDL's utility layers) are
recomputed in the backward pass instead of kept, and XLA's compiled peak with and without.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxmem


class BasicBlock(nn.Module):
    """conv3x3-BN-relu-conv3x3-BN, plus the (projected) input, then relu."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
        h = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
        h = nn.relu(norm()(h))
        h = nn.Conv(self.features, (3, 3), use_bias=False)(h)
        h = norm()(h)
        if x.shape != h.shape:
            x = norm()(nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + h)


class ResNet(nn.Module):
    """CIFAR ResNet: a 3x3 stem, ``len(widths)`` stages of basic blocks, global pooling."""

    widths: tuple[int, ...] = (32, 64, 128)
    blocks_per_stage: int = 2
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for i, width in enumerate(self.widths):
            for j in range(self.blocks_per_stage):
                x = BasicBlock(width, strides=2 if i and not j else 1)(x, train)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def make_step(batch: int | None = None, *, small: bool = False
              ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The plain train step and its arguments ``(state, images, labels)``.

    ``python -m jaxmem analyze|plan|bench examples/resnet_linen.py:make_step`` calls this.
    """
    batch = batch or (8 if small else 128)
    model = ResNet(widths=(8, 16), blocks_per_stage=1) if small else ResNet()
    tx = optax.sgd(0.05, momentum=0.9)
    kx, kp = jax.random.split(jax.random.key(0))
    images = jax.random.normal(kx, (batch, 32, 32, 3))  # CIFAR-shaped, synthetic
    labels = jnp.arange(batch) % model.classes
    variables = model.init(kp, images[:1])
    params = variables["params"]
    state = {"params": params, "batch_stats": variables["batch_stats"],
             "opt_state": tx.init(params)}

    def train_step(state, images, labels):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state["batch_stats"]}, images,
                mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates),
               "batch_stats": batch_stats, "opt_state": opt_state}
        return new, loss

    return train_step, (state, images, labels)


def main(argv: list[str] | None = None) -> None:
    """Print the plan, then train a few steps with the optimised step."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model and batch (CI)")
    ap.add_argument("--batch", type=int, help="batch size (default 128; 8 with --small)")
    ap.add_argument("--steps", type=int, help="train steps (default 5; 2 with --small)")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.small else 5)

    train_step, (state, images, labels) = make_step(args.batch, small=args.small)
    step = jaxmem.optimize(train_step)  # the one-line change: instead of jax.jit(train_step)

    plan = step.plan(state, images, labels)  # traces, plans, compiles (plain and jaxmem)
    print(plan)
    for i in range(steps):
        state, loss = step(state, images, labels)  # state is donated: keep the new one
        print(f"step {i}: loss {float(loss):.4f}")
    fmt = jaxmem.measure.fmt_bytes
    print(f"\ncompiled peak: plain jit {fmt(plan.baseline.peak)}, jaxmem {fmt(plan.compiled.peak)}"
          f" ({100 * plan.saved_fraction:.1f}% saved, "
          f"{100 * (plan.compiled.flops / plan.baseline.flops - 1):+.2f}% FLOPs)")


if __name__ == "__main__":
    main()
