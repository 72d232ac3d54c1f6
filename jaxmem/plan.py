"""Plans: for each residual, SAVE it, RECOMPUTE it in the backward pass, or OFFLOAD it.

Third box of the data flow: ``Analysis -> Plan``. A :class:`Plan` is a plain, printable,
immutable value; it says what it decided for every residual and why, what it predicts
(peak, FLOPs overhead) and, once compiled, what XLA measured.

The ``"auto"`` strategy is MEDL's rule made cost-aware: keep the outputs of heavy layers
(matmuls, convolutions), drop and recompute the outputs of utility layers (activations,
normalisation, dropout, adds, pooling, concatenation), unless

- recomputing one costs more than ``max_recompute_fraction`` of its layer's heavy FLOPs, or
- its recompute chain would keep alive more bytes (anchors not kept anyway) than it frees.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from collections.abc import Callable, Iterable

from jaxmem.analysis import (
    Analysis,
    Residual,
    is_anchor,
    recompute_chain,
    replay_chain,
    storable,
)
from jaxmem.measure import Figures, fmt_bytes
from jaxmem.program import Program, region_of


class Decision(enum.Enum):
    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the plan does with one residual, and why."""

    residual: Residual
    decision: Decision
    reason: str


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Per-residual decisions plus predicted and (after compiling) measured figures."""

    choices: tuple[Choice, ...]
    strategy: str
    recompute_flops: float
    baseline_flops: float
    predicted_peak: int | None = None
    budget: int | None = None
    donated: tuple[int, ...] = ()
    compiled: Figures | None = None
    baseline: Figures | None = None
    notes: tuple[str, ...] = ()
    # Block plans (:func:`plan_blocks`): the depth of the layer paths that makes one
    # backward region per block.
    region_depth: int | None = None
    # Values the rewrite keeps though the backward does not read them (a block plan's
    # boundary values): recompute chains start from them.
    keep: frozenset[int] = frozenset()

    def of(self, decision: Decision) -> tuple[Choice, ...]:
        return tuple(c for c in self.choices if c.decision is decision)

    @property
    def recompute(self) -> frozenset[int]:
        """Value ids the rewrite re-creates in the backward pass."""
        return frozenset(c.residual.value for c in self.of(Decision.RECOMPUTE))

    @property
    def offload(self) -> frozenset[int]:
        return frozenset(c.residual.value for c in self.of(Decision.OFFLOAD))

    @property
    def dropped_bytes(self) -> int:
        return sum(c.residual.nbytes for c in self.choices if c.decision is not Decision.SAVE)

    @property
    def predicted_overhead(self) -> float:
        """Recompute FLOPs as a fraction of the step's FLOPs (jaxmem's own count)."""
        return self.recompute_flops / self.baseline_flops if self.baseline_flops else 0.0

    @property
    def saved_fraction(self) -> float | None:
        """``1 - compiled peak / plain-jit peak``, once both were compiled."""
        if self.compiled is None or self.baseline is None or not self.baseline.peak:
            return None
        return 1.0 - self.compiled.peak / self.baseline.peak

    def with_figures(self, compiled: Figures | None = None,
                     baseline: Figures | None = None) -> Plan:
        return dataclasses.replace(self, compiled=compiled or self.compiled,
                                   baseline=baseline or self.baseline)

    def __str__(self) -> str:
        n = {d: len(self.of(d)) for d in Decision}
        lines = [
            f"jaxmem.Plan (strategy={self.strategy!r}"
            + (f", budget={fmt_bytes(self.budget)}" if self.budget else "") + ")",
            f"  residuals: {len(self.choices)}; save {n[Decision.SAVE]}, recompute "
            f"{n[Decision.RECOMPUTE]}, offload {n[Decision.OFFLOAD]} "
            f"({fmt_bytes(self.dropped_bytes)} not kept on device)",
            f"  predicted recompute: {self.recompute_flops / 1e9:.4f} GFLOP "
            f"({100 * self.predicted_overhead:.2f}% of the step)",
        ]
        if self.predicted_peak is not None:
            lines.append(f"  predicted peak: {fmt_bytes(self.predicted_peak)}")
        if self.baseline is not None:
            lines.append(f"  plain jit (compiled): {self.baseline}")
        if self.compiled is not None:
            lines.append(f"  jaxmem    (compiled): {self.compiled}")
            if self.saved_fraction is not None and self.baseline is not None:
                extra = (self.compiled.flops / self.baseline.flops - 1
                         if self.baseline.flops else 0.0)
                lines.append(f"  saved {100 * self.saved_fraction:.1f}% of the peak for "
                             f"{100 * extra:+.2f}% FLOPs (XLA's count)")
        if self.donated:
            lines.append(f"  donated arguments: {self.donated}")
        lines += [f"  note: {x}" for x in self.notes]
        by_layer: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for c in self.choices:
            row = by_layer[c.residual.layer or "<top>"]
            row[0 if c.decision is Decision.SAVE else 1] += c.residual.nbytes
        lines.append(f"  {'layer':<40} {'kept':>12} {'dropped':>12}")
        for layer, (kept, dropped) in sorted(by_layer.items(), key=lambda t: -sum(t[1])):
            lines.append(f"  {layer[:40]:<40} {fmt_bytes(kept):>12} {fmt_bytes(dropped):>12}")
        return "\n".join(lines)

    def explain(self) -> str:
        """One line per residual: decision, size, reason."""
        return "\n".join(
            f"{str(c.decision):>9} {fmt_bytes(c.residual.nbytes):>11} {c.residual.name}: "
            f"{c.reason}" for c in self.choices)


def layer_heavy_flops(analysis: Analysis) -> dict[str, float]:
    """Forward heavy FLOPs per layer path."""
    out: dict[str, float] = defaultdict(float)
    for n in analysis.program.nodes:
        if n.kind == "heavy" and n.phase != "backward":
            out[n.layer] += n.flops
    return out


def chain_flops(analysis: Analysis, residuals: Iterable[Residual]) -> float:
    """FLOPs to recompute ``residuals``, each shared chain node counted once."""
    nodes = {i for r in residuals for i in r.chain}
    return float(sum(analysis.program.nodes[i].flops for i in nodes))


def recompute_cost(analysis: Analysis, dropped: Iterable[int],
                   region_depth: int | None = None, keep: Iterable[int] = ()) -> float:
    """FLOPs the rewrite spends re-creating ``dropped`` values, exactly as it replays them.

    Chains start from kept values (inputs, heavy outputs, residuals not dropped), so they
    grow when neighbours are dropped too; each backward region (a run of backward nodes of
    one layer) re-creates what it reads once, and a later region pays again.
    """
    prog = analysis.program
    dropped = frozenset(dropped)
    kept = _chain_start(analysis, dropped, keep)
    total, region, done = 0.0, None, set()
    for n in prog.nodes:
        if n.phase != "backward":
            continue
        need = [v for v in n.inputs if v in dropped]
        if not need:
            continue
        if region_of(n, region_depth) != region:
            region, done = region_of(n, region_depth), set()
        for v in need:
            for i in recompute_chain(prog, v, kept):
                if i not in done:
                    done.add(i)
                    total += prog.nodes[i].flops
    return total


def _chain_start(analysis: Analysis, dropped: frozenset[int],
                 keep: Iterable[int] = ()) -> Callable[[int], bool]:
    """Whether a recompute chain starts from ``v`` (as the rewrite replays it): a residual,
    a value in ``keep`` or an anchor, that is not dropped."""
    prog = analysis.program
    kept_ids = {r.value for r in analysis.residuals} | set(keep)
    return lambda v: v not in dropped and (v in kept_ids or is_anchor(prog, v))


def chain_anchors(analysis: Analysis, r: Residual) -> set[int]:
    """Values a residual's recompute chain reads that are not themselves in the chain."""
    prog = analysis.program
    made = {o for i in r.chain for o in prog.nodes[i].outputs}
    return {v for i in r.chain for v in prog.nodes[i].inputs if v not in made}


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
    """
    heavy = layer_heavy_flops(analysis)
    total_heavy = sum(heavy.values())
    n_heavy_layers = max(1, sum(1 for f in heavy.values() if f > 0))
    prog = analysis.program
    residual_ids = {r.value for r in analysis.residuals}

    candidates: dict[int, Residual] = {}
    reasons: dict[int, str] = {}
    for r in analysis.residuals:
        if not r.recomputable:
            reasons[r.value] = (f"{r.kind} output: kept" if r.is_activation
                                else f"{r.kind}: always available")
            continue
        if r.nbytes < min_bytes:
            reasons[r.value] = f"smaller than min_bytes={min_bytes}"
            continue
        if not any(prog.values[a].producer is not None or prog.values[a].is_input
                   for a in chain_anchors(analysis, r)):
            # iota / broadcast of a constant: XLA re-creates these itself inside the fusion
            # that reads them; an explicit copy would be hoisted and stored instead.
            reasons[r.value] = "made from constants only: left to XLA"
            continue
        candidates[r.value] = r

    # The marginal chain: from every other residual, as if it were kept.
    marginal = {
        r.value: recompute_chain(prog, r.value, lambda u, v=r.value: u != v and (
            u in residual_ids or is_anchor(prog, u)))
        for r in candidates.values()}
    mflops = {v: sum(prog.nodes[i].flops for i in ch) for v, ch in marginal.items()}
    for r in list(candidates.values()):
        ref = heavy.get(r.layer) or total_heavy / n_heavy_layers
        if ref and mflops[r.value] > max_layer_fraction * ref:
            del candidates[r.value]
            reasons[r.value] = (f"recompute {mflops[r.value]:.3g} FLOPs > "
                                f"{max_layer_fraction:g} x layer heavy FLOPs {ref:.3g}")

    # Global FLOP cap: cheapest bytes first, then checked with the rewrite's own chains
    # (which grow when neighbours are dropped, and are paid once per backward region).
    cap = max_recompute_fraction * prog.flops
    # Rank by bytes freed per marginal FLOP.
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
    spent, paid = 0.0, set()
    for r in order:
        extra = sum(prog.nodes[i].flops for i in marginal[r.value] if i not in paid)
        if spent + extra > cap:
            del candidates[r.value]
            reasons[r.value] = (f"over the recompute cap ({max_recompute_fraction:g} of the "
                                "step's FLOPs)")
            continue
        spent += extra
        paid.update(marginal[r.value])
    order = [r for r in order if r.value in candidates]
    while order and recompute_cost(analysis, candidates) > cap:
        for r in order[-max(1, len(order) // 10):]:  # drop the worst tenth, re-check
            del candidates[r.value]
            reasons[r.value] = (f"over the recompute cap ({max_recompute_fraction:g} of the "
                                "step's FLOPs) once chains are replayed per region")
        order = order[:-max(1, len(order) // 10)]

    # A chain keeps its anchors alive into the backward pass. Anchors that are residuals or
    # inputs are alive anyway; others (a matmul output feeding a norm) cost memory.
    changed = True
    while changed:
        changed = False
        kept_anyway = (residual_ids - set(candidates)) | set(prog.inputs)
        extra_owner: dict[int, list[int]] = defaultdict(list)
        for vid, r in candidates.items():
            for a in chain_anchors(analysis, r):
                if a not in kept_anyway and prog.values[a].producer is not None:
                    extra_owner[a].append(vid)
        for vid, r in list(candidates.items()):
            extra = sum(prog.values[a].nbytes / len(extra_owner[a])
                        for a in chain_anchors(analysis, r) if vid in extra_owner.get(a, ()))
            if extra > r.nbytes:
                del candidates[vid]
                reasons[vid] = (f"recomputing would keep {fmt_bytes(extra)} of anchors alive "
                                f"to free {fmt_bytes(r.nbytes)}")
                changed = True

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
                baseline_flops=prog.flops, notes=notes)


def block_boundaries(program: Program, depth: int) -> frozenset[int]:
    """Forward values made in one block and read in another.

    A block is a layer path cut to ``depth`` parts (``"GPT/block3/attn"`` at depth 2 is
    ``"GPT/block3"``); top-level equations form one block of their own.
    """
    return program.crossing("forward", depth)


def block_depths(program: Program) -> tuple[int, ...]:
    """Layer-path depths that split the forward pass into at least three blocks with heavy
    (matmul/convolution) work, shallowest first."""
    deepest = max((len(n.layer.split("/")) for n in program.nodes if n.layer), default=0)
    out = []
    for d in range(1, deepest + 1):
        blocks = {"/".join(n.layer.split("/")[:d]) for n in program.nodes
                  if n.phase == "forward" and n.kind == "heavy"}
        if len(blocks) >= 3:
            out.append(d)
    return tuple(out)


def plan_blocks(analysis: Analysis, depth: int, offload: Iterable[int] = ()) -> Plan:
    """``jax.checkpoint(policy=nothing_saveable)`` around every block, as a plan.

    Keeps only the values that cross block boundaries at ``depth`` (and arguments), and
    re-creates everything else, matmul and convolution outputs included, once per block in
    the backward pass (one backward region per block). The low-memory end of what the
    budget planner can reach without segments: about one extra forward pass of FLOPs.

    ``offload``: boundary values (:func:`block_offload_candidates`) to park in host memory
    instead of keeping them on the device (MaxText's "offload the decoder layer inputs,
    recompute the rest"); each comes back for the block that starts from it.
    """
    prog = analysis.program
    boundary = block_boundaries(prog, depth)
    residual_ids = {r.value for r in analysis.residuals}
    drop = set(storable(prog, residual_ids)[0] - boundary)
    off = frozenset(offload)
    bad = off - block_offload_candidates(analysis, depth) if off else frozenset()
    if bad:
        raise ValueError(f"values {sorted(bad)} are not block boundary values at depth "
                         f"{depth} that can be offloaded (see block_offload_candidates)")

    def choice(r: Residual) -> Choice:
        if r.value in off:
            return Choice(r, Decision.OFFLOAD, f"crosses a block boundary (depth {depth}): "
                          "parked in host memory, fetched back for its block")
        if r.value in drop and r.recomputable:
            return Choice(r, Decision.RECOMPUTE,
                          f"inside a block (depth {depth}): re-created with it")
        return Choice(r, Decision.SAVE, f"crosses a block boundary (depth {depth}): kept"
                      if r.value in boundary else "kept")

    choices = [choice(r) for r in analysis.residuals]
    choices += [Choice(anchor_residual(prog, v), Decision.RECOMPUTE,
                       f"inside a block (depth {depth}), not read by the backward itself: "
                       "re-created with the block")
                for v in sorted(drop - residual_ids)]
    choices += [Choice(anchor_residual(prog, v), Decision.OFFLOAD,
                       f"crosses a block boundary (depth {depth}): parked in host memory, "
                       "fetched back for the block that starts from it")
                for v in sorted(off - residual_ids)]
    dropped = frozenset(c.residual.value for c in choices if c.decision is Decision.RECOMPUTE)
    keep = frozenset(boundary - drop - off)
    return Plan(choices=tuple(choices),
                strategy=f"blocks(depth={depth}" + (", offload)" if off else ")"),
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
    kept = _chain_start(analysis, drop, blk.keep)
    # what the backward pass reads of them: directly, or as the start of a block's replay
    used: set[int] = set()
    for n in prog.nodes:
        if n.phase == "backward":
            used.update(n.inputs)
            redo = [v for v in n.inputs if v in drop]
            if redo:
                used.update(replay_chain(prog, redo, kept)[1])

    def ok(v: int) -> bool:
        n = prog.nodes[prog.values[v].producer]
        return (n.phase == "forward" and n.kind not in ("control", "unknown")
                and not getattr(n.eqn, "effects", None) and prog.values[v].nbytes > 0
                and v in used)

    return frozenset(v for v in block_boundaries(prog, depth) if ok(v))


def resave(analysis: Analysis, plan: Plan, headroom: int) -> Plan:
    """A block plan with some of its re-created values kept again, within ``headroom`` bytes.

    Lazy greedy on FLOPs saved per byte: each candidate's gain is its exact marginal
    :func:`recompute_cost` (given what is already re-saved), re-evaluated when it reaches the
    top of the heap. A re-saved value stays on the device from the forward pass to its
    backward region, so the bytes added estimate what the peak can grow; the compiler may
    lower it instead (less to re-create: smaller recompute working sets) or raise it more
    (a kept value changes its fusions), so the budget loop compiles the result.
    """
    import heapq

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


def anchor_residual(program: Program, v: int) -> Residual:
    """A :class:`Residual` record for a chain anchor the backward does not read itself (a
    matmul output feeding a norm), so a plan can decide to re-create it too."""
    val = program.values[v]
    node = program.nodes[val.producer]
    return Residual(
        name=f"{node.layer + '/' if node.layer else ''}{node.primitive}#{v}", value=v,
        shape=val.shape, dtype=val.dtype, nbytes=val.nbytes, layer=node.layer,
        primitive=node.primitive, kind=node.kind, readers=(), recompute_flops=node.flops,
        recompute_bytes=node.bytes_moved, chain=(node.index,), produced_at=node.index)


def plan_none(analysis: Analysis) -> Plan:
    """Keep everything (plain ``jax.jit``): the baseline."""
    return Plan(choices=tuple(Choice(r, Decision.SAVE, "strategy='none'")
                              for r in analysis.residuals),
                strategy="none", recompute_flops=0.0, baseline_flops=analysis.program.flops)


def from_decisions(analysis: Analysis, decisions: dict[int, Decision], strategy: str,
                   reason: str = "") -> Plan:
    """A plan from explicit ``{value id: Decision}`` (others SAVE)."""
    choices = tuple(Choice(r, decisions.get(r.value, Decision.SAVE), reason)
                    for r in analysis.residuals)
    rec = [c.residual for c in choices if c.decision is Decision.RECOMPUTE]
    return Plan(choices=choices, strategy=strategy, recompute_flops=chain_flops(analysis, rec),
                baseline_flops=analysis.program.flops)


