"""Selective plans: per-block ``dots_saveable`` plus the heavy outputs cheap to redo (third
box of the data flow, ``Analysis -> Plan``).

:func:`plan_selective` is Megatron-LM's *selective recompute* generalised: start from the
block plan that keeps heavy outputs (:func:`jaxmem.planning.block_plans.plan_blocks` with
``keep_heavy``), keep its dropout masks (a byte per element is cheaper to keep than the
generator is to re-run), then re-create the heavy outputs with the fewest FLOPs per byte
(attention scores) while the predicted recompute stays within the FLOP cap. One of the
automatic mode's candidates (:mod:`jaxmem.planning.candidates`).

Re-exported by :mod:`jaxmem.planning.strategies`.
"""

from __future__ import annotations

import dataclasses

from jaxmem.analyzing import chains
from jaxmem.analyzing.analysis import Analysis
from jaxmem.planning.anchors import anchor_record
from jaxmem.planning.block_plans import block_boundaries, plan_blocks
from jaxmem.planning.plan import Choice, Decision, Plan, recompute_cost
from jaxmem.tracing.primitives import Kind

__all__ = ["plan_selective"]


def plan_selective(analysis: Analysis, depth: int, *,
                   max_recompute_fraction: float = 0.05, join_light: bool = True) -> Plan:
    """Per-block ``dots_saveable`` (:func:`plan_blocks` with ``keep_heavy``), plus the heavy
    outputs that are large but cheap to redo, within a FLOP budget.

    Megatron-LM's *selective recompute* (Korthikanti et al. 2022) re-creates the attention
    scores ``q @ k^T`` instead of keeping them: ``[batch, heads, seq, seq]`` bytes for
    ``2 x head_dim`` FLOPs an element. Generalised: heavy outputs are taken by FLOPs per
    byte freed, cheapest first, while the plan's predicted recompute stays within
    ``max_recompute_fraction`` of the step's FLOPs (checked with :func:`recompute_cost`,
    which replays chains as the rewrite does). A conv or MLP activation costs hundreds of
    FLOPs a byte and is rarely taken; attention scores cost tens.

    ``join_light``: how blocks are cut (:func:`block_boundaries`).
    """
    base = _keep_masks(analysis, plan_blocks(analysis, depth, keep_heavy=True,
                                             join_light=join_light), depth)
    prog = analysis.program
    cap = max_recompute_fraction * prog.flops
    boundary = block_boundaries(prog, depth, join_light=join_light)
    residual_ids = {r.value for r in analysis.residuals}
    heavy = [v for v in chains.stored_values(prog, residual_ids).droppable - boundary
             if prog.nodes[prog.values[v].producer].kind == Kind.HEAVY
             and prog.values[v].nbytes > 0]
    heavy.sort(key=lambda v: prog.nodes[prog.values[v].producer].flops / prog.values[v].nbytes)
    drop, keep = set(base.recompute), set(base.keep)
    spent = base.recompute_flops
    taken: list[int] = []
    for v in heavy:
        extra = prog.nodes[prog.values[v].producer].flops
        if spent + extra > cap:
            break  # sorted by FLOPs per byte: later ones free fewer bytes per FLOP
        taken.append(v)
        spent += extra
    while taken:
        cost = recompute_cost(analysis, drop | set(taken), depth, keep)
        if cost <= cap:
            break
        taken.pop()
    tag = "" if join_light else ", light unjoined"
    if not taken:
        return dataclasses.replace(base,
                                   strategy=f"selective(depth={depth}{tag}, none cheap)")
    back = set(taken)
    reason = (f"a heavy output cheap to redo for its bytes (selective recompute): inside a "
              f"block (depth {depth}), re-created with it")
    choices = [dataclasses.replace(c, decision=Decision.RECOMPUTE, reason=reason)
               if c.residual.value in back else c for c in base.choices]
    listed = {c.residual.value for c in choices}
    choices += [Choice(anchor_record(prog, v), Decision.RECOMPUTE, reason)
                for v in sorted(back - listed)]
    dropped = frozenset(c.residual.value for c in choices if c.decision is Decision.RECOMPUTE)
    return dataclasses.replace(
        base, choices=tuple(choices), strategy=f"selective(depth={depth}{tag})",
        recompute_flops=recompute_cost(analysis, dropped, depth, keep))


_RNG = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


def _keep_masks(analysis: Analysis, plan: Plan, depth: int) -> Plan:
    """``plan`` with the values it re-creates from random bits (dropout masks) kept instead."""
    prog = analysis.program
    drop = plan.recompute
    starts = chains.chain_start(prog, dropped=drop,
                                kept={r.value for r in analysis.residuals} | plan.keep)
    masks = {v for v in drop
             if any(prog.nodes[i].primitive in _RNG
                    for i in chains.replay_chain(prog, [v], starts)[0])
             and prog.values[v].dtype in ("bool", "uint8", "int8")}
    if not masks:
        return plan
    choices = tuple(
        dataclasses.replace(c, decision=Decision.SAVE,
                            reason="a mask drawn from random bits: its byte per element is "
                            "cheaper to keep than the generator is to re-run")
        if c.residual.value in masks else c for c in plan.choices)
    dropped = frozenset(c.residual.value for c in choices if c.decision is Decision.RECOMPUTE)
    return dataclasses.replace(plan, choices=choices, keep=plan.keep | masks,
                               recompute_flops=recompute_cost(analysis, dropped, depth,
                                                              plan.keep | masks))
