"""The step's own inputs and the rewrite's barriers (jaxmem.rewriting.rewrite).

A re-created value is emitted behind an ``optimization_barrier`` tied to its backward
region's cotangents. A weight the chain reads only through cheap nodes (an L2 penalty's
``2 * w``) is read beside the barrier: XLA copies a donated input read through a barrier
in the backward pass (a flax ResNet18 kept a second copy of every weight on the H100
target). An input whose cheap derivatives the forward pass also reads (a bias's broadcast)
stays in the barrier, or XLA would CSE the re-created copy with the forward one.
These tests check which inputs the barriers take, and that the values do not change.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jaxmem.program import trace

from jaxmem.analyzing.analysis import from_program
from jaxmem.rewriting.rewrite import rewrite


def _step(params, x):
    def loss(params):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        penalty = 0.5 * sum(jnp.sum(w ** 2) for w, _ in params)
        return jnp.mean(h ** 2) + 1e-4 * penalty

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _args():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = [(jax.random.normal(k[i], (16, 16)) * 0.3, jnp.full((16,), 0.01 * i))
              for i in range(3)]
    return params, jax.random.normal(k[3], (8, 16))


def _barrier_inputs(fn, flat):
    """The positions of ``fn``'s flat inputs that some optimization_barrier reads."""
    jaxpr = jax.make_jaxpr(fn)(*flat).jaxpr
    pos = {v: i for i, v in enumerate(jaxpr.invars)}
    return {pos[v] for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
            for v in e.invars if v in pos}


def _setup():
    args = _args()
    prog = trace(_step, *args)
    flat = jax.tree.leaves(args)
    res = from_program(prog).residuals
    return prog, flat, res


def test_penalty_derivative_recomputed_beside_the_barrier():
    """``2 * w`` of the penalty, re-created from the weight alone: the weight is not read
    through a barrier; the re-created activations still are, and the values are jit's."""
    prog, flat, res = _setup()
    weights = {prog.inputs[i] for i in (0, 2, 4)}  # flat order: w0, b0, w1, b1, w2, b2, x
    penalty = {r.value for r in res if r.primitive == "mul" and r.shape == (16, 16)
               and weights & set(prog.nodes[r.produced_at].inputs)}
    tanh = {r.value for r in res if r.primitive == "tanh"}
    assert penalty and tanh
    fn = rewrite(prog, penalty | tanh)
    tied = _barrier_inputs(fn, flat)
    assert not tied & {0, 2, 4}
    want = jax.jit(_step)(*_args())
    got = jax.tree.unflatten(prog.out_tree, jax.jit(fn)(*flat))
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


def test_input_with_live_forward_derivative_stays_in_the_barrier():
    """Re-created activations ``tanh(h @ w + b)`` from the kept matmul outputs: each chain
    reads its bias through a broadcast the forward pass reads too, so the biases stay in
    the barrier (outside it, XLA would CSE the broadcast with the forward one)."""
    prog, flat, res = _setup()
    tanh = {r.value for r in res if r.primitive == "tanh"}
    fn = rewrite(prog, tanh)
    assert _barrier_inputs(fn, flat) == {1, 3, 5}  # b0, b1, b2
    want = jax.jit(_step)(*_args())
    got = jax.tree.unflatten(prog.out_tree, jax.jit(fn)(*flat))
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
