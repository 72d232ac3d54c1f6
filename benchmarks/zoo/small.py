"""Tiny linen models and step builders for unit tests: not zoo workloads, not registered.

Where :func:`benchmarks.zoo.make` gives a whole :class:`~benchmarks.zoo.Workload` (its own
data, optimizer and state layout), these give the pieces a test composes itself: a model
class, :func:`make_loss` (a scalar loss of ``(params, x)``) or :func:`make_step` (a train
step of ``(state, x, y)`` with the optimizer the test chooses). Labels are ``arange % 10``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from benchmarks.zoo.small import MLP, make_loss
  >>> loss, params, rest = make_loss(MLP(width=8, depth=2), jnp.ones((4, 16)))
  >>> bool(jnp.isfinite(jax.jit(loss)(params, jnp.ones((4, 16)))))
  True
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class MLP(nn.Module):
    """``depth`` Dense+gelu layers and a 10-way Dense head."""

    width: int = 256
    depth: int = 4

    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(self.depth):
            x = nn.gelu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    """Conv + BatchNorm + swish + pooling: a linen CNN with batch statistics."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        for c in (16, 32):
            x = nn.Conv(c, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.swish(x)
            x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class Block(nn.Module):
    """Residual conv block with LayerNorm and swish (no BatchNorm)."""

    channels: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        y = nn.swish(nn.LayerNorm()(nn.Conv(self.channels, (3, 3))(x)))
        y = nn.LayerNorm()(nn.Conv(self.channels, (3, 3))(y))
        return nn.swish(x + y)


class ResNet(nn.Module):
    """Conv stem, ``blocks`` :class:`Block` s, mean pool, 10-way Dense head."""

    blocks: int = 3

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(16, (3, 3))(x)
        for _ in range(self.blocks):
            x = Block(16)(x)
        return nn.Dense(10)(x.mean((1, 2)))


class DropMLP(nn.Module):
    """Three Dense-LayerNorm-relu-Dropout(0.2) layers and a 10-way Dense head."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(3):
            x = nn.Dense(128)(x)
            x = nn.LayerNorm()(x)
            x = nn.relu(x)
            x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(10)(x)


def make_loss(model: nn.Module, x: jax.Array):
    """(loss(params, x), params, extra variables) for a classification model."""
    y = jnp.arange(x.shape[0]) % 10
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}

    def loss(params, x):
        out = model.apply({"params": params, **rest}, x, mutable=list(rest) or False,
                          rngs={"dropout": jax.random.key(2)})
        logits = out[0] if rest else out
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss, params, rest


def make_step(model: nn.Module, x: jax.Array, tx=None):
    """A full train step (value_and_grad + optax update + batch_stats + dropout key)."""
    tx = tx or optax.adam(1e-3)
    y = jnp.arange(x.shape[0]) % 10
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    params = variables["params"]
    stats = variables.get("batch_stats", {})
    state = {"params": params, "opt": tx.init(params), "stats": stats,
             "key": jax.random.key(3)}

    def step(state, x, y):
        key, sub = jax.random.split(state["key"])

        def loss(params):
            out, upd = model.apply({"params": params, "batch_stats": state["stats"]}, x,
                                   mutable=["batch_stats"], rngs={"dropout": sub})
            ce = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
            return ce, upd.get("batch_stats", {})

        (loss_val, stats), g = jax.value_and_grad(loss, has_aux=True)(state["params"])
        upd, opt = tx.update(g, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], upd), "opt": opt,
               "stats": stats, "key": key}
        return new, {"loss": loss_val}

    return step, state, (x, y)
