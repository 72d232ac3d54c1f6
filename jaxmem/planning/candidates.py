"""The automatic mode's candidate list (third box of the data flow, ``Analysis -> Plan``).

:func:`auto_candidates` lists the plans ``jaxmem.optimize``'s ``"auto"`` strategy compiles
and picks the lowest peak from: MEDL's rule per layer (:mod:`jaxmem.planning.medl`), the
same drop set re-created per block, per-block ``dots_saveable``
(:mod:`jaxmem.planning.block_plans`) and selective recompute
(:mod:`jaxmem.planning.selective`), each at the block depths and block cuts where the
compilers were measured to differ. Plans only: the compiling is :mod:`jaxmem.compiling`'s.

Re-exported by :mod:`jaxmem.planning.strategies`.
"""

from __future__ import annotations

import dataclasses

from jaxmem.analyzing.analysis import Analysis
from jaxmem.planning.block_plans import block_boundaries, block_depths, plan_blocks
from jaxmem.planning.medl import plan_auto
from jaxmem.planning.plan import Plan, recompute_cost
from jaxmem.planning.selective import plan_selective

__all__ = ["auto_candidates"]


def auto_candidates(analysis: Analysis, *, max_recompute_fraction: float = 0.05
                    ) -> list[Plan]:
    """The plans the ``"auto"`` strategy compiles and picks from, most per-layer first.

    MEDL's rule has one answer for *what* to drop but the compilers disagree on *how* the
    re-creation should be grouped: XLA:CPU keeps least when each layer re-creates what it
    reads (:func:`plan_auto`), XLA:GPU on decoders when a whole block is re-created at once
    behind one barrier, as ``jax.checkpoint`` around a block does (it then cannot hoist
    layout copies of the kept values into the forward pass). So the candidates are:

    1. :func:`plan_auto` (per-layer regions);
    2. the same drop set re-created per block, at the shallowest block depth
       (:func:`block_depths`), and at the shallowest balanced one if that is deeper;
    3. per-block ``dots_saveable`` as a plan (:func:`plan_blocks` with ``keep_heavy``):
       every cheap value re-created with its block, dropout masks from the key included;
    4. the same with the heavy outputs that are large but cheap to redo (attention scores)
       re-created too, within the FLOP cap (:func:`plan_selective`), with light layers
       (norms, activations) joined to the next block and, where that cuts differently, as
       blocks of their own (:func:`block_boundaries`): the H100 target keeps the join on
       the zoo ResNet, XLA:CPU the other on the zoo GPT;
    5. per-block ``dots_saveable`` with the whole step as one block (depth 0).

    Two kinds listed before are not: MEDL's rule with a residual's chain capped at 5% of its
    layer's heavy FLOPs (``plan_auto(max_layer_fraction=0.05)``, "auto (strict: 5% per
    layer)") and per-block ``dots_saveable`` on the unjoined cut (``plan_blocks(
    join_light=False)``). Over the 28 steps whose every candidate was compiled
    (``benchmarks/results/prediction*/plans-*.json``: zoo and corpus, CPU and the H100
    target, test and bench size) neither compiled lowest, nor within 1% of the lowest, in
    any of the 9 and 20 steps that listed it (``python -m benchmarks.ranking_union --kinds
    FILES``), and ``verify=True``'s first compiles land as far above the lowest on all 28
    without them (``--drop``; both held by
    ``tests/test_prediction.py::test_the_candidates_left_out_never_compiled_near_the_lowest``).

    (``jaxmem.optimize`` adds two more that are not plans: the step traced with its loss
    under ``jax.checkpoint(policy=dots_saveable)``, whole and around each block of the name
    stack, :mod:`jaxmem.rewriting.blockwise`.)

    Candidates whose predicted recompute exceeds ``max_recompute_fraction`` of the step's
    FLOPs, or that drop nothing, are left out; duplicates too. The caller compiles them on
    the target and keeps the lowest peak (``jaxmem.optimize``'s ``verify``).
    """
    auto = plan_auto(analysis, max_recompute_fraction=max_recompute_fraction)
    out = [auto]
    # The shallowest depth with blocks, and the shallowest where no block holds most of the
    # heavy work (``blocks/0..7`` under an nnx ``blocks`` list) if that is deeper: the first
    # groups re-creation coarsely (XLA:GPU's choice on the nnx MLP), the second as nn.remat
    # around every block does.
    depths = block_depths(analysis.program)[:1]
    depths += tuple(d for d in block_depths(analysis.program, balanced=True)[:1]
                    if d not in depths)
    for d in depths:
        if auto.recompute:
            out.append(dataclasses.replace(
                auto, strategy=f"auto(regions=blocks at depth {d})", region_depth=d,
                recompute_flops=recompute_cost(analysis, auto.recompute, d)))
        cuts = (True, False) if (block_boundaries(analysis.program, d, join_light=False)
                                 != block_boundaries(analysis.program, d)) else (True,)
        out.append(plan_blocks(analysis, d, keep_heavy=True))
        out += [plan_selective(analysis, d, join_light=join,
                               max_recompute_fraction=max_recompute_fraction)
                for join in cuts]
    # 5. the whole step as one block with heavy outputs kept: jax.checkpoint(dots_saveable)
    #    around the whole loss, what users compare against (issue 16's external table).
    out.append(plan_blocks(analysis, 0, keep_heavy=True))
    seen: set[tuple] = set()
    keep = []
    for p in out:
        key = (p.recompute, p.region_depth, p.keep)
        if not p.recompute or key in seen or p.predicted_overhead > max_recompute_fraction:
            continue
        seen.add(key)
        keep.append(p)
    return keep
