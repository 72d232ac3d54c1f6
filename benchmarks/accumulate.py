"""A gradient-accumulation step planned recursively: ``python -m benchmarks.accumulate``.

A 4-block flax MLP (LayerNorm, Dense 4x, gelu, Dense, residual add; width 128), 4
micro-batches of 512 in a ``lax.scan``, each a ``value_and_grad`` whose gradients the carry
sums. Prints jaxmem's plan (compiled peak of the plain step and of jaxmem's) and the largest
difference of the results against ``jax.jit``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxmem

MICRO, B, D = 4, 512, 128


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x)))
        return x + nn.Dense(D)(h)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = Block(name=f"block{i}")(x)
        return x


NET = Net()


def loss(params, x):
    return jnp.mean(NET.apply(params, x) ** 2)


def step(params, xs):
    def body(acc, x):
        value, g = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(jnp.add, acc, g), value
    grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), xs)
    return jax.tree.map(lambda p, g: p - 0.01 * g / MICRO, params, grads), losses.mean()


def main() -> None:
    xs = jax.random.normal(jax.random.key(1), (MICRO, B, D))
    params = NET.init(jax.random.key(0), xs[0])
    fast = jaxmem.optimize(step, donate_argnums=())
    print(fast.plan(params, xs))
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), fast(params, xs),
                        jax.jit(step)(params, xs))
    print("largest difference from jax.jit:", max(jax.tree.leaves(diff)))


if __name__ == "__main__":
    main()
