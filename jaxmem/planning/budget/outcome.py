"""The budget search's answer written up: the final plan with its notes, or the error.

Part of the third box of the data flow (``Analysis -> Plan`` under a budget). Once the
search (:mod:`~jaxmem.planning.budget.search`) has chosen, one function here makes the
:class:`~jaxmem.planning.plan.Plan` it returns, with the budget, XLA's figures beside the
plain step's, and a note saying what planned it, in how long and with how many compiles:

- :func:`finish_plain` — the plain step already fits (or the ``offload_name`` tags do not);
- :func:`finish_best` — the cheapest fitting plan of the solvers (or Chen's segments);
- :func:`finish_blocks` — a block plan (:func:`~jaxmem.planning.budget.fallbacks.best_block_plan`);
- :func:`finish_block_offload` — a block plan with boundary values in host memory;
- :func:`no_fit` — the :class:`~jaxmem.planning.budget.units.BudgetError` when nothing fits.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from jaxmem.analyzing.costmodel import CostModel
from jaxmem.planning.budget.fallbacks import Found
from jaxmem.planning.budget.tries import Candidate
from jaxmem.planning.budget.units import BudgetError
from jaxmem.planning.cost_model_plans import plan_from_sets
from jaxmem.planning.plan import Decision, Plan
from jaxmem.xla.measure import Figures, fmt_bytes

__all__ = ["Basis", "finish", "finish_best", "finish_block_offload", "finish_blocks",
           "finish_plain", "no_fit", "tags_not_applied"]


@dataclasses.dataclass(frozen=True)
class Basis:
    """What every result of one search is written against.

    Attributes:
      model: the search's cost model.
      requested: the budget, bytes.
      plain: the plain step's peak (compiled, or predicted without a compiler).
      base_fig: the plain step's figures, when compiled.
      notes: the notes gathered while searching (the search appends to this list).
      t_start: when the search started (``time.perf_counter()``).
    """

    model: CostModel
    requested: int
    plain: int
    base_fig: Figures | None
    notes: list[str]
    t_start: float


def _elapsed(basis: Basis, compiles: int) -> str:
    return f"{time.perf_counter() - basis.t_start:.1f} s with {compiles} compiles"


def finish(basis: Basis, drop: frozenset[int], off: frozenset[int], strategy: str,
           fig: Figures | None, extra: Sequence[str]) -> Plan:
    """The plan of ``(drop, off)`` with the search's notes and ``extra`` ones."""
    plan = plan_from_sets(basis.model, drop, off, strategy, "budget", basis.requested,
                          notes=[*basis.notes, *extra])
    return plan.with_figures(fig, basis.base_fig)


def finish_plain(basis: Basis) -> Plan:
    """The plain step: its peak already fits the budget."""
    return finish(basis, frozenset(), frozenset(), "budget", basis.base_fig,
                  [f"the plain-jit peak {fmt_bytes(basis.plain)} already fits "
                   f"the budget {fmt_bytes(basis.requested)}: nothing dropped "
                   "(0% overhead)"])


def tags_not_applied(basis: Basis, forced: frozenset[int], peaks: Sequence[int]) -> Plan:
    """The plain step, when it fits but no plan that offloads the ``offload_name`` values
    (``forced``) does; ``peaks``: the peaks of the plans tried."""
    lowest = f"; lowest tried {fmt_bytes(min(peaks))}" if peaks else ""
    return finish(basis, frozenset(), frozenset(), "budget", basis.base_fig, [
        f"no plan that keeps the {len(forced)} jaxmem.offload_name value(s) in "
        f"host memory fits the budget {fmt_bytes(basis.requested)}{lowest}; the "
        f"plain-jit peak "
        f"{fmt_bytes(basis.plain)} fits it, so the plain step runs and the tags are "
        "not applied"])


def finish_best(basis: Basis, best: Candidate, compiles: int) -> Plan:
    """The plan of the search's cheapest fitting candidate."""
    model = basis.model
    ev = model.evaluate(best.drop, best.off)
    fig = best.figures
    summary = (f"planned by {best.source} in {_elapsed(basis, compiles)} (profile "
               f"{model.profile.name}): predicted peak {fmt_bytes(ev.peak)}"
               + (f", compiled peak {fmt_bytes(fig.peak)}" if fig is not None else "")
               + f", predicted extra step time {1e3 * ev.time:.3f} ms"
               + (f" ({1e3 * ev.transfer_time:.3f} ms exposed transfer)"
                  if best.off else ""))
    return finish(basis, best.drop, best.off, f"budget:{best.source.split(' ')[0]}", fig,
                  [summary, *best.notes])


def finish_blocks(basis: Basis, found: Found, compiles: int) -> Plan:
    """The block plan the block fallback found."""
    blk, fig = found.plan, found.figures
    note = (f"planned as blocks (depth {blk.region_depth}) in {_elapsed(basis, compiles)}: "
            "values crossing blocks kept, each block re-run once in the backward pass; "
            f"compiled peak {fmt_bytes(fig.peak)}, predicted recompute "
            f"{100 * blk.recompute_flops / max(blk.baseline_flops, 1):.1f}% FLOPs"
            + ("; its finished gradients left to the compiler's scheduler (unfenced: no "
               "fenced block plan fitted)" if blk.unfenced else ""))
    return dataclasses.replace(blk, strategy="budget:blocks", budget=basis.requested,
                               notes=(*basis.notes, note)).with_figures(fig, basis.base_fig)


def finish_block_offload(basis: Basis, found: Found, compiles: int) -> Plan:
    """The block plan with host offload the last fallback found."""
    blk, fig, model = found.plan, found.figures, basis.model
    parked = sum(c.residual.nbytes for c in blk.of(Decision.OFFLOAD))
    note = (f"planned as blocks (depth {blk.region_depth}) with {len(blk.offload)} "
            f"boundary values ({fmt_bytes(parked)}) in host memory, in "
            f"{_elapsed(basis, compiles)} (profile {model.profile.name}): device peak "
            f"{fmt_bytes(found.device_peak)}, predicted extra step time "
            f"{1e3 * found.time:.3f} ms (exposed transfer "
            f"{1e3 * model.transfer(blk.offload, blk.region_depth):.3f} ms); no plan "
            "without offload fits")
    return dataclasses.replace(
        blk, strategy="budget:blocks+offload", budget=basis.requested,
        notes=(*basis.notes, note, *([found.note] if found.note else ()))
    ).with_figures(fig, basis.base_fig)


def no_fit(basis: Basis, lowest: int, compiles: int, allow_off: bool,
           predicted: tuple[int, str] | None = None) -> BudgetError:
    """The error when no plan fits: the lowest peak reached (``predicted``: a plan ruled
    out by prediction, not compiled, predicted below it: ``(peak, what)``), and what to
    try."""
    reached = (f"the lowest peak jaxmem reached is {fmt_bytes(lowest)}" if predicted is None
               else f"the lowest peak jaxmem predicts is {fmt_bytes(predicted[0])} "
                    f"({predicted[1]}'s rewritten step, not compiled: every plan left was "
                    f"predicted above the budget by more than the model's error; the lowest "
                    f"compiled is {fmt_bytes(lowest)}. Budget(..., search=\"exhaustive\") "
                    "compiles them all)")
    return BudgetError(
        f"no plan fits the budget {fmt_bytes(basis.requested)}: {reached} "
        f"(plain jit: {fmt_bytes(basis.plain)}; {compiles} compile{'s' * (compiles != 1)}). "
        "Try offload=True to park residuals in host memory"
        + (" (already on)" if allow_off else "")
        + ", offload_state=\"auto\" to keep the optimizer state there between steps "
        "where the budget needs it (host memory is used only where asked: pinned memory is "
        "the host's to give)"
        + ", jaxmem.chunked for a bottleneck layer (a wide MLP, an LM head), a smaller "
        "batch, or a larger budget."
        + "".join(f" {n}." for n in basis.notes if " not compiled: " in n),
        basis.requested, lowest if predicted is None else predicted[0],
        minimum_predicted=predicted is not None)
