"""What the budget search tries when the cost model cannot reach the budget.

Part of the third box of the data flow (``Analysis -> Plan`` under a budget). Each fallback
compiles its candidates through the search's callbacks and returns the best that fits:

- :func:`~jaxmem.planning.budget.ranked_blocks.ranked_block_plan` (its own module) — the
  same block plans ranked by the cost model and the rewritten steps' liveness and compiled
  fewest-FLOPs-predicted-to-fit first, stopping at the first that fits (a budget's
  ``search="ranked"``, the default since issue 37);
- :func:`best_block_plan` — ``jax.checkpoint(nothing_saveable)``-style block plans
  (:func:`jaxmem.planning.strategies.plan_blocks`) at every block depth, the lowest depth
  cut with its light layers unjoined too, the lowest one with its first-replayed block kept
  (:func:`first_block_kept`), the roomiest one re-saved (:func:`resaved`), and on an
  accelerator, when none fits, each of them with its gradients unfenced;
- :func:`block_offload_plan` — block plans with their boundary values in host memory;
- segments (Chen's sqrt(n), :func:`jaxmem.planning.strategies.plan_segments`) are tried by the
  search loop itself, since they go through the same compile-and-check as its own plans.

Set ``JAXMEM_BUDGET_DEBUG=1`` to print one line per compiled candidate.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.costmodel import CostModel
from jaxmem.planning.plan import Decision, Plan, recompute_cost
from jaxmem.planning.strategies import block_depths, block_offload_candidates, plan_blocks, resave
from jaxmem.tracing.primitives import Kind
from jaxmem.tracing.program import region_of
from jaxmem.xla.measure import Figures, fmt_bytes

__all__ = ["PLAN_OVER", "DevicePeak", "Found", "best_block_plan", "block_model",
           "block_offload_plan", "block_variants", "debug", "first_block_kept", "plan_over",
           "predicted_peak", "resaved", "unfenced"]

_DEBUG = bool(os.environ.get("JAXMEM_BUDGET_DEBUG"))

#: ``(plan, compiled figures) -> (device peak, note or None)``: the peak to check against
#: the budget (on CPU, XLA's compiled peak still counts offloaded values; see
#: :func:`jaxmem.optimized.device_peak`).
DevicePeak = Callable[[Plan, Figures], tuple[int, str | None]]


def debug(line: str) -> None:
    """One line of the search's trace, when ``JAXMEM_BUDGET_DEBUG`` is set."""
    if _DEBUG:
        print(f"jaxmem budget loop {line}")


@dataclasses.dataclass(frozen=True)
class Found:
    """What a fallback found: the best fitting plan (or None), the compiles it spent and
    the lowest (device) peak it saw."""

    plan: Plan | None
    figures: Figures | None
    compiles: int
    lowest: int | None
    device_peak: int | None = None
    note: str | None = None
    time: float = 0.0          # predicted extra step time, seconds (block offload)
    # (peak, plan): the lowest rewritten-step peak of the block plans ruled out by
    # prediction, none compiled (``ranked_block_plan``): for a BudgetError's minimum
    predicted: tuple[int, Plan] | None = None


@dataclasses.dataclass
class _Checked:
    """The block plans one fallback compiled, each as ``(flops, depth, plan, figures)``:
    all of them, those within ``requested``, the compiles and the lowest peak."""

    requested: int
    compile_plan: Callable[[Plan], Figures]
    tried: list[tuple] = dataclasses.field(default_factory=list)
    fitting: list[tuple] = dataclasses.field(default_factory=list)
    compiles: int = 0
    lowest: int | None = None

    def lowest_tried(self) -> tuple:
        """The tuple of the block plan compiled lowest (the lower depth among equals)."""
        return min(self.tried, key=lambda t: (t[3].peak, t[0]))

    def check(self, depth: int, p: Plan, named: bool = True) -> tuple:
        """Compile ``p`` (a block plan at ``depth``) and record it; its tuple."""
        fig = self.compile_plan(p)
        self.compiles += 1
        self.lowest = fig.peak if self.lowest is None else min(self.lowest, fig.peak)
        label = f", {p.strategy}" if named else ""
        debug(f"(blocks, depth {depth}{label}): compiled {fmt_bytes(fig.peak)}, "
              f"{fig.flops:.4g} FLOPs")
        t = (fig.flops, depth, p, fig)
        self.tried.append(t)
        if fig.peak <= self.requested:
            self.fitting.append(t)
        return t


def best_block_plan(analysis: Analysis, requested: int,
                    compile_plan: Callable[[Plan], Figures]) -> Found:
    """Block plans at every block depth, compiled: the fitting one with the fewest FLOPs,
    after the lowest depth was tried with its light layers unjoined
    (``plan_blocks(join_light=False)``), the one with the lowest peak with its
    first-replayed block kept (:func:`first_block_kept`) and the one with the most headroom
    spent some of it on re-saving (:func:`resaved`). On an accelerator, when none fits,
    each is compiled again unfenced (:func:`_unfenced`)."""
    c = _Checked(requested, compile_plan)
    for depth in block_depths(analysis.program):
        c.check(depth, plan_blocks(analysis, depth), named=False)
    if c.tried:
        # the lowest depth cut the other way too, each light layer's output a boundary of
        # its own (join_light=False): which grouping compiles lower depends on the model
        # and the compiler (BERT-base's post-LayerNorm layers at its bench size, H100
        # target: 1.68 GiB joined, 1.61 GiB unjoined, against per-layer nn.remat's 1.615)
        low = min(c.tried, key=lambda t: (t[3].peak, t[0]))
        unjoined = plan_blocks(analysis, low[1], join_light=False)
        extra = [low[2]]
        if unjoined.recompute != low[2].recompute or unjoined.keep != low[2].keep:
            extra.append(unjoined)
        # the first block the backward re-creates is live beside everything kept either
        # way: keeping it costs no peak in the model and saves its re-creation's FLOPs
        # (a compile each: XLA may still place it higher; on BERT it is the unjoined plan
        # with its first block kept that fits, 1.61 GiB, where either alone is 1.68-1.69)
        extra += [k for p in extra if (k := first_block_kept(analysis, p)) is not p]
        for p in extra[1:]:
            c.check(low[1], p)
    if not c.fitting and c.tried and analysis.platform != "cpu":
        _unfenced(analysis, c)
    fitting, n = c.fitting, c.compiles
    if fitting:
        # the block plan with the most headroom keeps some of what it re-creates again
        roomy = min(fitting, key=lambda t: (t[3].peak, t[0]))
        (blk, fig), k = resaved(analysis, roomy[2], roomy[3], requested, compile_plan)
        n += k
        fitting.append((fig.flops, roomy[1], blk, fig))
    cheapest = min(fitting, key=lambda t: (t[0], t[1]), default=None)
    if cheapest is None:
        return Found(None, None, n, c.lowest)
    return Found(cheapest[2], cheapest[3], n, c.lowest)


#: The cost model's largest over-prediction of a candidate plan's compiled peak, per
#: platform (``python -m benchmarks.prediction --plans``, benchmarks/results/prediction*/:
#: on the H100 target every candidate plan of the zoo and the corpus compiled above its
#: prediction, 85 of 85, by 13% to 58%; on CPU up to 28.9% below, DenseNet's selective
#: plans), and a margin on CPU. A ranked search does not compile a plan predicted above the
#: budget by more than this (it would not fit unless the model were off by more than it
#: has been), except the lowest-predicted one when nothing else is left. A platform not
#: listed: every plan may be compiled.
PLAN_OVER: dict[str, float] = {"cpu": 0.30, "cuda": 0.0, "gpu": 0.0}


def plan_over(analysis: Analysis) -> float:
    """:data:`PLAN_OVER` for ``analysis``' platform; 1.0 (rule nothing out) on a platform
    not listed, or where the program holds loops or unknown primitives (the model sees a
    loop as one unit: a scanned GPT's lowest plan was predicted at 193 MiB and compiled to
    14 MiB on the H100 target)."""
    if any(n.primitive in ("scan", "while") or n.kind in (Kind.CONTROL, Kind.UNKNOWN)
           for n in analysis.program.nodes):
        return 1.0
    return PLAN_OVER.get(analysis.platform, 1.0)


def block_model(model: CostModel, plan: Plan) -> CostModel:
    """``model`` with its backward regions cut where ``plan`` re-creates (its
    ``region_depth``: one region per block) and the plan's kept boundary values
    (``plan.keep``) as chain starts (:meth:`CostModel.blocks`): the cost model of a block
    plan. ``model`` itself when the plan has neither."""
    if plan.region_depth is None and not plan.keep:
        return model
    return model.blocks(plan.region_depth, plan.keep)


def predicted_peak(model: CostModel, plan: Plan) -> int:
    """The cost model's peak for ``plan`` (:func:`block_model`'s, where it is a block
    plan)."""
    return block_model(model, plan).evaluate(plan.recompute, plan.offload).peak


def block_variants(analysis: Analysis) -> list[tuple[int, Plan]]:
    """Every block plan :func:`best_block_plan` may compile (the unfenced retries aside),
    as ``(depth, plan)``: at each block depth, the default grouping and the light layers
    unjoined, each also with its first-replayed block kept; duplicates (the same values
    re-created and kept) once."""
    out: list[tuple[int, Plan]] = []
    seen: set[tuple[frozenset[int], frozenset[int]]] = set()
    for depth in block_depths(analysis.program):
        for p in (plan_blocks(analysis, depth), plan_blocks(analysis, depth, join_light=False)):
            for q in (p, first_block_kept(analysis, p)):
                key = (frozenset(q.recompute), frozenset(q.keep))
                if q.recompute and key not in seen:
                    seen.add(key)
                    out.append((depth, q))
    return out


def unfenced(blk: Plan) -> Plan:
    """``blk`` with its finished gradients left where the scheduler puts them
    (``Plan.unfenced``), named so."""
    return dataclasses.replace(blk, unfenced=True,
                               strategy=blk.strategy.rstrip(")") + ", unfenced)")


def _unfenced(analysis: Analysis, c: _Checked, lowest_only: bool = False) -> None:
    """The block plans ``c`` tried, compiled again with their finished gradients left where
    the scheduler puts them (``Plan.unfenced``); when none fits, the lowest of those with
    its first-replayed block kept (unless it keeps it already). The fence
    (:func:`jaxmem.rewriting.settle.fence_finished`) lowers most block plans on XLA:GPU,
    but a large gradient it makes early is live to the
    update: penzai's llama-like bench step's depth-1 plan compiled to 2,048.8 MB fenced and
    1,904.2 MB unfenced (its 98 MB LM-head gradient), and with its first-replayed block
    kept to 1,899.9 MB, below its package switch's 1,902.9 MB. ``lowest_only`` (a ranked
    search): only the lowest compiled of them."""
    # a ranked search: the lowest compiled block plan only
    tried = [c.lowest_tried()] if lowest_only else list(c.tried)
    again = [c.check(depth, unfenced(blk)) for _, depth, blk, _ in tried]
    if not c.fitting:
        _, depth, low, _ = min(again, key=lambda t: t[3].peak)
        if _KEPT in low.strategy:
            # its first-replayed block is kept already: keeping "the first" again would
            # keep the next block too, another plan and another compile (the zoo Llama at
            # bench size, H100 target: 105.90 MiB either way)
            return
        kept = first_block_kept(analysis, low)
        if kept is not low:
            c.check(depth, kept)


#: What :func:`first_block_kept` adds to a plan's strategy name.
_KEPT = "first-replayed block kept"


def first_block_kept(analysis: Analysis, blk: Plan) -> Plan:
    """``blk`` (a block plan) with the values of the block whose backward runs first (a
    loss head, an LM head) kept instead of re-created: that block's backward comes right
    after the forward pass, while every kept value is still live, so what it re-creates
    is live beside them as what it keeps would be (the cost model predicts no higher
    peak), and keeping it saves its FLOPs (penzai's llama-like bench step: 50 GFLOP of
    the LM head, 31% of the block plan's recompute). The compiler decides: on the H100
    target it compiled 2% higher than the block plan on that step's test size, so the
    fallback compiles it as a candidate of its own. ``blk`` itself when there is nothing
    to keep (one block, or nothing re-created)."""
    prog, depth, drop = analysis.program, blk.region_depth, blk.recompute
    first = next((n for n in prog.nodes if n.phase == "backward"
                  and any(v in drop for v in n.inputs)), None)
    if first is None:
        return blk
    key = region_of(first, depth)[1]
    last = frozenset(v for v in drop
                     if region_of(prog.nodes[prog.values[v].producer], depth)[1] == key)
    if not last or last == drop:
        return blk
    choices = tuple(
        dataclasses.replace(c, decision=Decision.SAVE, reason=(
            "in the block whose backward runs first: re-created it would be live beside "
            "every kept value, as kept it is; kept, so not recomputed"))
        if c.residual.value in last and c.decision is Decision.RECOMPUTE else c
        for c in blk.choices)
    return dataclasses.replace(
        blk, choices=choices,
        strategy=blk.strategy.rstrip(")") + f", {_KEPT})",
        recompute_flops=recompute_cost(analysis, drop - last, depth, blk.keep))


def block_offload_plan(model: CostModel, analysis: Analysis, requested: int,
                       compile_plan: Callable[[Plan], Figures], device_peak: DevicePeak
                       ) -> Found:
    """Block plans at the shallowest block depth with their boundary values offloaded,
    earliest first (the longest windows to hide a round trip in): all of them, then the
    earliest half, quarter, ... while the device peak still fits."""
    prog = model.program
    depths = block_depths(prog)
    if not depths:
        return Found(None, None, 0, None)
    depth = depths[0]
    cands = sorted(block_offload_candidates(analysis, depth),
                   key=lambda v: prog.values[v].producer)
    found, n, lowest = Found(None, None, 0, None), 0, None
    k = len(cands)
    while k >= 1:
        blk = plan_blocks(analysis, depth, offload=cands[:k])
        fig = compile_plan(blk)
        n += 1
        dev, note = device_peak(blk, fig)
        lowest = dev if lowest is None else min(lowest, dev)
        debug(f"(blocks+offload, depth {depth}, {k} offloaded): device peak {fmt_bytes(dev)}")
        if dev > requested:
            break
        t = (blk.recompute_flops / model.profile.flops_per_s
             + model.transfer(blk.offload, depth))
        found = Found(blk, fig, 0, None, dev, note, t)
        k //= 2
    return dataclasses.replace(found, compiles=n, lowest=lowest)


def resaved(analysis: Analysis, blk: Plan, fig: Figures, requested: int,
            compile_plan: Callable[[Plan], Figures], rounds: int = 4, *,
            ratio: float = 1.0, retry: bool = True) -> tuple[tuple[Plan, Figures], int]:
    """Spend a fitting block plan's headroom on keeping values again
    (:func:`jaxmem.planning.strategies.resave`), compiling each round; a round that compiles over
    the budget is retried once with half the headroom (``retry``). ``ratio``: the cost
    model's under-prediction on this step (compiled over predicted peak), the headroom
    divided by it. Returns ``((plan, figures), compiles)``."""
    n = 0
    aim = int(0.98 * requested)
    for _ in range(rounds):
        # 2% below the budget leaves room for the compiler to place a re-saved value higher
        # than its bytes; a plan already within 2% spends what is left (each round is
        # compiled and checked: penzai's llama-like bench step met its package's switch
        # 0.16% below it, with 0.02% more FLOPs than the switch before its headroom went)
        head = int((aim - fig.peak if aim > fig.peak else requested - fig.peak) / ratio)
        if head <= 0:
            break
        for h in (head, head // 2) if retry else (head,):
            cand = resave(analysis, blk, h)
            if cand is blk:
                return (blk, fig), n
            f = compile_plan(cand)
            n += 1
            debug(f"(re-save, {fmt_bytes(h)} headroom): compiled {fmt_bytes(f.peak)}, "
                  f"{f.flops:.4g} FLOPs")
            if f.peak <= requested and f.flops < fig.flops:
                blk, fig = cand, f
                break
        else:
            break
    return (blk, fig), n
