"""Generated programs that once broke a promise, shrunk (:mod:`.shrink`) and kept.

Each entry: ``(case, strategy, what broke, check's keyword arguments)``; a case keeps the
batch it failed at. ``tests/test_differential.py`` runs every one
under its strategy; an entry whose bug is not fixed yet is listed in :data:`KNOWN` with why.
"""

from __future__ import annotations

from tests.difftest.generator import Case, Op

CASES: list[tuple[Case, str, str, dict]] = [
    # The loss reads no parameter (no backward pass to plan): optimize(step, budget=B)
    # returned the plain step, compiled above B, instead of raising BudgetError.
    (Case(seed=7, ops=(Op("dense_act", 3), Op("layernorm", 0)), update="sgd",
          detached=True, batch=4), "budget", "no backward pass: budget ignored",
     {"fraction": 0.7, "of_headroom": False}),
    # An offload_name tag (no budget) sent the plan down a path verify skipped: the
    # auto+offload plan compiled to 3316 B against plain jit's 3100 B, without a note.
    (Case(seed=1, ops=(Op("dense_act", 1), Op("offload_name", 0), Op("dense_act", 2)),
          batch=4), "auto", "offload_name tag: unverified plan above plain", {}),
    # The same with offload=True: 3708 B against 3100 B.
    (Case(seed=1, ops=(Op("dense_act", 1), Op("offload_name", 0), Op("dense_act", 2)),
          batch=4), "offload", "offload=True: unverified plan above plain", {}),
    # An offload_name tag and a budget the plain step fits (budget=1.0 of plain): every plan
    # honouring the tag compiled above the budget (9.93 KiB against 9.78 KiB), and the search
    # raised BudgetError although its own minimum, the plain step, fits (long run, seed
    # 2002465; also seeds 2001952-2001985 packed).
    (Case(seed=2002465, ops=(Op("batched_dot", 18), Op("offload_name", 49)), update="adam"),
     "budget_frac", "offload_name tag: BudgetError where the plain step fits",
     {"fraction": 1.0}),
]

#: index in CASES -> reason, for entries still failing (run as xfail(strict=True)).
KNOWN: dict[int, str] = {}
