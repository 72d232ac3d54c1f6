"""Budgets as users write them: ``"6GiB"``, ``500_000_000``, ``0.5``, or a :class:`Budget`.

Part of the third box of the data flow (``Analysis -> Plan`` under a budget): what the
budget search (:mod:`jaxmem.planning.budget.search`) plans against, and the error it raises.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxmem.analyzing.costmodel import DeviceProfile
from jaxmem.xla.measure import parse_bytes

__all__ = ["Budget", "BudgetError", "parse_budget", "resolve_budget"]


class TooLargeToCompile(Exception):  # noqa: N818 - a signal to the search, not an error
    """Raised by a budget search's ``compile_plan`` for a plan whose rewrite is too large
    to be worth compiling (its ``note`` says why); the search then moves on as if that plan
    had not fitted, and the note goes into the plan's notes."""

    def __init__(self, note: str) -> None:
        super().__init__(note)
        self.note = note


class BudgetError(ValueError):
    """No plan fits the memory budget.

    Attributes:
      requested_bytes: the budget, in bytes.
      minimum_bytes: the lowest peak jaxmem found (compiled where it could compile), or a
        lower bound such as the arguments' own size.
      minimum_predicted: whether ``minimum_bytes`` is a prediction (a plan's rewritten step
        in the liveness model), not a compiled peak: the ranked search does not compile a
        plan it predicts above the budget by more than the model's error only to report
        how low it goes (``Budget(..., search="exhaustive")`` compiles every plan).
    """

    def __init__(self, message: str, requested_bytes: int, minimum_bytes: int, *,
                 minimum_predicted: bool = False) -> None:
        super().__init__(message)
        self.requested_bytes = int(requested_bytes)
        self.minimum_bytes = int(minimum_bytes)
        self.minimum_predicted = bool(minimum_predicted)

    def again(self, message: str, lowest: int | None = None) -> BudgetError:
        """This error with ``message``, its minimum lowered to ``lowest`` (a compiled
        peak) where that is lower: still a prediction only where it is not."""
        low = self.minimum_bytes if lowest is None else min(int(lowest), self.minimum_bytes)
        return BudgetError(message, self.requested_bytes, low,
                           minimum_predicted=self.minimum_predicted
                           and low == self.minimum_bytes)


@dataclasses.dataclass(frozen=True)
class Budget:
    """A budget plus the planner's settings, for ``optimize(step, budget=Budget(...))``.

    Attributes:
      value: bytes, a string with a unit, or a fraction in (0, 1] of the plain-jit peak.
      solver: ``"auto"`` (exact when small enough, else greedy), ``"greedy"`` or ``"exact"``.
      profile: a :class:`DeviceProfile` or preset name; ``None`` detects the device.
      max_compiles: compiles the plan/compile/check loop may spend (baseline included).
      node_limit: branch-and-bound nodes the exact solver may explore before it falls back
        to greedy (a bound on work, so every process plans the same).
      time_limit: seconds for the exact solver (default none). A wall-clock bound makes the
        plan depend on the machine's speed: processes of one job may then plan differently.
      search: ``"ranked"`` (the default since issue 37): plans the cost model predicts above
        the budget by more than its error (:data:`~jaxmem.planning.budget.fallbacks.PLAN_OVER`)
        are not compiled, and block plans are compiled best-ranked first, stopping at the
        first that fits (:func:`~jaxmem.planning.budget.ranked_blocks.ranked_block_plan`);
        ``"exhaustive"``: MEDL's plan always compiled, and every block plan at every depth
        (:func:`~jaxmem.planning.budget.fallbacks.best_block_plan`), the cheapest that fits
        kept: more compiles, sometimes fewer recompute FLOPs. Either way what runs was
        compiled and fits.
    """

    value: Any
    solver: str = "auto"
    profile: DeviceProfile | str | None = None
    max_compiles: int = 6
    time_limit: float | None = None
    node_limit: int = 5000
    search: str = "ranked"

    def __post_init__(self) -> None:
        if self.solver not in ("auto", "greedy", "exact"):
            raise ValueError(f"solver must be 'auto', 'greedy' or 'exact', got {self.solver!r}")
        if self.search not in ("ranked", "exhaustive"):
            raise ValueError(f"search must be 'ranked' or 'exhaustive', got {self.search!r}")
        if self.max_compiles < 1:
            raise ValueError(f"max_compiles must be >= 1, got {self.max_compiles}")
        parse_budget(self.value)  # fail early on bad input


def parse_budget(budget: Any) -> tuple[str, float]:
    """``("bytes", n)`` or ``("fraction", f)``; raises ``ValueError``/``TypeError`` on bad input.

    Example:
      >>> parse_budget("1.5 GB"), parse_budget("6GiB"), parse_budget(0.5)
      (('bytes', 1500000000.0), ('bytes', 6442450944.0), ('fraction', 0.5))
    """
    if isinstance(budget, Budget):
        return parse_budget(budget.value)
    if isinstance(budget, bool) or budget is None:
        raise TypeError(f"budget must be bytes (int), a string like '6GiB', or a fraction in "
                        f"(0, 1] (float); got {budget!r}")
    if isinstance(budget, int | np.integer):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget} bytes")
        return "bytes", float(budget)
    if isinstance(budget, float | np.floating):
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"budget fraction must be in (0, 1], got {budget}")
        if budget > 1:
            raise ValueError(
                f"budget={budget} is a float above 1. A float is a fraction of the plain-jit "
                f"peak and must be in (0, 1]; for bytes pass an int ({int(budget)}) or a "
                f"string such as '{budget / 2**30:.3g}GiB'.")
        return "fraction", float(budget)
    if isinstance(budget, str):
        text = budget.strip().rstrip("%").strip()
        try:
            bare = float(text)
        except ValueError:
            bare = None
        if bare is not None and (budget.strip().endswith("%") or bare <= 1 or bare != int(bare)):
            # "0.5", "50%", "1e3.5": a fraction or a percentage written as a string; read as
            # bytes it would be a budget of 0 or 1 byte, which no step fits
            raise ValueError(
                f"budget {budget!r} is a string without a byte unit. For a fraction of the "
                "plain-jit peak pass a float (budget=0.5); for bytes pass an int or a string "
                "with a unit ('500MB', '6GiB').")
        n = parse_bytes(budget, what="budget")
        return "bytes", float(n)
    raise TypeError(f"budget must be int bytes, a string like '6GiB' or a float fraction, "
                    f"got {type(budget).__name__}")


def resolve_budget(budget: Any, plain_peak: int) -> int:
    """The budget in bytes, given the plain-jit peak (for fractions).

    Example:
      >>> resolve_budget(0.5, 1000), resolve_budget("1KiB", 10)
      (500, 1024)
    """
    kind, x = parse_budget(budget)
    return int(x * plain_peak) if kind == "fraction" else int(x)
