"""jaxmem in one screen: decorate a train step, train, and see the memory it saved.

Run:  python examples/demo.py

The figures are XLA's own (``memory_analysis()`` of the compiled step, argument + output +
temp - alias), for the plain ``jax.jit`` step and the ``@jaxmem.optimize`` step compiled the
same way (train state donated in both; barrier flag on CPU, see docs/concepts.md).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxmem


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(4 * self.width)(h))
        return x + nn.Dense(self.width)(h)


class Model(nn.Module):
    width: int = 256
    depth: int = 6

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        for _ in range(self.depth):
            x = Block(self.width)(x)
        return nn.Dense(10)(nn.LayerNorm()(x))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)

    model, tx = Model(), optax.adam(1e-3)
    kx, kp = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (args.batch, 64))
    y = (jnp.arange(args.batch) % 10).astype(jnp.int32)
    params = model.init(kp, x)
    state = (params, tx.init(params))

    @jaxmem.optimize
    def train_step(state, x, y):
        params, opt_state = state

        def loss_fn(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    plan = train_step.plan(state, x, y)  # traces, plans, compiles both variants
    print(plan)
    for i in range(args.steps):
        state, loss = train_step(state, x, y)
        print(f"step {i}: loss {float(loss):.4f}")
    saved = plan.baseline.peak - plan.compiled.peak
    print(f"\njaxmem saved {jaxmem.measure.fmt_bytes(saved)} "
          f"({100 * plan.saved_fraction:.1f}%) of the compiled peak: "
          f"{jaxmem.measure.fmt_bytes(plan.baseline.peak)} -> "
          f"{jaxmem.measure.fmt_bytes(plan.compiled.peak)}, "
          f"for {100 * (plan.compiled.flops / plan.baseline.flops - 1):+.2f}% FLOPs.")


if __name__ == "__main__":
    main()
