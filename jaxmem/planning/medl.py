"""MEDL's rule and the plans that apply it a layer at a time (third box of the data flow,
``Analysis -> Plan``).

The one home of the rule for what gets recomputed. :func:`medl_keeps` is MEDL's rule: keep
the outputs of heavy layers (matmuls, convolutions), recompute the outputs of utility layers
(activations, normalisation, dropout, adds, pooling, concatenation). Every applier asks it:
:func:`plan_auto` for a train step, :func:`jaxmem.checkpoint` for a function differentiated
later, and the ``jax.checkpoint`` policy :func:`jaxmem.policies.utility` (through
:func:`medl_keeps_primitive`, since a policy sees primitives, not nodes).

- :func:`plan_none` — keep everything (plain ``jax.jit``): the baseline.
- :func:`plan_auto` — MEDL's rule made cost-aware: a utility output is kept after all when
  recomputing it costs more than ``max_layer_fraction`` of its layer's heavy FLOPs, when all
  recompute together would pass ``max_recompute_fraction`` of the step, or when its chain
  would keep alive more bytes of anchors than it frees (the ``_cap_*`` helpers, one per
  reason).

Re-exported by :mod:`jaxmem.planning.strategies`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from jaxmem.analyzing import chains
from jaxmem.analyzing.analysis import Analysis, Residual
from jaxmem.planning.plan import Choice, Decision, Plan, recompute_cost
from jaxmem.tracing.primitives import CHEAP, Kind, classify
from jaxmem.xla.measure import fmt_bytes

__all__ = ["medl_keeps", "medl_keeps_primitive", "plan_auto", "plan_none"]


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
