"""The rewrite's barriers around a language model's loss (jaxmem.rewriting.rewrite).

A re-created value is emitted behind an ``optimization_barrier`` tied to its backward
region's cotangents, and a barrier operand is a buffer of its own. The loss region of a
decoder reads no cotangent but the loss's seed, broadcast over the vocabulary (derived from
constants alone); the barrier tied to that broadcast, and XLA materialised a ``[batch,
sequence, vocabulary]`` float32 buffer it otherwise fuses into its readers (transformers'
Flax GPT-2 at flax's lm1b width, vocabulary 30k: 468.75 MiB; every plan compiled 13% to
26% above the plain step on the H100 target). Such a tie now follows cheap backward nodes
down to the narrowest values (:func:`jaxmem.rewriting.settle.narrowest`). A region that
reads the softmax's cotangent, a bfloat16 broadcast over the vocabulary, ties through the
broadcast's source (:func:`jaxmem.rewriting.settle.cotangent_ties`), and its re-created
nodes read the logits beside the barrier once it orders them
(:func:`jaxmem.rewriting.settle.beside_barrier`), so XLA writes the logits' gradient into
the logits' buffer.

These tests check the ties on a small LM head, that the values do not change, and the memory
relation on the H100 target (compile only); both fail on the rewrite before each change.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
from jaxmem.program import trace

from jaxmem.analyzing.analysis import from_program
from jaxmem.compiling.steps import figures, plain_jit
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
    # the vocabulary-wide residuals: the softmax's and the one-hot labels' convert
    wide = {r.value for r in res if r.shape[-1:] == (V,)
            and r.primitive in ("exp", "sub", "convert_element_type")}
    assert wide
    return prog, args, rewrite(prog, wide)


def test_barriers_tie_no_vocabulary_wide_broadcast_and_values_are_jits():
    """The loss region's re-created one-hot labels are tied to the loss's seed, not to its
    float32 broadcast over the vocabulary (derived from constants alone, no barrier operand
    is a vocabulary-wide broadcast); the values are jit's."""
    prog, args, fn = _rewritten()
    flat = jax.tree.leaves(args)
    jaxpr = jax.make_jaxpr(fn)(*flat).jaxpr
    made = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
    operands = [v for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
                for v in e.invars if v in made]
    assert operands  # the re-created values are still behind barriers
    expansions = [v for v in operands if v.aval.shape[-1:] == (V,)
                  and made[v] in ("broadcast_in_dim", "convert_element_type")]
    assert not expansions
    # the logits (a matmul's output) pass the barrier, and the re-created nodes that the
    # barrier already orders read them directly as well (settle.beside_barrier)
    at = {id(e): k for k, e in enumerate(jaxpr.eqns)}
    logits = [v for v in operands if v.aval.shape[-1:] == (V,) and made[v] == "dot_general"]
    assert logits
    barrier = min(at[id(e)] for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
                  and logits[0] in e.invars)
    assert any(at[id(e)] > barrier and logits[0] in e.invars for e in jaxpr.eqns
               if e.primitive.name != "optimization_barrier")
    want = jax.jit(_step)(*args)
    got = jax.tree.unflatten(prog.out_tree, jax.jit(fn)(*flat))
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def test_rewrite_of_the_loss_saves_a_logits_buffer_on_the_h100_target():
    """On the H100 target (compile only) the rewrite's peak is more than half a logits
    buffer below the plain step's: the softmax is re-created from the logits, whose
    gradient XLA writes into their buffer. Tied to the seed's float32 broadcast the rewrite
    held one more ``[B, S, V]`` float32 buffer (at ``9c9a25e``); tied to the cotangent's
    bfloat16 broadcast, with the logits read only through the barrier, it compiled to the
    plain step's peak (at ``bb02a2c``)."""
    prog, args, fn = _rewritten()
    placed = targets.place(jax.tree.leaves(args), targets.require("h100"))
    plain = figures(plain_jit(_step, prog.in_tree, (), {}), placed)
    rewritten = figures(jax.jit(fn), placed)
    logits_bytes = B * S * V * 2  # bfloat16
    assert rewritten.peak < plain.peak - logits_bytes // 2
