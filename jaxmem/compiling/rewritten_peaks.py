"""Each candidate's rewritten step built once and sized, and the peak the liveness model
predicts for it: what ``verify=True`` (:mod:`.predicted`) ranks candidates by beside the
cost model. Part of the fifth box (:mod:`jaxmem.compiling`)."""

from __future__ import annotations

from typing import Any

from jaxmem.compiling import choose
from jaxmem.compiling.choose import Candidate
from jaxmem.compiling.steps import Step, growth_limit, within_growth

__all__ = ["RewrittenPeaks"]


class RewrittenPeaks:
    """Each candidate's rewritten step, built when first asked for
    (:func:`.choose.rewritten_program`: without tracing it): whether it is too large to
    compile (:func:`.choose.rewrite_size`; :attr:`skipped` says why), and the peak
    the liveness model predicts for it (:func:`.choose.rewritten_peak`; None for one too
    large, or that cannot be built or traced here). Only the figures are kept, and a
    program sized until its peak is read."""

    def __init__(self, cands: list[Candidate], step: Step, platform: str):
        self.cands, self.step, self.platform = cands, step, platform
        self.sizes: dict[int, str | None] = {}
        self._growth: dict[int, float] = {}   # equations over the step's, where built
        self.known: dict[int, int | None] = {}
        self.skipped: list[str] = []
        self._held: dict[int, Any] = {}   # programs sized whose peak is not read yet

    def _build(self, i: int) -> tuple[Any, str | None, float]:
        """Candidate ``i``'s rewritten program (None where it cannot be built or traced
        here), why it is too large to compile (None where it is not), and its equations
        over the step's. A rewrite is built only up to
        :func:`~jaxmem.compiling.steps.growth_limit` nodes: past it, it is too large
        whatever its size (MEDL's unregioned plan of GPT-2 small is 4.7x the step; built in
        full, 2.1 s)."""
        of = len(self.step.program.nodes)
        try:
            program, why = within_growth(
                lambda limit: choose.rewritten_program(self.cands[i], self.step, limit), of)
        except Exception:  # noqa: BLE001 - not ranked; compiled as before (it says why)
            return None, None, 0.0
        if program is None:   # not built past the limit
            return None, why, growth_limit(of) / max(of, 1)
        return (program, *choose.rewrite_size(self.cands[i], self.step, program))

    def growth(self, i: int) -> float:
        """Candidate ``i``'s rewritten program's equations over the step's (0.0 where it
        cannot be built here)."""
        self.too_large(i)
        return self._growth.get(i, 0.0)

    def too_large(self, i: int) -> bool:
        if i not in self.sizes:
            program, why, self._growth[i] = self._build(i)
            if why is not None:
                self.skipped.append(f"{self.cands[i].plan.strategy}: {why}")
            else:   # held until its peak is read (never analysed where too large)
                self._held[i] = program
            self.sizes[i] = why
        return self.sizes[i] is not None

    def __call__(self, i: int) -> int | None:
        if i not in self.known:
            program = None if self.too_large(i) else self._held.pop(i)   # not held after
            self.known[i] = None if program is None else choose.rewritten_peak(
                self.cands[i], self.step, self.platform, program)
        return self.known[i]
