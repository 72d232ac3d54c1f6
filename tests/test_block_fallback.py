"""The budget search's block fallback (issue 36): a block plan with the block whose backward
runs first kept (jaxmem.planning.budget.fallbacks.first_block_kept) re-creates fewer FLOPs,
predicts no higher peak, and computes what the plain step computes."""

from __future__ import annotations

import jax
import numpy as np

import jaxmem
from jaxmem.analyzing.analysis import from_program
from jaxmem.analyzing.costmodel import CostModel
from jaxmem.planning import lower_peaks as lp
from jaxmem.planning.budget.fallbacks import first_block_kept
from jaxmem.planning.plan import Decision
from jaxmem.planning.strategies import plan_blocks, plan_none
from jaxmem.rewriting.rewrite import apply
from jaxmem.tracing.program import region_of
from tests.test_lower_peaks import _blocks_mlp


def test_first_block_kept_saves_flops_not_peak():
    step, args = _blocks_mlp(depth=4, batch=64, width=16)
    program = jaxmem.trace(step, *args)
    analysis = from_program(program)
    blk = plan_blocks(analysis, 1)
    kept = first_block_kept(analysis, blk)
    assert kept is not blk and "first-replayed block kept" in kept.strategy
    assert kept.recompute < blk.recompute
    assert 0 < kept.recompute_flops < blk.recompute_flops
    # what it keeps is made in one block, and is saved
    prog = analysis.program
    back = {region_of(prog.nodes[prog.values[v].producer], 1)[1]
            for v in blk.recompute - kept.recompute}
    assert len(back) == 1 and all(
        c.decision is Decision.SAVE for c in kept.choices
        if c.residual.value in blk.recompute - kept.recompute)
    model = CostModel(analysis)
    assert (lp.block_model(model, kept).evaluate(kept.recompute, ()).peak
            <= lp.block_model(model, blk).evaluate(blk.recompute, ()).peak)
    # the rewrite of it computes the plain step's outputs
    flat = jax.tree_util.tree_leaves(args)
    got = jax.jit(apply(program, kept))(*flat)
    want = jax.tree_util.tree_leaves(step(*args))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
    # nothing re-created: nothing to keep
    assert first_block_kept(analysis, plan_none(analysis)).recompute == frozenset()


def test_the_lowest_depth_is_also_tried_with_its_light_layers_unjoined():
    """best_block_plan compiles the lowest depth's other grouping (each light layer's
    output a boundary of its own) and keeps it when it fits with fewer FLOPs."""
    import jax.numpy as jnp

    from jaxmem.planning.budget.fallbacks import best_block_plan
    from jaxmem.xla.measure import Figures

    def loss(ws, x):  # each block a matmul, then a light-only scope (a norm) before the next
        for i, w in enumerate(ws):
            with jax.named_scope(f"block{i}"):
                x = jnp.tanh(x @ w)
            with jax.named_scope(f"norm{i}"):
                x = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True)
                                                                     + 1e-5)
        return jnp.sum(x ** 2)

    def step(ws, x):
        return jax.grad(loss)(ws, x)

    ws = [jax.random.normal(jax.random.PRNGKey(i), (16, 16)) * 0.3 for i in range(4)]
    analysis = from_program(jaxmem.trace(step, ws, jnp.ones((64, 16))))
    assert plan_blocks(analysis, 1, join_light=False).keep != plan_blocks(analysis, 1).keep
    compiled = []

    def compile_plan(p):  # synthetic figures: only the unjoined grouping fits the budget
        compiled.append(p.strategy)
        peak = 100 if "light unjoined" in p.strategy else 200
        return Figures(argument=peak, output=0, temp=0, alias=0, flops=p.recompute_flops)

    found = best_block_plan(analysis, 150, compile_plan)
    assert any("light unjoined" in s for s in compiled), compiled
    assert found.plan is not None and "light unjoined" in found.plan.strategy
