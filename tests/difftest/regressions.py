"""Generated programs that once broke a promise, shrunk (:mod:`.shrink`) and kept.

Each entry: ``(case, strategy, what broke)``. ``tests/test_differential.py`` runs every one
under its strategy; an entry whose bug is not fixed yet is listed in :data:`KNOWN` with why.
"""

from __future__ import annotations

from tests.difftest.generator import Case, Op

CASES: list[tuple[Case, str, str]] = [
    # The loss reads no parameter (no backward pass to plan): optimize(step, budget=B)
    # returned the plain step, compiled above B, instead of raising BudgetError.
    (Case(seed=7, ops=(Op("dense_act", 3), Op("layernorm", 0)), update="sgd",
          detached=True), "budget", "no backward pass: budget ignored"),
]

#: index in CASES -> reason, for entries still failing (run as xfail(strict=True)).
KNOWN: dict[int, str] = {}
