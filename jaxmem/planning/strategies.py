"""Strategies: what to keep, recompute or offload (third box of the data flow,
``Analysis -> Plan``).

The one home of the rule for what gets recomputed. :func:`medl_keeps` is MEDL's rule: keep
the outputs of heavy layers (matmuls, convolutions), recompute the outputs of utility layers
(activations, normalisation, dropout, adds, pooling, concatenation). Every applier asks it:
:func:`plan_auto` for a train step, :func:`jaxmem.checkpoint` for a function differentiated
later, and the ``jax.checkpoint`` policy :func:`jaxmem.policies.utility` (through
:func:`medl_keeps_primitive`, since a policy sees primitives, not nodes).

The strategies built on it (and :func:`plan_none`, keep everything: the baseline):

- :func:`plan_auto` — MEDL's rule made cost-aware: a utility output is kept after all when
  recomputing it costs more than ``max_layer_fraction`` of its layer's heavy FLOPs, when all
  recompute together would pass ``max_recompute_fraction`` of the step, or when its chain
  would keep alive more bytes of anchors than it frees.
- :func:`plan_blocks` — ``jax.checkpoint(policy=nothing_saveable)`` around every block: keep
  what crosses block boundaries, re-create the rest (heavy outputs too) once per block;
  :func:`resave` spends a fitting block plan's headroom on keeping some of it again.
- :func:`plan_segments` — Chen et al.'s sqrt(n) checkpointing: keep every k-th heavy output.
- :func:`plan_offload` — the auto plan plus host offload of values whose round trip hides.

Plans under a memory budget combine these with the solvers in :mod:`jaxmem.planning.budget`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from jaxmem.analyzing import chains
from jaxmem.analyzing.analysis import Analysis, Residual
from jaxmem.analyzing.costmodel import CostModel, DeviceProfile
from jaxmem.analyzing.tags import offload_tagged
from jaxmem.planning.plan import Choice, Decision, Plan, recompute_cost
from jaxmem.tracing import blocks
from jaxmem.tracing.primitives import CHEAP, Kind, classify
from jaxmem.tracing.program import Program
from jaxmem.xla.measure import fmt_bytes

__all__ = [
    "block_boundaries", "block_depths", "block_offload_candidates", "medl_keeps",
    "medl_keeps_primitive", "plan_auto", "plan_blocks", "plan_from_sets", "plan_none",
    "plan_offload", "plan_segments", "resave",
]


# --- MEDL's rule ----------------------------------------------------------------------------

def medl_keeps(kind: Kind | str, *, units: bool = True) -> bool:
    """MEDL's rule for one value, by the kind of what makes it: keep it or recompute it.

    Heavy outputs (matmul, convolution) are kept; utility and free outputs (activations,
    normalisation, dropout masks, adds, pooling, reshapes) are recomputed. Beyond MEDL:
    unknown primitives are kept (the conservative choice), arguments and constants are
    always there, and a control-flow unit's outputs are kept with ``units=True`` (the joint
    rewrite and :func:`jaxmem.checkpoint` keep a unit whole). A ``jax.checkpoint`` policy
    passes ``units=False``: JAX applies the policy to the primitives inside the unit.

    Example:
      >>> medl_keeps("heavy"), medl_keeps("utility"), medl_keeps("control", units=False)
      (True, False, False)
    """
    if kind in CHEAP:
        return False
    return units or kind != Kind.CONTROL


def medl_keeps_primitive(name: str, params: dict[str, Any] | None = None, *,
                         batched_dots: bool = True) -> bool:
    """:func:`medl_keeps` for a primitive by name, as a ``jax.checkpoint`` policy sees it.

    ``batched_dots=False``: a ``dot_general`` with batch dimensions (attention scores
    ``[B, H, T, T]``) is recomputed too (the semantics of ``dots_with_no_batch_dims``).
    """
    if not batched_dots and name == "dot_general" and _has_batch_dims(params or {}):
        return False
    return medl_keeps(classify(name), units=False)


def _has_batch_dims(params: dict[str, Any]) -> bool:
    try:
        (_, _), (lhs_batch, _) = params.get("dimension_numbers")
    except (TypeError, ValueError):
        return False
    return bool(lhs_batch)


# --- none and auto (MEDL, cost-aware) -------------------------------------------------------

def plan_none(analysis: Analysis) -> Plan:
    """Keep everything (plain ``jax.jit``): the baseline."""
    return Plan(choices=tuple(Choice(r, Decision.SAVE, "strategy='none'")
                              for r in analysis.residuals),
                strategy="none", recompute_flops=0.0, baseline_flops=analysis.program.flops)


def plan_auto(analysis: Analysis, *, max_recompute_fraction: float = 0.05,
              max_layer_fraction: float = 0.5, min_bytes: int = 0) -> Plan:
    """MEDL's rule: recompute utility-layer residuals, keep heavy ones (see module doc).

    Args:
      analysis: what to plan for.
      max_recompute_fraction: cap on all recompute FLOPs together, as a fraction of the
        step's FLOPs; candidates are taken by bytes freed per FLOP until the cap is reached.
      max_layer_fraction: a single residual whose chain costs more than this fraction of its
        layer's heavy (matmul/conv) FLOPs is never recomputed.
      min_bytes: residuals smaller than this are kept.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> a = jaxmem.analyze(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2),
      ...                    jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> sorted({str(c.residual.kind) for c in plan_auto(a).of(Decision.RECOMPUTE)})
      ['utility']
    """
    candidates, reasons = _medl_candidates(analysis, min_bytes)
    marginal = _marginal_chains(analysis, candidates)
    _cap_per_layer(analysis, candidates, reasons, marginal, max_layer_fraction)
    _cap_total(analysis, candidates, reasons, marginal, max_recompute_fraction)
    _cap_anchor_bytes(analysis, candidates, reasons)
    choices = []
    for r in analysis.residuals:
        if r.value in candidates:
            choices.append(Choice(r, Decision.RECOMPUTE,
                                  f"{r.kind} output of {r.primitive}: recompute "
                                  f"{r.recompute_flops:.3g} FLOPs from kept values"))
        else:
            choices.append(Choice(r, Decision.SAVE, reasons.get(r.value, "kept")))
    notes = tuple(f"bottleneck: {b.layer or '<top>'} makes {b.dtype}{list(b.shape)} "
                  f"({fmt_bytes(b.nbytes)}, {100 * b.share:.0f}% of the predicted peak), "
                  f"which recompute cannot shrink; {b.suggestion}"
                  for b in analysis.bottlenecks())
    return Plan(choices=tuple(choices), strategy="auto",
                recompute_flops=recompute_cost(analysis, candidates),
                baseline_flops=analysis.program.flops, notes=notes)


def auto_candidates(analysis: Analysis, *, max_recompute_fraction: float = 0.05
                    ) -> list[Plan]:
    """The plans the ``"auto"`` strategy compiles and picks from, most per-layer first.

    MEDL's rule has one answer for *what* to drop but the compilers disagree on *how* the
    re-creation should be grouped: XLA:CPU keeps least when each layer re-creates what it
    reads (:func:`plan_auto`), XLA:GPU on decoders when a whole block is re-created at once
    behind one barrier, as ``jax.checkpoint`` around a block does (it then cannot hoist
    layout copies of the kept values into the forward pass). So the candidates are:

    1. :func:`plan_auto` (per-layer regions), and its strict variant (a residual may cost 5%
       of its layer's heavy FLOPs, not 50%);
    2. the same drop set re-created per block, at the shallowest block depth
       (:func:`block_depths`), and at the shallowest balanced one if that is deeper;
    3. per-block ``dots_saveable`` as a plan (:func:`plan_blocks` with ``keep_heavy``):
       every cheap value re-created with its block, dropout masks from the key included;
    4. the same with the heavy outputs that are large but cheap to redo (attention scores)
       re-created too, within the FLOP cap (:func:`plan_selective`);
       3 and 4 with light layers (norms, activations) joined to the next block and, where
       that cuts differently, as blocks of their own (:func:`block_boundaries`): the H100
       target keeps the join on the zoo ResNet, XLA:CPU the other on the zoo GPT;
    5. per-block ``dots_saveable`` with the whole step as one block (depth 0).

    (``jaxmem.optimize`` adds two more that are not plans: the step traced with its loss
    under ``jax.checkpoint(policy=dots_saveable)``, whole and around each block of the name
    stack, :mod:`jaxmem.rewriting.blockwise`.)

    Candidates whose predicted recompute exceeds ``max_recompute_fraction`` of the step's
    FLOPs, or that drop nothing, are left out; duplicates too. The caller compiles them on
    the target and keeps the lowest peak (``jaxmem.optimize``'s ``verify``).
    """
    auto = plan_auto(analysis, max_recompute_fraction=max_recompute_fraction)
    strict = plan_auto(analysis, max_recompute_fraction=max_recompute_fraction,
                       max_layer_fraction=0.05)
    out = [auto, strict]
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
        for join in cuts:
            out.append(plan_blocks(analysis, d, keep_heavy=True, join_light=join))
            out.append(plan_selective(analysis, d, join_light=join,
                                      max_recompute_fraction=max_recompute_fraction))
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


def _medl_candidates(analysis: Analysis, min_bytes: int
                     ) -> tuple[dict[int, Residual], dict[int, str]]:
    """The residuals MEDL's rule recomputes, and why each other one is kept."""
    prog = analysis.program
    candidates: dict[int, Residual] = {}
    reasons: dict[int, str] = {}
    for r in analysis.residuals:
        if medl_keeps(r.kind):
            reasons[r.value] = (f"{r.kind} output: kept" if r.is_activation
                                else f"{r.kind}: always available")
        elif r.nbytes < min_bytes:
            reasons[r.value] = f"smaller than min_bytes={min_bytes}"
        elif not any(prog.values[a].producer is not None or prog.values[a].is_input
                     for a in chains.chain_inputs(prog, r.chain)):
            # iota / broadcast of a constant: XLA re-creates these itself inside the fusion
            # that reads them; an explicit copy would be hoisted and stored instead.
            reasons[r.value] = "made from constants only: left to XLA"
        else:
            candidates[r.value] = r
    return candidates, reasons


def _marginal_chains(analysis: Analysis, candidates: dict[int, Residual]
                     ) -> dict[int, list[int]]:
    """Each candidate's chain as if every other residual were kept."""
    prog = analysis.program
    kept = frozenset(r.value for r in analysis.residuals)
    return {v: chains.replay_chain(prog, [v], chains.chain_start(prog, dropped={v},
                                                                  kept=kept))[0]
            for v in candidates}


def _layer_heavy_flops(analysis: Analysis) -> dict[str, float]:
    """Forward heavy FLOPs per layer path."""
    out: dict[str, float] = defaultdict(float)
    for n in analysis.program.nodes:
        if n.kind == Kind.HEAVY and n.phase != "backward":
            out[n.layer] += n.flops
    return out


def _cap_per_layer(analysis: Analysis, candidates: dict[int, Residual],
                   reasons: dict[int, str], marginal: dict[int, list[int]],
                   max_layer_fraction: float) -> None:
    """Keep a residual whose own chain costs more than its layer's share of heavy FLOPs."""
    prog = analysis.program
    heavy = _layer_heavy_flops(analysis)
    total_heavy = sum(heavy.values())
    n_heavy_layers = max(1, sum(1 for f in heavy.values() if f > 0))
    for r in list(candidates.values()):
        flops = sum(prog.nodes[i].flops for i in marginal[r.value])
        ref = heavy.get(r.layer) or total_heavy / n_heavy_layers
        if ref and flops > max_layer_fraction * ref:
            del candidates[r.value]
            reasons[r.value] = (f"recompute {flops:.3g} FLOPs > "
                                f"{max_layer_fraction:g} x layer heavy FLOPs {ref:.3g}")


def _cap_total(analysis: Analysis, candidates: dict[int, Residual], reasons: dict[int, str],
               marginal: dict[int, list[int]], max_recompute_fraction: float) -> None:
    """Global FLOP cap: cheapest bytes first, then checked with the rewrite's own chains
    (which grow when neighbours are dropped, and are paid once per backward region)."""
    prog = analysis.program
    cap = max_recompute_fraction * prog.flops
    mflops = {v: sum(prog.nodes[i].flops for i in ch) for v, ch in marginal.items()}
    # Dropping a value that other chains pass through (a residual-stream add, a block input)
    # lengthens all of them: rank it behind values nothing else is rebuilt from.
    through: dict[int, int] = defaultdict(int)
    for r in candidates.values():
        for i in r.chain:
            for o in prog.nodes[i].outputs:
                if o != r.value and o in candidates:
                    through[o] += 1
    order = sorted(candidates.values(), key=lambda r: -r.nbytes / (mflops[r.value] + 1.0)
                   / (1.0 + through[r.value]))
    over = f"over the recompute cap ({max_recompute_fraction:g} of the step's FLOPs)"
    spent, paid = 0.0, set()
    for r in order:
        extra = sum(prog.nodes[i].flops for i in marginal[r.value] if i not in paid)
        if spent + extra > cap:
            del candidates[r.value]
            reasons[r.value] = over
            continue
        spent += extra
        paid.update(marginal[r.value])
    order = [r for r in order if r.value in candidates]
    while order and recompute_cost(analysis, candidates) > cap:
        for r in order[-max(1, len(order) // 10):]:  # drop the worst tenth, re-check
            del candidates[r.value]
            reasons[r.value] = f"{over} once chains are replayed per region"
        order = order[:-max(1, len(order) // 10)]


def _cap_anchor_bytes(analysis: Analysis, candidates: dict[int, Residual],
                      reasons: dict[int, str]) -> None:
    """A chain keeps its anchors alive into the backward pass. Anchors that are residuals or
    inputs are alive anyway; others (a matmul output feeding a norm) cost memory: keep a
    residual whose share of them is more than it frees."""
    prog = analysis.program
    residual_ids = {r.value for r in analysis.residuals}
    starts = {v: chains.chain_inputs(prog, r.chain) for v, r in candidates.items()}
    changed = True
    while changed:
        changed = False
        kept_anyway = (residual_ids - set(candidates)) | set(prog.inputs)
        owners: dict[int, list[int]] = defaultdict(list)
        for vid in candidates:
            for a in starts[vid]:
                if a not in kept_anyway and prog.values[a].producer is not None:
                    owners[a].append(vid)
        for vid, r in list(candidates.items()):
            extra = sum(prog.values[a].nbytes / len(owners[a])
                        for a in starts[vid] if vid in owners.get(a, ()))
            if extra > r.nbytes:
                del candidates[vid]
                reasons[vid] = (f"recomputing would keep {fmt_bytes(extra)} of anchors alive "
                                f"to free {fmt_bytes(r.nbytes)}")
                changed = True


# --- blocks ---------------------------------------------------------------------------------

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
    without it), so :func:`auto_candidates` compiles both.
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
    choices += [Choice(_anchor_record(prog, v), Decision.RECOMPUTE,
                       f"inside a block (depth {depth}), not read by the backward itself: "
                       "re-created with the block")
                for v in sorted(drop - residual_ids)]
    choices += [Choice(_anchor_record(prog, v), Decision.OFFLOAD,
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
    choices += [Choice(_anchor_record(prog, v), Decision.RECOMPUTE, reason)
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
    cost = recompute_cost(analysis, drop, depth, keep)

    def gain(v: int) -> float:
        return cost - recompute_cost(analysis, drop - {v}, depth, keep)

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
        cost -= g
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


# --- segments and offload (through the cost model) ------------------------------------------

def plan_segments(analysis: Analysis, segments: int | None = None,
                  profile: DeviceProfile | str | None = None) -> Plan:
    """Chen et al.'s sqrt(n) checkpointing through jaxmem's rewrite: keep every k-th heavy
    output (k = n / segments, default sqrt(n) segments) and recompute everything else."""
    model = CostModel(analysis, profile)
    prog = model.program
    heavy = sorted((v for v in model.candidates
                    if prog.nodes[prog.values[v].producer].kind == Kind.HEAVY),
                   key=lambda v: prog.values[v].producer)
    n = len(heavy)
    segs = segments or max(1, round(math.sqrt(n)))
    k = max(1, math.ceil(n / segs))
    keep = {heavy[i] for i in range(0, n, k)}
    drop = model.candidates - keep
    return plan_from_sets(model, drop, (), f"segments(sqrt(n)={segs})", "segments")


def plan_offload(analysis: Analysis, auto: Plan, offload: bool | str = True,
                 profile: DeviceProfile | str | None = None) -> Plan:
    """No budget: the auto plan plus offloads. Values tagged with
    :func:`jaxmem.offload_name` are always offloaded; with ``offload=True`` also every kept
    residual whose round trip the model says hides under compute (largest first)."""
    model = CostModel(analysis, profile)
    tagged = set(offload_tagged(analysis))
    drop = set(auto.recompute) - tagged
    off = set(tagged)
    if offload is True:
        st = model.states(drop, off)
        starts = set().union(*[s.starts for s in st.values()]) if st else set()
        for v in sorted(model.offloadable() - drop - off - starts,
                        key=lambda x: -model.bytes.get(x, 0)):
            if model.transfer(off | {v}) <= model.transfer(off):
                off.add(v)
        # a value the auto plan recomputes is offloaded instead when that is predicted
        # cheaper (the round trip hides, the recompute does not) and no higher in peak
        cur = model.evaluate(drop, off)
        for v in sorted(model.offloadable() & drop, key=lambda x: -model.bytes.get(x, 0)):
            ev = model.evaluate(drop - {v}, off | {v})
            if ev.time < cur.time and ev.peak <= cur.peak:
                drop.discard(v)
                off.add(v)
                cur = ev
    return plan_from_sets(model, drop, off, "auto+offload", "auto", notes=auto.notes)


def plan_from_sets(model: CostModel, drop: Iterable[int], off: Iterable[int], strategy: str,
                   why: str, budget: int | None = None, notes: Sequence[str] = ()) -> Plan:
    """A :class:`~jaxmem.planning.plan.Plan` from the sets of values to recompute (``drop``) and to
    offload (``off``), as the cost model and the budget solvers decide them; dropped anchors
    that are not residuals get a choice of their own."""
    drop, off = frozenset(drop), frozenset(off)
    ev = model.evaluate(drop, off)
    choices = []
    tagged = offload_tagged(model.analysis)
    for r in model.analysis.residuals:
        if r.value in drop:
            choices.append(Choice(r, Decision.RECOMPUTE, f"{why}: recompute from kept values"))
        elif r.value in off:
            reason = ("tagged with jaxmem.offload_name" if r.value in tagged
                      else f"{why}: transfer hides under compute better than recompute")
            choices.append(Choice(r, Decision.OFFLOAD, reason))
        else:
            choices.append(Choice(r, Decision.SAVE, f"{why}: kept"))
    residual_ids = {r.value for r in model.analysis.residuals}
    for v in sorted((drop | off) - residual_ids):
        d = Decision.RECOMPUTE if v in drop else Decision.OFFLOAD
        choices.append(Choice(_anchor_record(model.program, v), d,
                              "anchor of a recompute chain (not read by the backward "
                              "itself): dropped, so its segment is recomputed from earlier "
                              "kept values"))
    return Plan(choices=tuple(choices), strategy=strategy,
                recompute_flops=recompute_cost(model.analysis, drop),
                baseline_flops=model.program.flops, predicted_peak=ev.peak, budget=budget,
                notes=tuple(notes))


def _anchor_record(program: Program, v: int) -> Residual:
    """A :class:`~jaxmem.analyzing.analysis.Residual` record for an anchor the backward does not
    read
    itself (a matmul output feeding a norm), so a plan can decide to re-create it too."""
    val = program.values[v]
    node = program.nodes[val.producer]
    return Residual(
        name=f"{node.layer + '/' if node.layer else ''}{node.primitive}#{v}", value=v,
        shape=val.shape, dtype=val.dtype, nbytes=val.nbytes, layer=node.layer,
        primitive=node.primitive, kind=node.kind, readers=(), recompute_flops=node.flops,
        recompute_bytes=node.bytes_moved, chain=(node.index,), produced_at=node.index)
