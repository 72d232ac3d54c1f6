"""A GPT-style language model whose loss never materialises the logits.

Run:  python examples/gpt_chunked_ce.py           (vocab 8192, 512 tokens x 4, a few steps)
      python examples/gpt_chunked_ce.py --small   (the CI size)
      python -m jaxmem bench examples/gpt_chunked_ce.py:make_step

The LM head of a language model makes a ``[tokens, vocab]`` logits array, and its softmax
cross-entropy a few more of the same size: for a large vocabulary that is the single biggest
value in the step. ``jaxmem.chunked_cross_entropy(hidden, weight, labels)`` computes the same
loss (and gradient) a chunk of tokens at a time, so only one ``[tokens / chunks, vocab]``
block exists at once. The rest of the step goes through ``@jaxmem.optimize`` as usual.

The script prints XLA's compiled peak of three versions of the same step: plain ``jax.jit``
with the usual ``optax`` loss on full logits, plain ``jax.jit`` with the chunked loss, and
``@jaxmem.optimize`` with the chunked loss; then trains a few steps with the last.
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


class Block(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention and a gelu MLP, residual adds."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads, deterministic=True)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.d_model)(nn.gelu(nn.Dense(4 * self.d_model)(h)))


class GPT(nn.Module):
    """Token + position embeddings, decoder blocks, a final LayerNorm. Returns hidden states.

    The LM head is tied to the token embedding: ``logits = hidden @ embedding.T``; the loss
    takes ``embedding.T`` as the head weight.
    """

    vocab: int
    d_model: int
    heads: int
    layers: int
    seq: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model, name="embed")(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.d_model))
        for _ in range(self.layers):
            x = Block(self.d_model, self.heads)(x)
        return nn.LayerNorm()(x)


def _config(small: bool) -> dict[str, int]:
    if small:
        return dict(vocab=512, d_model=32, heads=2, layers=2, seq=32)
    return dict(vocab=8192, d_model=128, heads=4, layers=4, seq=512)


def make_step(batch: int | None = None, *, small: bool = False, chunked: bool = True,
              token_chunks: int = 8) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The plain train step and its arguments ``(state, tokens)``.

    With ``chunked=False`` the loss is ``optax.softmax_cross_entropy_with_integer_labels`` on
    the full logits (the usual way), for comparison.
    """
    cfg = _config(small)
    batch = batch or (2 if small else 4)
    model = GPT(**cfg)
    tx = optax.adamw(3e-4)
    kt, kp = jax.random.split(jax.random.key(0))
    tokens = jax.random.randint(kt, (batch, cfg["seq"] + 1), 0, cfg["vocab"])
    params = model.init(kp, tokens[:, :-1])["params"]
    state = {"params": params, "opt_state": tx.init(params)}

    def loss_fn(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        hidden = model.apply({"params": params}, inputs)  # [batch, seq, d_model]
        head = params["embed"]["embedding"].T  # tied LM head, [d_model, vocab]
        if chunked:
            return jaxmem.chunked_cross_entropy(hidden, head, targets, token_chunks=token_chunks)
        logits = hidden @ head  # [batch, seq, vocab]: the big one
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def train_step(state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    return train_step, (state, tokens)


def main(argv: list[str] | None = None) -> None:
    """Compare compiled peaks, then train a few steps with the chunked, optimised step."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model (CI)")
    ap.add_argument("--batch", type=int, help="sequences per batch (default 4; 2 with --small)")
    ap.add_argument("--steps", type=int, help="train steps (default 5; 2 with --small)")
    ap.add_argument("--token-chunks", type=int, default=8, help="chunks of the loss (default 8)")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.small else 5)
    fmt = jaxmem.measure.fmt_bytes

    dense_step, (state, tokens) = make_step(args.batch, small=args.small, chunked=False)
    train_step, _ = make_step(args.batch, small=args.small, token_chunks=args.token_chunks)
    # Same donation in every variant (the state), compiled the jaxmem way (CPU barrier flag).
    dense = jaxmem.measure.measure(jax.jit(dense_step, donate_argnums=0), state, tokens)
    chunked = jaxmem.measure.measure(jax.jit(train_step, donate_argnums=0), state, tokens)
    step = jaxmem.optimize(train_step)
    plan = step.plan(state, tokens)
    print(plan)
    print()
    rows = [("jax.jit, full logits + optax loss", dense),
            ("jax.jit, jaxmem.chunked_cross_entropy", chunked),
            ("jaxmem.optimize + chunked_cross_entropy", plan.compiled)]
    for name, fig in rows:
        print(f"{name:<42} peak {fmt(fig.peak):>11} ({100 * (fig.peak / dense.peak - 1):+6.1f}%)"
              f"  {fig.flops / 1e9:8.3f} GFLOP")
    print("(XLA's FLOP count includes a scan body once, so it under-counts the chunked loss.)\n")
    for i in range(steps):
        state, loss = step(state, tokens)  # state is donated: keep the new one
        print(f"step {i}: loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
