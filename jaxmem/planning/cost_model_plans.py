"""Plans decided through the cost model (third box of the data flow, ``Analysis -> Plan``).

- :func:`plan_segments` — Chen et al.'s sqrt(n) checkpointing: keep every k-th heavy output;
- :func:`plan_offload` — the auto plan plus host offload of values whose round trip hides
  under compute (and of values tagged with :func:`jaxmem.offload_name`);
- :func:`plan_from_sets` — a :class:`~jaxmem.planning.plan.Plan` from the sets of values to
  recompute and to offload, with the cost model's predicted peak: how these two and the
  budget solvers (:mod:`jaxmem.planning.budget`) turn their choices into a plan.

Re-exported by :mod:`jaxmem.planning.strategies`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.costmodel import CostModel, DeviceProfile
from jaxmem.analyzing.tags import offload_tagged
from jaxmem.planning.anchors import anchor_record
from jaxmem.planning.plan import Choice, Decision, Plan, recompute_cost
from jaxmem.tracing.primitives import Kind

__all__ = ["plan_from_sets", "plan_offload", "plan_segments"]


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
        choices.append(Choice(anchor_record(model.program, v), d,
                              "anchor of a recompute chain (not read by the backward "
                              "itself): dropped, so its segment is recomputed from earlier "
                              "kept values"))
    return Plan(choices=tuple(choices), strategy=strategy,
                recompute_flops=recompute_cost(model.analysis, drop),
                baseline_flops=model.program.flops, predicted_peak=ev.peak, budget=budget,
                notes=tuple(notes))
