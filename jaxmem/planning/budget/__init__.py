"""Memory budgets: plan under a peak-memory budget, compile, check, re-plan.

Third box of the data flow (``Analysis -> Plan``) when ``jaxmem.optimize(step, budget=...)``
is given a budget. The budget is the compiled per-device peak, ``argument + output + temp -
alias`` (see :mod:`jaxmem.measure`). It may be

- an ``int``: bytes;
- a string with a unit: ``"6GiB"``, ``"500MB"``, ``"1.5 GB"`` (``KB/MB/GB/TB`` are powers of
  1000, ``KiB/MiB/GiB/TiB`` of 1024, ``B`` bytes);
- a ``float`` in ``(0, 1]``: a fraction of the plain-``jax.jit`` peak (compiled the same way);
- a :class:`Budget`, which also carries the planner's settings (solver, device profile,
  compile limit).

One module per concern:

- :mod:`~jaxmem.planning.budget.units` — :class:`Budget`, :class:`BudgetError`, parsing;
- :mod:`~jaxmem.planning.budget.solvers` — :func:`greedy` (best bytes saved per second of predicted
  extra step time first; heavy outputs too, which reaches segment-style checkpointing) and
  :func:`exact`, the same cost model (:mod:`jaxmem.analyzing.costmodel`) as a MILP (scipy's
  ``milp``,
  HiGHS), used when the program is small enough or ``solver="exact"``;
- :mod:`~jaxmem.planning.budget.search` — :func:`plan_with_budget`: compile in the loop. The plan is
  compiled, XLA's peak is read, and the model's aim is moved by the miss; at most
  ``max_compiles`` compiles. Candidates are monotone: after a plan compiles over the budget,
  every later plan drops a superset of it. The final :class:`~jaxmem.planning.plan.Plan` records the
  predicted and the compiled peaks, and is returned only if its compiled peak fits (so never
  above the plain-jit peak); its ``recompute_flops`` is :func:`jaxmem.planning.plan.recompute_cost`;
- :mod:`~jaxmem.planning.budget.tries`, :mod:`~jaxmem.planning.budget.solving`,
  :mod:`~jaxmem.planning.budget.outcome` — the search's record of what it checked, its
  choice of solver for an aim, and its answer written up;
- :mod:`~jaxmem.planning.budget.fallbacks` — when the model cannot reach the budget: greedy's
  lowest plan, block plans (re-saved), Chen's sqrt(n) segments, block plans with host
  offload. If nothing fits, :class:`BudgetError` says what the lowest peak found was and
  what to try;
- :mod:`~jaxmem.planning.budget.pareto` — :class:`Pareto`, the table :func:`jaxmem.pareto` fills.

Set the environment variable ``JAXMEM_BUDGET_DEBUG=1`` to print one line per compiled
candidate (aim, predicted and compiled peak, sizes of the drop and offload sets).
"""

# Planning pieces the budget builds on, importable from here as before.
from jaxmem.analyzing.costmodel import PROFILES, CostModel, DeviceProfile
from jaxmem.analyzing.tags import OFFLOAD_PREFIX, offload_name, offload_tagged
from jaxmem.planning.budget.pareto import Pareto, ParetoRow
from jaxmem.planning.budget.search import Candidate, plan_with_budget
from jaxmem.planning.budget.solvers import exact, exact_size, greedy
from jaxmem.planning.budget.units import Budget, BudgetError, parse_budget, resolve_budget
from jaxmem.planning.strategies import plan_from_sets, plan_offload, plan_segments

__all__ = [
    "OFFLOAD_PREFIX", "PROFILES", "Budget", "BudgetError", "Candidate", "CostModel",
    "DeviceProfile", "Pareto", "ParetoRow", "exact", "exact_size", "greedy", "offload_name",
    "offload_tagged", "parse_budget", "plan_from_sets", "plan_offload", "plan_segments",
    "plan_with_budget", "resolve_budget",
]
