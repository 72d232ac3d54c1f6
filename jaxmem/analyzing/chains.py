"""Recompute chains: where one starts, which backward region replays it, what it replays.

Between the second box of the data flow (``Program -> Analysis``) and the fourth (the
rewrite): the one definition of a recompute chain. The analysis (a residual's chain and its
cost), the strategies and the budget's cost model (which predict) and the joint rewrite and
:func:`jaxmem.checkpoint` (which replay) all ask this module, so that what a plan predicts
is what the rewrite does. The words are those of docs/concepts.md:

- an **anchor** (:func:`is_anchor`) is a value no chain passes through unless a plan drops
  it: a program input or constant, or the output of a heavy layer, a control-flow unit, an
  unknown or effectful primitive, or a backward equation;
- a chain **starts** (:func:`chain_start`) at a value the plan does not drop that is kept
  (a residual, a block plan's boundary value), offloaded (fetched back from the host) or an
  anchor; it re-creates the dropped values from there (:func:`replay_chain`);
- a backward **region** (:func:`backward_regions`) is a run of backward equations with one
  region key (:func:`jaxmem.program.region_of`); a region replays what it reads once, and a
  later region replays it again.

Where the callers legitimately differ, they differ by a parameter, documented here:

- ``chain_start(anchors=False)``: under ``jax.checkpoint`` (:func:`jaxmem.checkpoint`) the
  policy decides every value, so there are no anchors: a chain runs back to the values the
  policy saves and the function's inputs, through heavy outputs it does not save.
- ``backward_regions(needs=...)``: which equations open and hold a region. The rewrite cuts
  regions at equations that read a dropped or offloaded value, :func:`replay_flops` at those
  that read a dropped one, the cost model at those that read any residual activation (fixed
  regions, so the budget's greedy can update them incrementally; an equation of another
  layer reading only kept values between two of one layer makes the model count a replay
  the rewrite does not do: the model errs high), and the rewrite's prefetch at every
  backward equation (``needs=None``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import NamedTuple

from jaxmem.tracing.primitives import CHEAP, Kind
from jaxmem.tracing.program import Node, Program, region_of

__all__ = [
    "backward_regions", "chain_inputs", "chain_start", "is_anchor", "replay_chain",
    "replay_flops", "replay_nodes", "stored_values",
]


def is_anchor(program: Program, vid: int) -> bool:
    """Whether no recompute chain passes through value ``vid`` unless a plan drops it.

    Anchors are program inputs and constants, and the outputs of heavy layers (matmul,
    convolution), control-flow units, unknown or effectful primitives and backward
    equations. MEDL recomputes utility outputs *from the outputs of the expensive layers*:
    those are the anchors.
    """
    v = program.values[vid]
    if v.producer is None:
        return True
    node = program.nodes[v.producer]
    if node.kind not in CHEAP or node.phase == "backward":
        return True
    return bool(getattr(node.eqn, "effects", None))


class StoredValues(NamedTuple):
    """Forward values a plan decides on (:func:`stored_values`): ``(droppable, fixed)``."""

    droppable: frozenset[int]   # a plan may recompute or offload these
    fixed: frozenset[int]       # always kept: outputs of units, unknown or effectful primitives


def stored_values(program: Program, residual_ids: Iterable[int]) -> StoredValues:
    """Forward values the rewrite keeps for the backward pass unless a plan drops them.

    The residuals, and the anchors chains may start from, made outside the backward pass;
    values with no bytes and values XLA re-derives from constants are left out. Returns
    ``(droppable, fixed)``: ``fixed`` are those a plan may not drop (the rewrite cannot
    replay a control-flow unit, an unknown primitive or an effect).
    """
    residual_ids = frozenset(residual_ids)
    droppable: set[int] = set()
    fixed: set[int] = set()
    for v in program.values:
        if v.producer is None or v.nbytes == 0 or v.id in program.constant_derived:
            continue
        node = program.nodes[v.producer]
        if node.phase == "backward":
            continue
        if not (v.id in residual_ids or is_anchor(program, v.id)):
            continue
        if node.kind in (Kind.CONTROL, Kind.UNKNOWN) or getattr(node.eqn, "effects", None):
            fixed.add(v.id)
        else:
            droppable.add(v.id)
    return StoredValues(frozenset(droppable), frozenset(fixed))


def chain_start(program: Program, *, dropped: Collection[int] = frozenset(),
                kept: Collection[int] = frozenset(), offloaded: Collection[int] = frozenset(),
                anchors: bool = True) -> Callable[[int], bool]:
    """Whether a recompute chain starts at a value (and reaches no further back).

    A chain starts at a value the plan does not drop that is ``kept`` (residuals, a block
    plan's boundary values), ``offloaded`` (fetched back from the host) or an anchor
    (:func:`is_anchor`). Program inputs and constants end every chain. ``anchors=False``:
    no anchors, as under ``jax.checkpoint``, where a chain runs back to the values the
    policy saves (``kept``) and the function's inputs.

    The collections are used as given (not copied): this is on the budget solver's hot path.
    """
    if anchors:
        return lambda v: v not in dropped and (
            v in kept or v in offloaded or is_anchor(program, v))
    return lambda v: v not in dropped and (v in kept or v in offloaded)


def replay_chain(program: Program, targets: Sequence[int], starts: Callable[[int], bool],
                 available: Iterable[int] = ()) -> tuple[list[int], list[int]]:
    """What re-creating ``targets`` replays, given where chains start (:func:`chain_start`).

    Returns ``(nodes, inputs)``: the indices of the nodes to replay, in program order, and
    the values they start from (chain starts, and the program inputs or constants reached),
    in discovery order. A target is replayed even if it would start a chain. Values in
    ``available`` (re-created earlier in the region) are neither walked nor returned.
    """
    nodes: set[int] = set()
    inputs: dict[int, None] = {}
    tset, done = set(targets), set(available)
    stack = list(targets)
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in done:
            continue
        if v not in tset and starts(v):
            inputs[v] = None
            continue
        prod = program.values[v].producer
        if prod is None:
            inputs[v] = None
            continue
        nodes.add(prod)
        stack.extend(program.nodes[prod].inputs)
    return sorted(nodes), list(inputs)


def chain_inputs(program: Program, nodes: Iterable[int]) -> set[int]:
    """Values a chain of ``nodes`` reads that it does not make itself: where it starts."""
    nodes = list(nodes)
    made = {o for i in nodes for o in program.nodes[i].outputs}
    return {v for i in nodes for v in program.nodes[i].inputs if v not in made}


def backward_regions(program: Program, needs: Callable[[Node], bool] | None = None,
                     region_depth: int | None = None) -> list[list[int]]:
    """Backward regions: node indices of runs of backward equations with one region key.

    Only equations for which ``needs(node)`` holds (``None``: every backward equation)
    belong to a region, and a new region opens at one whose key
    (:func:`jaxmem.program.region_of` at ``region_depth``) differs from the previous such
    equation's; the others neither belong to a region nor cut one.
    """
    out: list[list[int]] = []
    key = None
    for n in program.nodes:
        if n.phase != "backward" or (needs is not None and not needs(n)):
            continue
        here = region_of(n, region_depth)
        if here != key:
            out.append([])
            key = here
        out[-1].append(n.index)
    return out


def replay_flops(program: Program, dropped: Collection[int], starts: Callable[[int], bool],
                 region_depth: int | None = None) -> float:
    """FLOPs the rewrite spends re-creating ``dropped``: each backward region replays the
    chains of the dropped values it reads once (shared nodes counted once)."""
    return sum(program.nodes[i].flops
               for nodes in _region_replays(program, dropped, starts, region_depth)
               for i in nodes)


def replay_nodes(program: Program, dropped: Collection[int], starts: Callable[[int], bool],
                 region_depth: int | None = None) -> int:
    """The nodes the rewrite replays re-creating ``dropped``, counted as
    :func:`replay_flops` counts their FLOPs: with the program's own, about the rewritten
    program's size (its barriers not counted; constants folded and outputs forwarded
    counted)."""
    return sum(map(len, _region_replays(program, dropped, starts, region_depth)))


def _region_replays(program: Program, dropped: Collection[int],
                    starts: Callable[[int], bool], region_depth: int | None
                    ) -> Iterable[list[int]]:
    """Per backward region that reads a value of ``dropped``, the nodes it replays."""
    def reads(n: Node) -> bool:
        return any(v in dropped for v in n.inputs)

    for region in backward_regions(program, reads, region_depth):
        targets = [v for i in region for v in program.nodes[i].inputs if v in dropped]
        yield replay_chain(program, list(dict.fromkeys(targets)), starts)[0]


class MarginalReplay:
    """:func:`replay_flops` of a drop set, and of the same set less one value, for the
    lazy-greedy re-saving that asks for one such marginal per candidate
    (:func:`jaxmem.planning.block_plans.resave`). The set less ``v`` is replayed region by
    region, and only the regions ``v``'s removal can change: a backward region with the
    same nodes, whose replay under the whole set neither reads ``v`` nor walks through it,
    replays the same (its targets and chain starts are the same), so its FLOPs are reused.
    Exact: equal to :func:`replay_flops` of the smaller set."""

    def __init__(self, program: Program, dropped: Collection[int], kept: Collection[int],
                 region_depth: int | None = None) -> None:
        self.program, self.kept, self.depth = program, frozenset(kept), region_depth
        self.readers: dict[int, list[Node]] = {}   # value -> the backward nodes reading it
        for n in program.nodes:
            if n.phase == "backward":
                for v in n.inputs:
                    self.readers.setdefault(v, []).append(n)
        self.reset(dropped)

    def reset(self, dropped: Collection[int]) -> None:
        """Take ``dropped`` as the set: each region's FLOPs and the values its replay
        reads or walks through."""
        self.dropped = frozenset(dropped)
        starts = chain_start(self.program, dropped=self.dropped, kept=self.kept)
        self.regions = {r: self._replay(r, self.dropped, starts)
                        for r in self._regions(self.dropped)}
        self.total = sum(f for f, _ in self.regions.values())

    def without(self, v: int) -> float:
        """:func:`replay_flops` of the set less ``v``."""
        d = self.dropped - {v}
        # a backward node that read v and no other dropped value leaves the regions
        # (backward_regions' ``needs``), which may join the runs beside it
        moved = any(not any(u in d for u in n.inputs) for n in self.readers.get(v, ()))
        starts = chain_start(self.program, dropped=d, kept=self.kept)
        total = 0.0
        for r in (self._regions(d) if moved else self.regions):
            hit = self.regions.get(r)
            total += hit[0] if hit is not None and v not in hit[1] else (
                self._replay(r, d, starts)[0])
        return total

    def _regions(self, dropped: frozenset[int]) -> list[tuple[int, ...]]:
        return [tuple(r) for r in backward_regions(
            self.program, lambda n: any(u in dropped for u in n.inputs), self.depth)]

    def _replay(self, region: tuple[int, ...], dropped: frozenset[int],
                starts: Callable[[int], bool]) -> tuple[float, frozenset[int]]:
        nodes_of = self.program.nodes
        targets = list(dict.fromkeys(v for i in region for v in nodes_of[i].inputs
                                     if v in dropped))
        nodes, _ = replay_chain(self.program, targets, starts)
        walked = frozenset(targets).union(*(nodes_of[i].inputs for i in nodes))
        return sum(nodes_of[i].flops for i in nodes), walked
