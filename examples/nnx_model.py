"""A flax nnx model with jaxmem's nnx wrappers: remat, intercept, named scopes, chunking.

Run:  python examples/nnx_model.py           (batch 1024, width 512, a few steps)
      python examples/nnx_model.py --small   (the CI size)
      python -m jaxmem analyze examples/nnx_model.py:make_step

nnx modules are plain Python objects; a pure train step splits the model into a graph
definition and state once, and merges it back inside the loss (``nnx.split``/``nnx.merge``),
which is what ``jax.jit`` and ``jaxmem.optimize`` need. Four ways to spend less memory, each
measured with XLA's compiled peak:

- ``jaxmem.flax.nnx.remat(Block)``: a Block subclass whose call runs under ``nnx.remat``
  with ``jaxmem.policies.utility`` (keep Linear outputs, recompute gelu/LayerNorm/adds);
- ``with jaxmem.flax.nnx.intercept(Block):`` the same for every Block, without changing the
  model (active while the step is traced);
- ``jaxmem.flax.nnx.chunked(wide_layer, chunks=4)``: a wide layer run a quarter of the
  batch at a time (MEDL's bottleneck layer);
- ``jaxmem.optimize(train_step)`` on the plain step.

``jaxmem.flax.nnx.named_scopes(model)`` puts the module paths (``blocks/3/up``) in the name
stack, so :func:`jaxmem.analyze` reports residuals by layer.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxmem


class Block(nnx.Module):
    """``x + LayerNorm(Linear(gelu(Linear(x))))``."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x):
        return x + self.norm(self.down(nnx.gelu(self.up(x))))


class Head(nnx.Module):
    """A wide classifier head: ``Linear(relu(Linear(x)))`` with a ``16 * width`` hidden layer."""

    def __init__(self, width: int, classes: int, *, rngs: nnx.Rngs):
        self.wide = nnx.Linear(width, 16 * width, rngs=rngs)
        self.out = nnx.Linear(16 * width, classes, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.wide(x)))


class Model(nnx.Module):
    """Embedding Linear, ``depth`` Blocks (of class ``block``), a wide head (chunked or not)."""

    def __init__(self, features: int, width: int, depth: int, classes: int, *,
                 block: type[Block] = Block, head_chunks: int = 1, rngs: nnx.Rngs):
        self.embed = nnx.Linear(features, width, rngs=rngs)
        self.blocks = nnx.List([block(width, rngs=rngs) for _ in range(depth)])
        head = Head(width, classes, rngs=rngs)
        self.head = jaxmem.flax.nnx.chunked(head, chunks=head_chunks) if head_chunks > 1 else head

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_step(batch: int | None = None, *, small: bool = False, block: type[Block] = Block,
              head_chunks: int = 1) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A pure train step ``(state, x, y) -> (state, loss)`` and its arguments."""
    features, width, depth, classes = (32, 32, 3, 10) if small else (256, 512, 6, 100)
    batch = batch or (32 if small else 1024)
    model = Model(features, width, depth, classes, block=block, head_chunks=head_chunks,
                  rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(1e-3)
    kx = jax.random.key(1)
    x = jax.random.normal(kx, (batch, features))
    y = jnp.arange(batch) % classes

    def loss_fn(params, rest, x, y):
        model = nnx.merge(graphdef, params, rest)
        with jaxmem.flax.nnx.named_scopes(model):  # layer paths in jaxmem.analyze
            logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], state["rest"], x, y)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = dict(state, params=optax.apply_updates(state["params"], updates),
                   opt_state=opt_state)
        return new, loss

    state = {"params": params, "rest": rest, "opt_state": tx.init(params)}
    return train_step, (state, x, y)


def main(argv: list[str] | None = None) -> None:
    """Compare the wrappers' compiled peaks, show the analysis, train a few steps."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model and batch (CI)")
    ap.add_argument("--batch", type=int, help="batch size (default 1024; 32 with --small)")
    ap.add_argument("--steps", type=int, help="train steps (default 5; 2 with --small)")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.small else 5)
    fmt = jaxmem.measure.fmt_bytes

    def peak(step: Callable[..., Any], step_args: tuple) -> jaxmem.measure.Figures:
        # State donated, compiled the jaxmem way (CPU barrier flag), like optimize's baseline.
        return jaxmem.measure.measure(jax.jit(step, donate_argnums=0), *step_args)

    plain_step, step_args = make_step(args.batch, small=args.small)
    print(jaxmem.analyze(plain_step, *step_args))  # residuals by layer: blocks/0/up, ...
    print()

    rows = [("jax.jit", peak(plain_step, step_args))]
    remat_step, _ = make_step(args.batch, small=args.small, block=jaxmem.flax.nnx.remat(Block))
    rows.append(("jaxmem.flax.nnx.remat(Block)", peak(remat_step, step_args)))
    # A fresh step function: jax caches traces per function, and intercept acts at trace time.
    intercepted_step, _ = make_step(args.batch, small=args.small)
    with jaxmem.flax.nnx.intercept(Block):  # every Block call rematted while tracing
        rows.append(("with jaxmem.flax.nnx.intercept(Block)", peak(intercepted_step, step_args)))
    chunked_step, chunked_args = make_step(args.batch, small=args.small, head_chunks=4)
    rows.append(("jaxmem.flax.nnx.chunked(head, chunks=4)", peak(chunked_step, chunked_args)))
    step = jaxmem.optimize(plain_step)
    plan = step.plan(*step_args)
    rows.append(("jaxmem.optimize(train_step)", plan.compiled))
    base = rows[0][1]
    for name, fig in rows:
        print(f"{name:<42} peak {fmt(fig.peak):>11} ({100 * (fig.peak / base.peak - 1):+6.1f}%)"
              f"  {fig.flops / 1e9:8.3f} GFLOP")
    print("(XLA's FLOP count includes a scan body once, so it under-counts the chunked head.)\n")

    state, x, y = step_args
    for i in range(steps):
        state, loss = step(state, x, y)  # state is donated: keep the new one
        print(f"step {i}: loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
