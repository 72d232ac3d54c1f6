"""Block plans: ``jax.checkpoint`` around every block, as a plan (third box of the data flow,
``Analysis -> Plan``).

A block is a layer path cut to a depth (``"GPT/block3/attn"`` at depth 2 is
``"GPT/block3"``), light runs joined to the next block with heavy work.

- :func:`block_boundaries` — the forward values that cross from one block into another;
- :func:`block_depths` — the depths worth cutting at (at least three blocks with heavy work);
- :func:`plan_blocks` — keep what crosses block boundaries, re-create the rest (heavy outputs
  too, or with ``keep_heavy`` not) once per block; optionally park boundary values in host
  memory (:func:`block_offload_candidates` lists which may go);
- :func:`resave` — spend a fitting block plan's headroom on keeping some of what it
  re-creates again (the budget search's block fallback uses it).

Re-exported by :mod:`jaxmem.planning.strategies`.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable

from jaxmem.analyzing import chains
from jaxmem.analyzing.analysis import Analysis, Residual
from jaxmem.planning.anchors import anchor_record
from jaxmem.planning.plan import Choice, Decision, Plan, recompute_cost
from jaxmem.tracing import blocks
from jaxmem.tracing.primitives import Kind
from jaxmem.tracing.program import Program
from jaxmem.xla.measure import fmt_bytes

__all__ = ["block_boundaries", "block_depths", "block_offload_candidates", "plan_blocks",
           "resave"]


def block_boundaries(program: Program, depth: int, *, join_light: bool = True
                     ) -> frozenset[int]:
    """Forward values made in one block and read in another.

    A block is a layer path cut to ``depth`` parts (``"GPT/block3/attn"`` at depth 2 is
    ``"GPT/block3"``); top-level equations form one block of their own. A run of forward
    nodes (in program order) with one such path and no heavy (matmul/convolution) node
    joins the next run that has one: a ResNet stem's BatchNorm and ReLU go with the first
    residual block, a final LayerNorm with the LM head. What crosses into such a merged
    block is then the heavy output before the light run, and the light run is re-created
    from it with utility work only (MEDL's rule), instead of keeping each light layer's
    output as a block boundary of its own (one activation per light layer: 9 MiB of a
    CIFAR ResNet's 29 at batch 72). Backward regions still follow the layer paths
    (:func:`jaxmem.program.region_of`); a light run's backward region re-creates what it
    reads from the heavy output before it. A trailing light run (a loss) stays a block.

    ``join_light=False``: blocks are the cut layer paths alone, each light layer's output a
    boundary of its own. Which grouping compiles lower depends on the compiler (the join
    lifts a ResNet on XLA:GPU; a GPT's depth-2 selective plan compiles 2 MB lower on CPU
    without it), so :func:`auto_candidates` compiles the selective plan on both cuts
    (its per-block ``dots_saveable`` plan on the unjoined cut never compiled within 1% of
    the lowest: only on the joined one) and the budget search tries both.
    """
    if not join_light:
        return program.crossing("forward", depth)
    block: dict[int, int] = {}      # forward node index -> block id (its run's, merged)
    runs: list[list[int]] = []      # runs of forward nodes with one cut layer path
    heavy: list[bool] = []
    key = None
    for n in program.nodes:
        if n.phase != "forward":
            continue
        k = "/".join(n.layer.split("/")[:depth])
        if not runs or k != key:
            runs.append([])
            heavy.append(False)
            key = k
        runs[-1].append(n.index)
        heavy[-1] = heavy[-1] or n.kind == Kind.HEAVY
    pending: list[int] = []         # light runs waiting for the next heavy one
    for r in range(len(runs)):
        pending.append(r)
        if heavy[r]:
            for p in pending:
                block.update((i, r) for i in runs[p])
            pending = []
    for p in pending:               # a trailing light run is its own block
        block.update((i, p) for i in runs[p])
    # a merged block is labelled by its heavy run's path: runs of one path stay one block
    path = {r: "/".join(program.nodes[nodes[0]].layer.split("/")[:depth])
            for r, nodes in enumerate(runs)}
    label = {i: _merged_label(path, heavy, b) for i, b in block.items()}
    out: set[int] = set()
    for n in program.nodes:
        if n.phase != "forward":
            continue
        here = label[n.index]
        for v in n.inputs:
            u = program.values[v].producer
            if u is not None and u in label and label[u] != here and \
                    v not in program.constant_derived:
                out.add(v)
    return frozenset(out)


def _merged_label(path: dict[int, str], heavy: list[bool], run: int) -> str:
    """A block's label: the path of the heavy run it ends in (runs of one path are one
    block, as when blocks were paths alone), or ``"<path>#<run>"`` for a trailing light
    run."""
    return path[run] if heavy[run] else f"{path[run]}#{run}"


def block_depths(program: Program, *, balanced: bool = False) -> tuple[int, ...]:
    """Layer-path depths that split the forward pass into at least three blocks with heavy
    (matmul/convolution) work, shallowest first; ``balanced``: only those where no block
    holds more than half of it (:func:`jaxmem.tracing.blocks.depths`)."""
    return blocks.depths([n.layer.split("/") for n in program.nodes
                             if n.phase == "forward" and n.kind == Kind.HEAVY],
                            balanced=balanced)


def plan_blocks(analysis: Analysis, depth: int, offload: Iterable[int] = (), *,
                keep_heavy: bool = False, join_light: bool = True) -> Plan:
    """``jax.checkpoint(policy=nothing_saveable)`` around every block, as a plan.

    Keeps only the values that cross block boundaries at ``depth`` (and arguments), and
    re-creates everything else, matmul and convolution outputs included, once per block in
    the backward pass (one backward region per block). The low-memory end of what the
    budget planner can reach without segments: about one extra forward pass of FLOPs.

    ``keep_heavy``: keep the outputs of heavy layers too (matmul, convolution): per-block
    ``jax.checkpoint(policy=dots_saveable)`` as a plan, MEDL's rule applied a block at a
    time (every cheap value re-created with its block, dropout masks from the key
    included). A few percent of FLOPs; the auto plan's candidate on compilers that keep
    per-layer recompute worse than per-block (XLA:GPU on decoders).

    ``offload``: boundary values (:func:`block_offload_candidates`) to park in host memory
    instead of keeping them on the device (MaxText's "offload the decoder layer inputs,
    recompute the rest"); each comes back for the block that starts from it.

    ``join_light``: how blocks are cut (:func:`block_boundaries`); offloading needs the
    default grouping.
    """
    prog = analysis.program
    boundary = block_boundaries(prog, depth, join_light=join_light)
    residual_ids = {r.value for r in analysis.residuals}
    drop = set(chains.stored_values(prog, residual_ids).droppable - boundary)
    if keep_heavy:  # heavy outputs stay anchors: chains start from them
        drop = {v for v in drop if prog.nodes[prog.values[v].producer].kind != Kind.HEAVY}
    off = frozenset(offload)
    if off and not join_light:
        raise ValueError("plan_blocks: offload= needs the default block grouping "
                         "(join_light=True)")
    bad = off - block_offload_candidates(analysis, depth) if off else frozenset()
    if bad:
        raise ValueError(f"values {sorted(bad)} are not block boundary values at depth "
                         f"{depth} that can be offloaded (see block_offload_candidates)")

    def choice(r: Residual) -> Choice:
        if r.value in off:
            return Choice(r, Decision.OFFLOAD, f"crosses a block boundary (depth {depth}): "
                          "parked in host memory, fetched back for its block")
        if r.value in drop and r.is_utility:
            return Choice(r, Decision.RECOMPUTE,
                          f"inside a block (depth {depth}): re-created with it")
        return Choice(r, Decision.SAVE, f"crosses a block boundary (depth {depth}): kept"
                      if r.value in boundary else "kept")

    choices = [choice(r) for r in analysis.residuals]
    choices += [Choice(anchor_record(prog, v), Decision.RECOMPUTE,
                       f"inside a block (depth {depth}), not read by the backward itself: "
                       "re-created with the block")
                for v in sorted(drop - residual_ids)]
    choices += [Choice(anchor_record(prog, v), Decision.OFFLOAD,
                       f"crosses a block boundary (depth {depth}): parked in host memory, "
                       "fetched back for the block that starts from it")
                for v in sorted(off - residual_ids)]
    dropped = frozenset(c.residual.value for c in choices if c.decision is Decision.RECOMPUTE)
    keep = frozenset(boundary - drop - off)
    kind = (", heavy kept" if keep_heavy else "") + ("" if join_light else ", light unjoined")
    return Plan(choices=tuple(choices),
                strategy=f"blocks(depth={depth}{kind}" + (", offload)" if off else ")"),
                recompute_flops=recompute_cost(analysis, dropped, depth, keep | off),
                baseline_flops=prog.flops, region_depth=depth, keep=keep)


def block_offload_candidates(analysis: Analysis, depth: int) -> frozenset[int]:
    """Boundary values of the blocks at ``depth`` that a block plan may offload: made in the
    forward pass by an equation the rewrite can replay (not a control-flow unit, not an
    effect), not program inputs, and read by the backward pass (directly or as the start of
    a block's replay)."""
    prog = analysis.program
    blk = plan_blocks(analysis, depth)
    drop = blk.recompute
    starts = chains.chain_start(prog, dropped=drop,
                                kept={r.value for r in analysis.residuals} | blk.keep)
    used: set[int] = set()
    for n in prog.nodes:
        if n.phase == "backward":
            used.update(n.inputs)
            redo = [v for v in n.inputs if v in drop]
            if redo:
                used.update(chains.replay_chain(prog, redo, starts)[1])

    def ok(v: int) -> bool:
        n = prog.nodes[prog.values[v].producer]
        return (n.phase == "forward" and n.kind not in (Kind.CONTROL, Kind.UNKNOWN)
                and not getattr(n.eqn, "effects", None) and prog.values[v].nbytes > 0
                and v in used)

    return frozenset(v for v in block_boundaries(prog, depth) if ok(v))


def resave(analysis: Analysis, plan: Plan, headroom: int) -> Plan:
    """A block plan with some of its re-created values kept again, within ``headroom`` bytes.

    Lazy greedy on FLOPs saved per byte: each candidate's gain is its exact marginal
    :func:`~jaxmem.planning.plan.recompute_cost` (given what is already re-saved), re-evaluated when
    it reaches the top of the heap. A re-saved value stays on the device from the forward
    pass to its backward region, so the bytes added estimate what the peak can grow; the
    compiler may lower it instead (less to re-create: smaller recompute working sets) or
    raise it more (a kept value changes its fusions), so the budget loop compiles the result.
    """
    prog = analysis.program
    depth, keep = plan.region_depth, plan.keep | plan.offload
    drop = set(plan.recompute)
    # recompute_cost's replay, each marginal replaying only the regions it changes
    replay = chains.MarginalReplay(prog, drop, frozenset(r.value for r in analysis.residuals)
                                   | keep, depth)
    cost = replay.total

    def gain(v: int) -> float:
        return cost - replay.without(v)

    heap = [(-gain(v) / max(prog.values[v].nbytes, 1), v) for v in sorted(drop)]
    heapq.heapify(heap)
    added: list[int] = []
    used = 0
    while heap:
        neg, v = heapq.heappop(heap)
        if -neg <= 0:
            break
        b = prog.values[v].nbytes
        if used + b > headroom:
            continue
        g = gain(v)
        if heap and g / max(b, 1) < -heap[0][0]:
            heapq.heappush(heap, (-g / max(b, 1), v))
            continue
        if g <= 0:
            continue
        drop.discard(v)
        replay.reset(drop)
        cost = replay.total
        used += b
        added.append(v)
    if not added:
        return plan
    back = set(added)
    choices = tuple(
        dataclasses.replace(c, decision=Decision.SAVE,
                            reason=f"re-saved: keeping it saves more recompute per byte "
                            f"than the rest, within {fmt_bytes(headroom)} of headroom")
        if c.residual.value in back else c for c in plan.choices)
    return dataclasses.replace(plan, choices=choices, recompute_flops=cost,
                               strategy=plan.strategy.rstrip(")") + ", re-saved)"
                               if plan.strategy.endswith(")") else plan.strategy)
