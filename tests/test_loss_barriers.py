"""The rewrite's barriers around a language model's loss (jaxmem.rewriting.rewrite).

A re-created value is emitted behind an ``optimization_barrier`` tied to its backward
region's cotangents, and a barrier operand is a buffer of its own. Two ways that went wrong
on a decoder with a 30k vocabulary (transformers' Flax GPT-2 at flax's lm1b width, where
every plan compiled 13% to 26% above the plain step on the H100 target):

- the loss region reads no cotangent but the loss's seed broadcast over the vocabulary
  (derived from constants alone); tied to it, the barrier made XLA materialise a
  ``[batch, sequence, vocabulary]`` float32 buffer it otherwise fuses into its readers;
- the logits' softmax re-created from the logits through the barrier: XLA writes no
  result into a barrier operand's buffer, so the logits' gradient, an elementwise function
  of the logits that reads them last, took a second logits-sized buffer.

These tests check both on a small LM head, that the values do not change, and the memory
relation on the H100 target (compile only).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
from jaxmem.program import trace

from jaxmem.analyzing.analysis import from_program
from jaxmem.compiling.steps import figures
from jaxmem.rewriting.rewrite import rewrite
from jaxmem.xla import targets

B, S, D, V = 8, 64, 32, 4096


def _step(params, ids, labels):
    def loss(p):
        h = jnp.tanh(p["emb"][ids] @ p["w"])
        logits = (h.astype(jnp.bfloat16) @ p["head"].astype(jnp.bfloat16))
        ce = optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, V))
        return ce.mean()

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _args():
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"emb": jax.random.normal(k[0], (V, D)) * 0.1,
              "w": jax.random.normal(k[1], (D, D)) * 0.2,
              "head": jax.random.normal(k[2], (D, V)) * 0.2}
    ids = jax.random.randint(k[3], (B, S), 0, V)
    return params, ids, jax.random.randint(k[4], (B, S), 0, V)


def _rewritten():
    args = _args()
    prog = trace(_step, *args)
    res = from_program(prog).residuals
    # the softmax's vocabulary-wide residuals (the logits' shifted exponentials)
    softmax = {r.value for r in res if r.shape[-1:] == (V,) and r.primitive in ("exp", "sub")}
    assert softmax
    return prog, args, rewrite(prog, softmax)


def _logits(jaxpr):
    out = [v for e in jaxpr.eqns if e.primitive.name == "dot_general"
           for v in e.outvars if v.aval.shape == (B, S, V)]
    assert len(out) == 1
    return out[0]


def test_barriers_tie_no_vocabulary_wide_cotangent_and_values_are_jits():
    """The re-created softmax is tied to the ``[B, S, 1]`` cotangent its derivative is
    broadcast from, not to the broadcast (or its convert) over the vocabulary."""
    prog, args, fn = _rewritten()
    flat = jax.tree.leaves(args)
    jaxpr = jax.make_jaxpr(fn)(*flat).jaxpr
    operands = [v for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
                for v in e.invars]
    assert operands  # the re-created softmax is still behind a barrier
    wide = {v for v in operands if getattr(v, "aval", None) is not None
            and v.aval.shape[-1:] == (V,)}
    assert wide == {_logits(jaxpr)}
    want = jax.jit(_step)(*args)
    got = jax.tree.unflatten(prog.out_tree, jax.jit(fn)(*flat))
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def test_logits_gradient_reads_the_logits_not_their_barrier_copy():
    """The re-created ``logits - max`` reads the logits themselves (it is ordered after the
    barrier by the re-created maximum it also reads), so XLA can write the gradient into the
    logits' buffer."""
    prog, args, fn = _rewritten()
    jaxpr = jax.make_jaxpr(fn)(*jax.tree.leaves(args)).jaxpr
    logits = _logits(jaxpr)
    through = [e for e in jaxpr.eqns
               if e.primitive.name == "optimization_barrier" and logits in e.invars]
    assert through  # the re-created maximum reads them through the barrier
    subs = [e for e in jaxpr.eqns if e.primitive.name == "sub" and logits in e.invars]
    assert len(subs) == 2  # the forward pass's and the re-created one


def test_rewrite_of_the_loss_saves_on_the_h100_target():
    """Re-creating the softmax saves at least half a logits-sized buffer against the plain
    step on the H100 target (compile only); with either fault above it saved nothing."""
    prog, args, fn = _rewritten()
    placed = targets.place(jax.tree.leaves(args), targets.require("h100"))

    def plain(*flat):
        a, k = jax.tree.unflatten(prog.in_tree, flat)
        return jax.tree.leaves(_step(*a, **k))

    plain = figures(jax.jit(plain), placed)
    rewritten = figures(jax.jit(fn), placed)
    assert rewritten.peak <= plain.peak - B * S * V * 2 // 2
