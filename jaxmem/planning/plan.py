"""The :class:`Plan`: for each residual, SAVE it, RECOMPUTE it in the backward pass, or
OFFLOAD it.

The value the third box of the data flow makes (``Analysis -> Plan``; the strategies that
make one are in :mod:`jaxmem.planning.strategies` and :mod:`jaxmem.planning.budget`). A
:class:`Plan` is a
plain, printable, immutable value; it says what it decided for every residual and why, what
it predicts (peak, FLOPs overhead) and, once compiled, what XLA measured.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from jaxmem.analyzing.analysis import Analysis, Residual
from jaxmem.analyzing.chains import chain_start, replay_flops
from jaxmem.xla.measure import Figures, fmt_bytes


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
    # Block plans (jaxmem.planning.strategies.plan_blocks): the depth of the layer paths that makes
    # one backward region per block.
    region_depth: int | None = None
    # Values the rewrite keeps though the backward does not read them (a block plan's
    # boundary values): recompute chains start from them.
    keep: frozenset[int] = frozenset()
    # The optimizer state kept in host memory (jaxmem.memory.state_offload.StateOffload), if any.
    state_offload: Any = None
    # Plans of bodies planned as steps of their own (gradient-accumulation loops, shard_map
    # bodies), in program order: part of what the step runs.
    inner: tuple[Plan, ...] = ()
    # The step runs as traced with each loss differentiated under
    # jax.checkpoint(policy=jax.checkpoint_policies.<loss_policy>) (optimize's candidate of
    # the built-in policy itself, jaxmem._jax.checkpointed_losses); nothing is rewritten.
    loss_policy: str | None = None
    # With loss_policy: each block of the loss under its own jax.checkpoint (blocks from the
    # name stack, jaxmem.rewriting.blockwise), as nn.remat around every block does.
    loss_blocks: bool = False
    # The rewrite leaves the gradients finished in each backward run where the compiler's
    # scheduler puts them (no fence, jaxmem.rewriting.settle.fence_finished): the budget's
    # block fallback's last try on an accelerator (on XLA:CPU the fence changes nothing).
    unfenced: bool = False
    # What the plan's recompute and offload are predicted to add to the step's time on the
    # step's device profile (jaxmem.planning.costs.StepCosts), for the printout.
    costs: Any = None

    def fingerprint(self) -> str:
        """A stable hash of what the plan makes the step do: each residual's decision (by
        value id and size), the region depth, the values kept, the state held in host memory
        and the inner bodies' plans. Notes, timings and figures are left out: two processes
        that trace the same program and plan alike get the same fingerprint.

        Example:
          >>> import jax, jax.numpy as jnp, jaxmem
          >>> step = jax.value_and_grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
          >>> args = jnp.ones((8, 8)), jnp.ones((4, 8))
          >>> a = jaxmem.analyze(step, *args)
          >>> from jaxmem.planning.strategies import plan_auto
          >>> plan_auto(a).fingerprint() == plan_auto(a).fingerprint()
          True
        """
        import hashlib

        so = self.state_offload
        parts = (tuple((c.residual.value, c.residual.nbytes, c.decision.value)
                       for c in self.choices),
                 self.region_depth, tuple(sorted(self.keep)),
                 None if so is None else (tuple(so.inputs), tuple(so.outputs)),
                 tuple(p.fingerprint() for p in self.inner), self.loss_policy) + (
                    ("loss_blocks",) if self.loss_blocks else ()) + (
                    ("unfenced",) if self.unfenced else ())
        return hashlib.sha256(repr(parts).encode()).hexdigest()

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
        if self.costs is not None:
            lines.append(f"  {self.costs.describe()}")
        if self.predicted_peak is not None:
            lines.append(f"  predicted peak: {fmt_bytes(self.predicted_peak)}")
        if self.baseline is not None:
            lines.append(f"  plain jit (compiled): {self.baseline}")
        if self.compiled is not None:
            lines.append(f"  jaxmem    (compiled): {self.compiled}")
            if self.saved_fraction is not None and self.baseline is not None:
                extra = (self.compiled.flops / self.baseline.flops - 1
                         if self.baseline.flops else 0.0)
                who = ("jaxmem's count" if "jaxmem" in (self.compiled.flops_source,
                                                          self.baseline.flops_source)
                       else "XLA's count")
                lines.append(f"  saved {100 * self.saved_fraction:.1f}% of the peak for "
                             f"{100 * extra:+.2f}% FLOPs ({who})")
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


def recompute_cost(analysis: Analysis, dropped: Iterable[int],
                   region_depth: int | None = None, keep: Iterable[int] = ()) -> float:
    """FLOPs the rewrite spends re-creating ``dropped`` values, exactly as it replays them.

    Chains start from kept values (inputs, heavy outputs, residuals not dropped, ``keep``),
    so they grow when neighbours are dropped too; each backward region (a run of backward
    nodes of one layer, or of one block at ``region_depth``) re-creates what it reads once,
    and a later region pays again (:mod:`jaxmem.analyzing.chains`).
    """
    prog = analysis.program
    dropped = frozenset(dropped)
    kept = frozenset(r.value for r in analysis.residuals) | frozenset(keep)
    return replay_flops(prog, dropped, chain_start(prog, dropped=dropped, kept=kept),
                        region_depth)
