"""Offload checked: a host memory kind to offload to, and the device peak it gives.

Part of the fifth box (:mod:`jaxmem.compiling`). :func:`check_offload` makes sure the target
has a ``pinned_host`` memory kind when offload is asked for, and warns about
``offload_name`` tags the joint rewrite cannot reach (inside control flow). ``verify`` for a
plan that offloads (:func:`verified_offload`) compiles it beside the same offloads without
recompute and keeps the lower device peak, never above the plain step's. The device peak is
XLA's compiled peak, except on CPU, where XLA strips host placement: there
:func:`device_peak` subtracts what :func:`host_correction` predicts is in host memory at the
peak (the budget search reads it the same way, :mod:`jaxmem.planning.budget.search`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxmem import _jax
from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.liveness import liveness
from jaxmem.analyzing.tags import offload_tagged, offload_tags_out_of_reach
from jaxmem.compiling.signature import device_of
from jaxmem.compiling.steps import Step, read
from jaxmem.planning import strategies
from jaxmem.planning.plan import Decision, Plan
from jaxmem.rewriting.rewrite import apply
from jaxmem.tracing.program import Program, from_jaxpr
from jaxmem.xla import measure
from jaxmem.xla.measure import Figures, fmt_bytes


def check_offload(analysis: Analysis, flat: Sequence[Any], platform: str,
                  offload: bool | str) -> None:
    """Offload needs a host memory kind; tags the rewrite cannot reach are reported."""
    far = offload_tags_out_of_reach(analysis)
    wanted = offload in (True, "auto") or offload_tagged(analysis)
    if wanted and "pinned_host" not in (kinds := _jax.memory_kinds(device_of(flat))):
        raise ValueError(
            f"jaxmem.optimize: offload needs a 'pinned_host' memory kind, but the "
            f"{platform} device has {sorted(kinds) or 'none'}; pass "
            "offload=False (and remove jaxmem.offload_name tags), or run on a backend "
            "with host memory (GPU, TPU, CPU)")
    for tag, unit, layer in far:
        warnings.warn(
            f"jaxmem.optimize: offload_name({tag!r}) is inside a {unit} "
            f"(layer {layer or '<top>'}); the joint rewrite keeps control flow whole, so "
            "that value was kept on the device. To offload inside a loop body, wrap the "
            "body in jaxmem.checkpoint(body, budget=..., offload=True).", stacklevel=6)


def verified_offload(plan: Plan, analysis: Analysis, step: Step,
                     offload: bool | str) -> tuple[Plan, Any]:
    """``verify`` for a plan that offloads (``offload=True`` or ``offload_name`` tags, no
    budget): compile it and the same offloads without recompute, keep the lower device
    peak (:func:`device_peak`: XLA's, or on CPU the estimate without host-resident
    bytes); if neither is below the plain step's compiled peak, keep the plain step with
    a warning and a note, as :func:`jaxmem.compiling.choose.verified` does."""
    flat = step.flat
    base_exe = measure.compile(step.plain.lower(*flat))
    base = read(base_exe, step.plain, flat)
    only = strategies.plan_offload(analysis, strategies.plan_none(analysis), offload=offload)
    variants = [plan] + ([dataclasses.replace(only, donated=plan.donated)]
                         if only.offload and set(only.offload) != set(plan.offload) or
                         plan.recompute else [])
    best = None
    for p in variants:
        jitted = step.rewrite(p)
        exe = measure.compile(jitted.lower(*flat))
        fig = read(exe, jitted, flat)
        peak, why = device_peak(analysis.program, p, fig, step.platform)
        if best is None or (peak, fig.flops) < (best[0], best[2].flops):
            best = (peak, p, fig, exe, why)
    peak, best_plan, fig, exe, why = best
    if peak <= base.peak:
        notes = best_plan.notes + ((why,) if why else ())
        return dataclasses.replace(best_plan, notes=notes).with_figures(fig, base), exe
    note = (f"the {plan.strategy!r} plan's device peak {fmt_bytes(peak)} is not below the "
            f"plain step's {fmt_bytes(base.peak)}: kept the plain step, nothing offloaded "
            "(pass verify=False to force the plan, or try a budget)")
    warnings.warn(f"jaxmem.optimize: {note}", stacklevel=6)
    none = dataclasses.replace(strategies.plan_none(analysis), donated=plan.donated)
    return dataclasses.replace(none, notes=plan.notes + (note,), compiled=base,
                               baseline=base), base_exe


def device_peak(program: Program, plan: Plan, compiled: Figures,
                platform: str | None = None) -> tuple[int, str | None]:
    """The device peak to check a budget against, and a note when it is an estimate.

    XLA's compiled peak, except for a plan that offloads compiled on CPU: XLA:CPU strips
    host placement, so its peak still counts the offloaded values on the device; the
    estimate subtracts what :func:`host_correction` says is in host memory at the peak.
    """
    if not plan.offload or (platform or jax.default_backend()) != "cpu":
        return compiled.peak, None
    try:
        corr = host_correction(program, plan, donated=compiled.alias > 0)
    except Exception as e:  # noqa: BLE001 - an estimate: fall back to the offloaded bytes
        corr = sum(c.residual.nbytes for c in plan.of(Decision.OFFLOAD))
        why = f"(rewritten program not analysable: {type(e).__name__}; used offloaded bytes)"
    else:
        why = "(host-resident bytes at the rewritten program's predicted peak)"
    est = max(compiled.peak - corr, 0)
    return est, (f"CPU compile strips host placement, so XLA's compiled peak "
                 f"{fmt_bytes(compiled.peak)} still counts the offloaded residuals on the "
                 f"device; the budget was checked against the predicted device peak "
                 f"{fmt_bytes(est)} = compiled - {fmt_bytes(corr)} {why}. On a GPU the "
                 f"compiled peak itself drops")


def host_correction(program: Program, plan: Plan, donated: bool = False) -> int:
    """Predicted device bytes the offloads free at the peak: the bytes placed in host memory
    that are live at the peak of the rewritten program's liveness. ``donated``: the step was
    compiled with its state donated (outputs alias the inputs of the same shape and dtype).

    An estimate for CPU, where XLA strips host placement: it assumes the compiled peak stays
    where the liveness model puts it. A GPU compile reports the real figure."""
    avals = [jax.ShapeDtypeStruct(v.shape, v.aval.dtype if v.aval is not None else v.dtype)
             for v in (program.values[i] for i in program.inputs)]
    p2 = from_jaxpr(jax.make_jaxpr(apply(program, plan))(*avals))
    donate: list[int] = []
    if donated:
        free: dict[tuple, list[int]] = {}
        for k, i in enumerate(p2.inputs):
            v = p2.values[i]
            free.setdefault((v.shape, str(v.dtype)), []).append(k)
        for o in p2.outputs:
            v = p2.values[o]
            if v.producer is not None and free.get((v.shape, str(v.dtype))):
                donate.append(free[(v.shape, str(v.dtype))].pop())
    # The host-resident bytes at the rewritten program's own peak (where XLA's compiled
    # peak is taken to be): what the device does not hold there.
    _, with_host, _ = liveness(p2, donated=donate)
    _, device, _ = liveness(p2, donated=donate, device_only=True)
    if not with_host:
        return 0
    i = int(np.argmax(with_host))
    return max(0, with_host[i] - device[i])
