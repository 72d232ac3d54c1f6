"""Lower peaks beyond the recompute cap: what a budget would reach, predicted, for the
automatic plan's printout (third box of the data flow, ``Analysis -> Plan``).

The automatic mode (``jaxmem.optimize(step)``) keeps the predicted recompute within
``max_recompute_fraction`` of the step's FLOPs. Where re-creating more, a whole block at a
time as ``jax.checkpoint(block, policy=nothing_saveable)`` does, would lower the peak
further, the user can ask for it with ``budget=``; :func:`hint` says so in one note line:
which budget, about what peak, at what FLOP cost.

It compiles nothing (the automatic mode's compiles are counted): the peak is the cost
model's prediction (:class:`~jaxmem.analyzing.costmodel.CostModel`, its regions cut at the
blocks the plan re-creates, :func:`block_model`), and the note says so, with how far the
model was off on the automatic plan itself (predicted against compiled). The plans it
predicts are the ones the budget search (:mod:`jaxmem.planning.budget`) compiles when the
budget is that low: block plans (:func:`~jaxmem.planning.block_plans.plan_blocks`) at each
block depth.

How good the prediction is, on the corpus's rows where a package's per-block switch
saved more than the automatic mode (H100 target, issue 36): the per-block estimate
(:func:`per_block`) was 1.64 MiB against 1.60 MiB compiled (penzai llama-like, test size,
one block per transformer block), 1.81 GiB against 1.77 GiB (the same, bench size) and
2.25 MiB against 2.25 MiB (BERT, test size); deeper cuts were 8-13% under their compiled
peaks, which is why the note names the per-block one only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.costmodel import CostModel, DeviceProfile
from jaxmem.planning.block_plans import block_depths, plan_blocks
from jaxmem.planning.budget.fallbacks import block_model, first_block_kept
from jaxmem.planning.plan import Plan
from jaxmem.xla.measure import fmt_bytes

__all__ = ["Lower", "block_model", "hint", "lower_peaks", "per_block"]


@dataclasses.dataclass(frozen=True)
class Lower:
    """One plan past the cap, predicted.

    Attributes:
      what: the plan, as the note names it.
      predicted: the cost model's peak for it, bytes.
      estimate: ``predicted`` corrected, bytes: the larger of ``predicted`` times the
        model's miss on the automatic plan (its compiled over predicted peak) and the
        prediction with the kept bytes at full size (not scaled by the calibration).
      recompute_flops: FLOPs it re-creates (jaxmem's count, as the rewrite replays them).
      baseline_flops: the step's FLOPs (jaxmem's count).
      depth: the block depth; balanced: whether no block there holds most of the heavy
        work (:func:`~jaxmem.planning.block_plans.block_depths`).
    """

    what: str
    predicted: int
    estimate: int
    recompute_flops: float
    baseline_flops: float
    depth: int | None = None
    balanced: bool = False

    @property
    def overhead(self) -> float:
        """Recompute FLOPs as a fraction of the step's."""
        return self.recompute_flops / self.baseline_flops if self.baseline_flops else 0.0


def lower_peaks(analysis: Analysis, plan: Plan, *, profile: DeviceProfile | str | None = None,
                base_peak: int | None = None) -> list[Lower]:
    """Block plans (every value inside a block re-created with it, what the budget search's
    block fallback compiles) at each block depth, predicted, in depth order.
    ``base_peak``: the plain step's compiled peak (default ``plan.baseline``'s, else the
    analysis' prediction), which calibrates the model."""
    if base_peak is None and plan.baseline is not None:
        base_peak = plan.baseline.peak
    model = CostModel(analysis, profile, base_peak=base_peak)
    return _predict(analysis, model, _miss(model, plan) or 1.0)


def _predict(analysis: Analysis, model: CostModel, ratio: float) -> list[Lower]:
    """:func:`lower_peaks` on ``model``, estimates scaled by ``ratio`` (the miss)."""
    balanced = block_depths(analysis.program, balanced=True)
    out = []
    for depth in block_depths(analysis.program):
        blk = plan_blocks(analysis, depth)
        if not blk.recompute:
            continue
        # the budget search compiles the block plan with the block whose backward runs
        # first kept as well (the model predicts no higher peak for it): its FLOPs are
        # what the budget would cost (penzai's llama-like bench step: +19% where the plain
        # block plan re-creates the LM head too, +27%)
        blk = first_block_kept(analysis, blk)
        ev = block_model(model, blk).evaluate(blk.recompute, ())
        # The model's calibration scales stored bytes by kappa (XLA keeps less than every
        # residual of the plain step); a block plan's boundary values are buffers XLA
        # keeps whole, so the estimate is the larger of the miss-corrected prediction and
        # the one with the stored bytes at full size.
        whole = model.base + ev.stored + model.kappa * max(
            0.0, model.unscale(ev.peak) - ev.stored)
        out.append(Lower(f"every value inside a block re-created with it (blocks at depth "
                         f"{depth}, as jax.checkpoint(block, policy=nothing_saveable))",
                         ev.peak, int(max(ev.peak * ratio, whole)), blk.recompute_flops,
                         blk.baseline_flops, depth, depth in balanced))
    return out


def per_block(lowers: Iterable[Lower]) -> Lower | None:
    """The block plan at the granularity of ``nn.remat`` around every block: the shallowest
    balanced depth (no block holds most of the heavy work), else the shallowest. On the
    corpus's H100 rows its prediction was the closest (deeper cuts, whose blocks are single
    layers, compiled 10-13% above the model on BERT)."""
    lowers = list(lowers)
    return next((x for x in lowers if x.balanced), lowers[0] if lowers else None)


def _miss(model: CostModel, plan: Plan) -> float | None:
    """Compiled over predicted peak of ``plan``; None when that says nothing about the
    model: not compiled, a built-in policy (no rewrite to predict), or nothing dropped
    (the model is calibrated on the plain step, so it is exact there by construction)."""
    if plan.compiled is None or plan.loss_policy is not None or not (
            plan.recompute or plan.offload):
        return None
    ev = block_model(model, plan).evaluate(plan.recompute, plan.offload)
    return plan.compiled.peak / ev.peak if ev.peak > 0 else None


def hint(analysis: Analysis, plan: Plan, *, max_recompute_fraction: float = 0.05,
         profile: DeviceProfile | str | None = None, margin: float = 0.03,
         slack: float = 0.02, lowers: Iterable[Lower] | None = None) -> str | None:
    """One note for the automatic plan's printout, or None: where a plan past the
    ``max_recompute_fraction`` cap is predicted to lower the compiled peak by more than
    ``margin`` of it, which ``budget=`` asks for it, about what peak, at what FLOP cost.
    The plan is :func:`per_block`'s; the budget named is its estimate plus ``slack``.

    Nothing is compiled: the peak is the cost model's (:func:`lower_peaks`), and the note
    says so and how far the model was off on ``plan`` itself. ``plan``: the automatic plan
    with its compiled figures (without them, None). ``lowers``: :func:`lower_peaks`'s
    answer, if already computed."""
    if plan.compiled is None or analysis.program.flops <= 0:
        return None
    model = CostModel(analysis, profile, base_peak=plan.baseline.peak if plan.baseline
                      else None)
    ratio = _miss(model, plan)
    if lowers is None:
        lowers = _predict(analysis, model, ratio or 1.0)
    now = plan.compiled.peak
    low = per_block(lowers)
    if (low is None or low.estimate >= now * (1 - margin)
            or low.overhead <= max_recompute_fraction):
        return None
    check = ("unchecked on this step: the automatic plan "
             + ("runs a built-in policy" if plan.loss_policy is not None
                else "drops nothing")) if ratio is None else (
        f"on this plan it predicted {fmt_bytes(int(now / ratio))} against "
        f"{fmt_bytes(now)} compiled ({100 * (1 / ratio - 1):+.0f}%)")
    return (f"lower peak predicted past max_recompute_fraction={max_recompute_fraction:g}: "
            f"budget=\"{_round_up(int(low.estimate * (1 + slack)))}\" would reach about "
            f"{fmt_bytes(low.estimate)} ({100 * (1 - low.estimate / now):.0f}% below this "
            f"plan's compiled peak) for about {100 * low.overhead:+.0f}% FLOPs, {low.what}. "
            f"Predicted by the cost model, not compiled: it says {fmt_bytes(low.predicted)}"
            "; the estimate counts the values kept across blocks at full size and allows "
            f"for the model's miss on this plan where known ({check}). The budget search "
            "compiles the plan and raises BudgetError if nothing fits")


def _round_up(n: int) -> str:
    """A budget string a little above ``n`` bytes, three significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            x = n / size
            digits = max(0, 2 - len(str(int(x))) + 1)
            step = 10 ** -digits
            up = (int(x / step) + 1) * step
            return f"{up:.{digits}f}{unit}"
    return str(int(n))
