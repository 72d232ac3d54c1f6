"""Memory budgets: plan under a peak-memory budget, compile, check, re-plan.

``jaxmem.optimize(step, budget=...)`` comes here. The budget is the compiled per-device peak,
``argument + output + temp - alias`` (see :mod:`jaxmem.measure`). It may be

- an ``int``: bytes;
- a string with a unit: ``"6GiB"``, ``"500MB"``, ``"1.5 GB"`` (``KB/MB/GB/TB`` are powers of
  1000, ``KiB/MiB/GiB/TiB`` of 1024, ``B`` bytes);
- a ``float`` in ``(0, 1]``: a fraction of the plain-``jax.jit`` peak (compiled the same way);
- a :class:`Budget`, which also carries the planner's settings (solver, device profile,
  compile limit).

Planning (see :mod:`jaxmem.costmodel` for the model):

1. **greedy** — start from "keep everything"; repeatedly take the decision (recompute or
   offload one value, or a value together with the anchors its chain would newly need) with
   the best bytes saved per second of predicted extra step time; then undo any decision the
   budget no longer needs. Heavy outputs (matmul, conv) are candidates too: dropping them
   makes chains grow through the heavy layer, which is how segment-style (Chen et al.'s
   sqrt(n)) checkpointing is reached when the budget asks for it.
2. **exact** — the same model as a mixed-integer program solved by scipy's ``milp`` (HiGHS),
   with a time limit; used when the program is small enough (or ``solver="exact"``); it falls
   back to greedy, and says so in the plan's notes, when it is too big, times out or fails.

Compile in the loop: the plan is compiled, XLA's peak is read, and if it is over the budget
the model's target is tightened by the miss (if it is well under, loosened, to buy back
FLOPs); at most ``max_compiles`` compiles. The final :class:`~jaxmem.plan.Plan` records the
predicted and the compiled peaks. If nothing fits, :class:`BudgetError` says what the lowest
peak found was and what to try.

The candidates the loop compiles are monotone: after a plan compiles over the budget, every
later (tighter) plan drops a superset of it. When the model cannot reach the target, the
loop tries greedy's lowest-memory plan, then Chen's sqrt(n) segments. A plan is returned only
if its compiled peak is within the budget (so never above the plain-jit peak); a plan's
``recompute_flops`` is :func:`jaxmem.plan.recompute_cost`, the FLOPs the rewrite replays.

Set the environment variable ``JAXMEM_BUDGET_DEBUG=1`` to print one line per compiled
candidate (target, predicted and compiled peak, sizes of the drop and offload sets).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem.analysis import Analysis, liveness, recompute_chain
from jaxmem.costmodel import (
    OFFLOAD_PREFIX,
    PROFILES,
    CostModel,
    DeviceProfile,
    RegionState,
    offload_tagged,
)
from jaxmem.measure import Figures, fmt_bytes
from jaxmem.plan import (
    Choice,
    Decision,
    Plan,
    anchor_residual,
    block_depths,
    block_offload_candidates,
    plan_blocks,
    plan_none,
    recompute_cost,
    resave,
)

_DEBUG = bool(__import__("os").environ.get("JAXMEM_BUDGET_DEBUG"))

__all__ = [
    "PROFILES", "Budget", "BudgetError", "CostModel", "DeviceProfile", "OFFLOAD_PREFIX",
    "offload_tagged",
    "Pareto", "ParetoRow", "greedy", "exact", "offload_name", "pareto", "parse_budget",
    "plan_offload", "plan_segments", "plan_with_budget", "resolve_budget",
]


class BudgetError(ValueError):
    """No plan fits the memory budget.

    Attributes:
      requested_bytes: the budget, in bytes.
      minimum_bytes: the lowest peak jaxmem found (compiled where it could compile), or a
        lower bound such as the arguments' own size.
    """

    def __init__(self, message: str, requested_bytes: int, minimum_bytes: int) -> None:
        super().__init__(message)
        self.requested_bytes = int(requested_bytes)
        self.minimum_bytes = int(minimum_bytes)


# --- parsing ------------------------------------------------------------------------------

_UNITS = {
    "b": 1, "": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Budget:
    """A budget plus the planner's settings, for ``optimize(step, budget=Budget(...))``.

    Attributes:
      value: bytes, a string with a unit, or a fraction in (0, 1] of the plain-jit peak.
      solver: ``"auto"`` (exact when small enough, else greedy), ``"greedy"`` or ``"exact"``.
      profile: a :class:`DeviceProfile` or preset name; ``None`` detects the device.
      max_compiles: compiles the plan/compile/check loop may spend (baseline included).
      time_limit: seconds for the exact solver before it falls back to greedy.
    """

    value: Any
    solver: str = "auto"
    profile: DeviceProfile | str | None = None
    max_compiles: int = 6
    time_limit: float = 10.0

    def __post_init__(self) -> None:
        if self.solver not in ("auto", "greedy", "exact"):
            raise ValueError(f"solver must be 'auto', 'greedy' or 'exact', got {self.solver!r}")
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
        m = _PATTERN.match(budget)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(
                f"cannot parse budget {budget!r}: expected a number with a unit such as "
                "'6GiB', '500MB', '1.5 GB' or '1024' (bytes); units B, KB, MB, GB, TB "
                "(powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)")
        n = float(m.group(1)) * _UNITS[unit]
        if n <= 0:
            raise ValueError(f"budget must be positive, got {budget!r}")
        return "bytes", n
    raise TypeError(f"budget must be int bytes, a string like '6GiB' or a float fraction, "
                    f"got {type(budget).__name__}")


def resolve_budget(budget: Any, plain_peak: int) -> int:
    """The budget in bytes, given the plain-jit peak (for fractions)."""
    kind, x = parse_budget(budget)
    return int(x * plain_peak) if kind == "fraction" else int(x)


# --- offload tagging ----------------------------------------------------------------------

def offload_name(x: Any, name: str) -> Any:
    """Tag ``x`` to be offloaded to host memory between its forward and backward use.

    A thin wrapper over ``jax.ad_checkpoint.checkpoint_name(x, "jaxmem_offload:" + name)``:
    ``jaxmem.optimize`` (and jaxmem's analysis) recognise the reserved prefix and plan the
    tagged value as OFFLOAD whatever the budget. Use it inside the loss/model code.

    Example:
      >>> import jax.numpy as jnp
      >>> h = offload_name(jnp.ones(3), "mlp_hidden")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"offload_name needs a non-empty string name, got {name!r}")
    from jax.ad_checkpoint import checkpoint_name

    return checkpoint_name(x, OFFLOAD_PREFIX + name)


# --- greedy -------------------------------------------------------------------------------

@dataclasses.dataclass
class _State:
    drop: set[int]
    off: set[int]
    regions: dict[int, RegionState]
    aregs: dict[int, frozenset[int]]   # value -> regions whose chains read it as an anchor
    by_last: np.ndarray                # stored bytes by the last region that needs them
    trans: np.ndarray                  # per-region recompute working set
    time: float


class _Greedy:
    def __init__(self, model: CostModel, drop: Iterable[int] = (), off: Iterable[int] = ()):
        self.m = model
        d, o = set(drop), set(off)
        n = max(1, len(model.regions))
        st = {i: model.walk(i, d, o) for i in range(len(model.regions))}
        aregs = {v: frozenset(r) for v, r in model.anchor_regions(st).items()}
        by_last = np.zeros(n, dtype=np.int64)
        trans = np.zeros(n, dtype=np.int64)
        for i, x in st.items():
            trans[i] = x.transient
        self.s = _State(d, o, st, aregs, by_last, trans, sum(x.time for x in st.values()))
        for v in model.activations | set(aregs):
            if self.is_stored(v, d, o, aregs):
                by_last[self.lr(v, aregs)] += model.bytes.get(v, 0)
        self.transfer = model.transfer(o)
        self.evals = 0

    def is_stored(self, v: int, drop: Any, off: Any, aregs: dict) -> bool:
        if v in drop or v in off:
            return False
        return v in self.m.activations or bool(aregs.get(v))

    def lr(self, v: int, aregs: dict) -> int:
        return self.m.last_region(v, aregs.get(v, ()))

    def _peak(self, by_last: np.ndarray, trans: np.ndarray) -> int:
        alive = np.cumsum(by_last[::-1])[::-1]
        return self.m.scale(max(int(alive[0]), int((alive + trans).max())))

    def peak(self) -> int:
        return self._peak(self.s.by_last, self.s.trans)

    def change(self, add_drop: set[int] = frozenset(), add_off: set[int] = frozenset(),
               rm: set[int] = frozenset()) -> tuple:
        """Effect of a change: (new peak, delta time, new state pieces...)."""
        self.evals += 1
        m, s = self.m, self.s
        drop = (s.drop | add_drop) - rm
        off = (s.off | add_off) - rm
        changed = set(add_drop) | set(add_off) | set(rm)
        prods = {m.program.values[v].producer for v in changed}
        aff = [i for i, r in enumerate(m.regions)
               if (r.reads & changed) or (s.regions[i].anchors & changed)
               or (s.regions[i].nodes & prods)]
        new = {i: m.walk(i, drop, off) for i in aff}
        aregs = dict(s.aregs)
        touched = set(changed)
        for i in aff:
            for a in s.regions[i].anchors - new[i].anchors:
                aregs[a] = aregs[a] - {i}
                touched.add(a)
            for a in new[i].anchors - s.regions[i].anchors:
                aregs[a] = aregs.get(a, frozenset()) | {i}
                touched.add(a)
        by_last = s.by_last.copy()
        for v in touched:
            b = m.bytes.get(v, 0)
            if not b:
                continue
            if self.is_stored(v, s.drop, s.off, s.aregs):
                by_last[self.lr(v, s.aregs)] -= b
            if self.is_stored(v, drop, off, aregs):
                by_last[self.lr(v, aregs)] += b
        trans = s.trans.copy()
        for i in aff:
            trans[i] = new[i].transient
        dtime = sum(new[i].time - s.regions[i].time for i in aff)
        tr = self.transfer
        if add_off or (rm & s.off):
            tr = m.transfer(off)
            dtime += tr - self.transfer
        return self._peak(by_last, trans), dtime, new, aregs, by_last, trans, tr

    def apply(self, add_drop: set[int] = frozenset(), add_off: set[int] = frozenset(),
              rm: set[int] = frozenset()) -> None:
        _, dtime, new, aregs, by_last, trans, tr = self.change(add_drop, add_off, rm)
        s = self.s
        s.drop = (s.drop | add_drop) - rm
        s.off = (s.off | add_off) - rm
        s.regions.update(new)
        s.aregs, s.by_last, s.trans = aregs, by_last, trans
        s.time += dtime
        self.transfer = tr

    def moves(self, v: int, kind: str) -> list[tuple[float, set[int], set[int]]]:
        """Scored moves for value v: (score, drop-set, off-set); score = bytes per second."""
        cur = self.peak()
        out = []
        if kind == "d":
            p, dt, new, *_ = self.change({v})
            out.append((cur - p, dt, {v}, set()))
            if p >= cur:
                # the chain newly needs anchors that were not stored: drop them with it
                extra = set()
                for st in new.values():
                    extra |= {a for a in st.anchors if a in self.m.candidates
                              and not self.is_stored(a, self.s.drop, self.s.off, self.s.aregs)}
                if extra:
                    p2, dt2, *_ = self.change({v} | extra)
                    out.append((cur - p2, dt2, {v} | extra, set()))
        else:
            p, dt, *_ = self.change(set(), {v})
            out.append((cur - p, dt, set(), {v}))
        scored = []
        for gain, dt, d, o in out:
            if gain > 0:
                scored.append((gain / (max(dt, 0.0) + 1e-9), d, o))
        return scored

    def run(self, target: int, allow_offload: bool, max_evals: int = 200_000) -> bool:
        m = self.m
        heap: list[tuple[float, int, int, str]] = []
        drops = sorted(m.candidates - self.s.drop - self.s.off)
        offs = sorted(m.offloadable() - self.s.drop - self.s.off) if allow_offload else []
        version = 0
        for kind, vs in (("d", drops), ("o", offs)):
            for v in vs:
                sc = self.moves(v, kind)
                best = max((x[0] for x in sc), default=0.0)
                heapq.heappush(heap, (-best, -1, v, kind))
        while self.peak() > target and heap and self.evals < max_evals:
            _, ver, v, kind = heapq.heappop(heap)
            if v in self.s.drop or v in self.s.off:
                continue
            if ver == version:
                continue  # already re-scored at this state and found useless
            sc = self.moves(v, kind)
            if not sc:
                heapq.heappush(heap, (0.0, version, v, kind))
                continue
            best = max(sc, key=lambda t: t[0])
            if heap and -heap[0][0] > best[0] and heap[0][1] != version:
                heapq.heappush(heap, (-best[0], version, v, kind))
                continue
            self.apply(best[1], best[2])
            version += 1
            # parked zero-score moves get another look after the state changed
            heap = [(sc_, -1 if sc_ == 0.0 else ver_, v_, k_) for sc_, ver_, v_, k_ in heap]
            heapq.heapify(heap)
        return self.peak() <= target

    def improve(self, target: int, max_evals: int = 20_000,
                keep: frozenset[int] = frozenset()) -> None:
        """Undo decisions the budget does not need (seeds and user tags in ``keep`` stay)."""
        changed = True
        while changed and self.evals < max_evals:
            changed = False
            for v in sorted((self.s.drop | self.s.off) - keep, key=lambda x: -x):
                if v not in self.s.drop and v not in self.s.off:
                    continue
                p, dt, *_ = self.change(rm={v})
                if p <= target and dt < 0:
                    self.apply(rm={v})
                    changed = True
                # offload is cheaper than recompute for some values: try swapping
                if v in self.s.drop and v in self.m.offloadable() and self.allow_offload:
                    self.apply(rm={v})
                    p2, dt2, *_ = self.change(set(), {v})
                    if p2 <= target and dt2 < -dt:
                        self.apply(set(), {v})
                        changed = True
                    else:
                        self.apply({v})

    allow_offload = False


def greedy(model: CostModel, target: int, *, allow_offload: bool = False,
           forced_offload: Iterable[int] = (), start: Iterable[int] = ()
           ) -> tuple[frozenset[int], frozenset[int], bool]:
    """Greedy plan under ``target`` predicted peak bytes: ``(drop, offload, fits)``.

    ``start`` seeds the drop set (jaxmem.optimize seeds it with MEDL's auto plan when the
    budget is below the plain-jit peak); the undo pass may give seeds back."""
    forced_offload = frozenset(forced_offload)
    g = _Greedy(model, frozenset(start) & model.candidates - forced_offload, forced_offload)
    g.allow_offload = allow_offload
    fits = g.run(target, allow_offload)
    if fits:
        g.improve(target, keep=forced_offload | frozenset(start))
    return frozenset(g.s.drop), frozenset(g.s.off), fits


# --- exact (MILP) -------------------------------------------------------------------------

def _ancestors(model: CostModel, reads: Iterable[int]) -> set[int]:
    return set(recompute_chain(model.program, reads, lambda v: v in model.fixed_anchor))


def exact_size(model: CostModel) -> int:
    """Number of variables the MILP would have (a measure of its size)."""
    return (sum(len(_ancestors(model, r.reads & model.candidates)) for r in model.regions)
            + len(model.candidates | model.fixed_anchor) * len(model.regions))


def exact(model: CostModel, target: int, *, allow_offload: bool = False,
          forced_offload: Iterable[int] = (), time_limit: float = 10.0
          ) -> tuple[frozenset[int], frozenset[int], str]:
    """Solve the model exactly with scipy's ``milp`` (HiGHS).

    Returns ``(drop, offload, status)`` where status is ``"optimal"``, ``"time limit"``
    (feasible, maybe not optimal), ``"infeasible"`` or another failure string (then the
    sets are empty).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    prog = model.program
    cand = sorted(model.candidates)
    offl = sorted(model.offloadable()) if allow_offload else sorted(
        set(forced_offload) & model.offloadable())
    forced = set(forced_offload)
    storable = sorted(model.candidates | model.fixed_anchor)
    col: dict[tuple, int] = {}

    def var(key: tuple) -> int:
        if key not in col:
            col[key] = len(col)
        return col[key]

    nreg = len(model.regions)
    for v in cand:
        var(("d", v))
    for v in offl:
        var(("o", v))
    for v in storable:
        for i in range(nreg):
            var(("z", v, i))   # v is stored and still needed at region i or later
    e_col = var(("e",))
    anc = [_ancestors(model, r.reads & model.candidates) for r in model.regions]
    for i, nodes in enumerate(anc):
        for n in nodes:
            var(("y", i, n))
    nv = len(col)
    rows: list[tuple[dict[int, float], float, float]] = []

    def keep_terms(u: int, coef: float) -> dict[int, float]:
        t = {}
        if ("d", u) in col:
            t[col[("d", u)]] = coef
        if ("o", u) in col:
            t[col[("o", u)]] = coef
        return t

    for v in offl:
        if ("d", v) in col:
            rows.append(({col[("d", v)]: 1, col[("o", v)]: 1}, -np.inf, 1))
    for v in storable:
        for i in range(nreg - 1):
            rows.append(({col[("z", v, i)]: 1, col[("z", v, i + 1)]: -1}, 0, np.inf))
    # residual activations are stored, up to their last reading region, unless dropped or
    # offloaded
    for v in model.activations:
        if v not in model.bytes or not nreg:
            continue
        t = {col[("z", v, model.last_region(v, ()))]: 1.0}
        t.update(keep_terms(v, 1.0))
        rows.append((t, 1, np.inf))
    for i, r in enumerate(model.regions):
        for v in r.reads & model.candidates:
            p = prog.values[v].producer
            rows.append(({col[("y", i, p)]: 1, col[("d", v)]: -1}, 0, np.inf))
        for n in anc[i]:
            yn = col[("y", i, n)]
            for u in dict.fromkeys(prog.nodes[n].inputs):
                pu = prog.values[u].producer
                if pu is None:
                    continue
                if u in model.fixed_anchor:
                    rows.append(({col[("z", u, i)]: 1, yn: -1}, 0, np.inf))
                    continue
                yp = col[("y", i, pu)]
                if u in model.candidates:
                    t = {yp: 1.0, yn: -1.0}
                    t.update(keep_terms(u, -1.0))
                    rows.append((t, -1, np.inf))        # y_p >= y_n - keep_u
                    t = {col[("z", u, i)]: 1.0, yn: -1.0}
                    t.update(keep_terms(u, 1.0))
                    rows.append((t, 0, np.inf))         # z_u,i >= y_n - d_u - o_u
                else:
                    rows.append(({yp: 1.0, yn: -1.0}, 0, np.inf))
    room = model.unscale(target)
    first_mem_row = len(rows)
    for i, nodes in enumerate(anc):
        t = {col[("z", v, i)]: float(model.bytes.get(v, 0)) for v in storable}
        for n in nodes:
            t[col[("y", i, n)]] = float(model.node_out[n])
        rows.append((t, -np.inf, room))
    last_mem_row = len(rows)
    p = model.profile
    c = np.zeros(nv)
    for key, j in col.items():
        if key[0] == "y":
            c[j] = model.node_time[key[2]]
        elif key[0] == "o":
            b = model.bytes.get(key[1], 0)
            c[j] = max(0.0, p.transfer_time(b) - model.window.get(key[1], 0.0))
    c[e_col] = 1.0
    if offl:
        t = {col[("o", v)]: 2 * p.transfer_time(model.bytes.get(v, 0)) for v in offl}
        t[e_col] = -1.0
        rows.append((t, -np.inf, p.overlap * model.step_time))
    # scale: costs in microseconds, bytes in MiB, for HiGHS' tolerances
    c = c * 1e6
    r_idx, c_idx, vals, lb, ub = [], [], [], [], []
    mem_rows = set(range(first_mem_row, last_mem_row))
    for k, (t, lo, hi) in enumerate(rows):
        scale = 1.0 / 2**20 if k in mem_rows else 1.0
        for j, a in t.items():
            r_idx.append(k)
            c_idx.append(j)
            vals.append(a * scale)
        lb.append(lo * scale if np.isfinite(lo) else lo)
        ub.append(hi * scale if np.isfinite(hi) else hi)
    A = coo_matrix((vals, (r_idx, c_idx)), shape=(len(rows), nv)).tocsr()
    integrality = np.zeros(nv)
    lo_b, hi_b = np.zeros(nv), np.ones(nv)
    for key, j in col.items():
        if key[0] in ("d", "o"):
            integrality[j] = 1
        if key[0] == "o" and key[1] in forced:
            lo_b[j] = 1
        if key[0] == "e":
            hi_b[j] = np.inf
    res = milp(c, constraints=LinearConstraint(A, lb, ub), integrality=integrality,
               bounds=Bounds(lo_b, hi_b), options={"time_limit": float(time_limit),
                                                  "disp": False})
    if res.x is None:
        status = "infeasible" if res.status == 2 else f"failed ({res.message})"
        if res.status == 1:
            status = "time limit"
        return frozenset(), frozenset(), status
    x = res.x
    drop = frozenset(v for v in cand if x[col[("d", v)]] > 0.5)
    off = frozenset(v for v in offl if x[col[("o", v)]] > 0.5)
    return drop, off, "optimal" if res.status == 0 else "time limit"


# --- planning under a budget --------------------------------------------------------------

def make_plan(model: CostModel, drop: Iterable[int], off: Iterable[int], strategy: str,
              why: str, budget: int | None = None, notes: Sequence[str] = ()) -> Plan:
    """A :class:`Plan` from model decisions (anchors that are not residuals included)."""
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
        choices.append(Choice(anchor_residual(model.program, v), d,
                              "anchor of a recompute chain (not read by the backward "
                              "itself): dropped, so its segment is recomputed from earlier "
                              "kept values"))
    return Plan(choices=tuple(choices), strategy=strategy,
                recompute_flops=recompute_cost(model.analysis, drop),
                baseline_flops=model.program.flops, predicted_peak=ev.peak, budget=budget,
                notes=tuple(notes))


def _solve(model: CostModel, target: int, solver: str, allow_offload: bool,
           forced: frozenset[int], time_limit: float, notes: list[str],
           max_exact_vars: int = 6000, start: frozenset[int] = frozenset()
           ) -> tuple[frozenset[int], frozenset[int], bool, str]:
    used = "greedy"
    if solver in ("auto", "exact"):
        size = exact_size(model)
        if size > max_exact_vars and solver == "auto":
            pass
        elif size > 4 * max_exact_vars:
            notes.append(f"exact solver skipped: {size} chain variables is too many; "
                         "used greedy")
        else:
            t0 = time.perf_counter()
            d, o, status = exact(model, target, allow_offload=allow_offload,
                                 forced_offload=forced, time_limit=time_limit)
            dt = time.perf_counter() - t0
            if status == "optimal" or (status == "time limit" and (d or o)):
                ev = model.evaluate(d, o)
                gd, go, gfits = greedy(model, target, allow_offload=allow_offload,
                                       forced_offload=forced, start=start)
                gev = model.evaluate(gd, go)
                if status != "optimal" and gfits and gev.time < ev.time:
                    notes.append(f"exact solver hit its {time_limit:g} s limit; greedy's "
                                 "plan was better and is used")
                    return gd, go, True, "greedy"
                if status != "optimal":
                    notes.append(f"exact solver hit its {time_limit:g} s time limit: "
                                 "best solution found, maybe not optimal")
                return d, o, ev.peak <= target, f"exact ({status}, {dt:.2f} s)"
            if status == "infeasible":
                return frozenset(), frozenset(), False, "exact (infeasible)"
            notes.append(f"exact solver: {status} after {dt:.1f} s; fell back to greedy")
    d, o, fits = greedy(model, target, allow_offload=allow_offload, forced_offload=forced,
                        start=start)
    if allow_offload:
        # offload allowed is a superset of the choices: never return a plan the model says
        # is slower than (or does not fit where) the recompute-only one does
        rd, ro, rfits = greedy(model, target, forced_offload=forced, start=start)
        if rfits and (not fits or model.evaluate(rd, ro).time <= model.evaluate(d, o).time):
            return rd, ro, True, used
    return d, o, fits, used


def _device_peak(model: CostModel, plan: Plan, compiled: Figures) -> tuple[int, str | None]:
    """The device peak to check against the budget, and a note when it is an estimate."""
    if not plan.offload:
        return compiled.peak, None
    if jax.default_backend() not in ("cpu",):
        return compiled.peak, None
    try:
        corr = host_correction(model, plan, donated=compiled.alias > 0)
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


def host_correction(model: CostModel, plan: Plan, donated: bool = False) -> int:
    """Predicted device bytes the offloads free at the peak: the bytes placed in host memory
    that are live at the peak of the rewritten program's liveness. ``donated``: the step was
    compiled with its state donated (outputs alias the inputs of the same shape and dtype).

    An estimate for CPU, where XLA strips host placement: it assumes the compiled peak stays
    where the liveness model puts it. A GPU compile reports the real figure."""
    from jaxmem.program import from_jaxpr
    from jaxmem.rewrite import rewrite

    prog = model.program
    fn = rewrite(prog, plan.recompute, plan.offload, model.residual_ids | plan.keep,
                 region_depth=plan.region_depth)
    avals = [jax.ShapeDtypeStruct(v.shape, v.aval.dtype if v.aval is not None else v.dtype)
             for v in (prog.values[i] for i in prog.inputs)]
    closed = jax.make_jaxpr(fn)(*avals)
    p2 = from_jaxpr(closed)
    donate: list[int] = []
    if donated:
        free = {}
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


def plan_with_budget(analysis: Analysis, budget: Any, *, auto: Plan | None = None,
                     compile_plan: Callable[[Plan], Figures] | None = None,
                     compile_plain: Callable[[], Figures] | None = None,
                     offload: bool | str = False, solver: str | None = None,
                     profile: DeviceProfile | str | None = None,
                     max_compiles: int | None = None, time_limit: float | None = None
                     ) -> Plan:
    """Plan ``analysis`` under ``budget``; compile in the loop when ``compile_plan`` is given.

    Args:
      analysis: the step's :class:`~jaxmem.analysis.Analysis`.
      budget: bytes, ``"6GiB"``, a fraction in (0, 1], or a :class:`Budget`.
      auto: the default (MEDL) plan, used in notes for comparison.
      compile_plan: ``plan -> Figures`` (rewrite, jit and compile the jaxmem way). Without it
        the plan is checked against the model only (and says so).
      compile_plain: ``() -> Figures`` of the user's step under plain ``jax.jit``, compiled
        the same way: what budget fractions and overheads are relative to. Default: the
        rewritten step with nothing dropped (``compile_plan(plan_none(analysis))``), which
        can already be smaller (lean substitutes, narrow masks kept narrow).
      offload: ``False`` (never offload, except values tagged with :func:`offload_name`),
        ``True`` or ``"auto"`` (the planner weighs offload against recompute).
      solver, profile, max_compiles, time_limit: override the :class:`Budget` settings.

    Raises:
      BudgetError: if no plan fits; ``.minimum_bytes`` is the lowest peak found.
    """
    spec = budget if isinstance(budget, Budget) else Budget(budget)
    solver = solver or spec.solver
    max_compiles = max_compiles or spec.max_compiles
    time_limit = spec.time_limit if time_limit is None else time_limit
    t_start = time.perf_counter()
    notes: list[str] = []
    base_plan = plan_none(analysis)
    if compile_plan is not None:
        base_fig = compile_plain() if compile_plain is not None else compile_plan(base_plan)
        plain = base_fig.peak
        compiles = 1
    else:
        base_fig, plain, compiles = None, analysis.peak_bytes, 0
        notes.append("not compiled: budget checked against jaxmem's predicted peak only")
    requested = resolve_budget(spec.value, plain)
    if requested < analysis.argument_bytes:
        raise BudgetError(
            f"budget {fmt_bytes(requested)} is below the arguments' own size "
            f"{fmt_bytes(analysis.argument_bytes)}: the parameters, optimizer state and batch "
            "alone exceed it, before any activation. Shard the state across devices, offload "
            "optimizer state, use a smaller model or batch, or raise the budget.",
            requested, analysis.argument_bytes)
    model = CostModel(analysis, profile or spec.profile, base_peak=plain)
    forced = offload_tagged(analysis)
    allow_off = offload in (True, "auto")

    def finish(drop: frozenset[int], off: frozenset[int], strategy: str,
               fig: Figures | None, extra: Sequence[str]) -> Plan:
        plan = make_plan(model, drop, off, strategy, "budget", requested,
                         notes=[*notes, *extra])
        plan = plan.with_figures(fig, base_fig)
        return plan

    if plain <= requested and not forced:
        return finish(frozenset(), frozenset(), "budget", base_fig,
                      [f"the plain-jit peak {fmt_bytes(plain)} already fits the budget "
                       f"{fmt_bytes(requested)}: nothing dropped (0% overhead)"])

    tried: dict[tuple, tuple[int, Figures | None, str | None]] = {}
    best: tuple[float, frozenset, frozenset, Figures | None, list[str], str] | None = None
    lowest = plain
    target: int | None = requested
    used = "greedy"
    min_tried = seg_tried = blocks_tried = False
    block: tuple[tuple[Plan, Figures] | None, int, int | None] = (None, 0, None)
    points: list[tuple[int, int]] = []
    # Monotone candidates: every plan tried after one that compiled over the budget drops a
    # superset of it (the compiler's peak is not the model's; a tighter plan that gave back
    # drops the last one needed could compile higher). ``floor`` is that drop set.
    floor: frozenset[int] = frozenset()
    if auto is not None and compile_plan is not None and not forced and auto.recompute:
        # MEDL's rule first: nearly free, and often enough
        fig = compile_plan(auto)
        compiles += 1
        lowest = min(lowest, fig.peak)
        ev = model.evaluate(auto.recompute, ())
        tried[(frozenset(auto.recompute), frozenset())] = (fig.peak, fig, None)
        points.append((ev.peak, fig.peak))
        if fig.peak <= requested:
            best = (ev.time, frozenset(auto.recompute), frozenset(), fig, [], "auto (MEDL)")
            target = None
        else:
            floor = frozenset(auto.recompute) & model.candidates
            target = _next_target(points, requested)
    elif auto is not None:
        floor = frozenset(auto.recompute) & model.candidates
    for _ in range(max(1, max_compiles - compiles) + 2):
        if target is None:
            break
        d, o, fits_model, used = _solve(model, target, solver, allow_off, forced, time_limit,
                                        notes, start=floor)
        if not fits_model:
            if min_tried and seg_tried:
                break
            if not min_tried:
                # the model cannot reach target: try the lowest-memory plan once
                d, o, _ = greedy(model, 0, allow_offload=allow_off, forced_offload=forced,
                                 start=floor)
                min_tried = True
                used = "greedy (lowest)"
            elif best is not None:
                break  # a plan already fits; the model cannot find a cheaper one
            elif compile_plan is not None and not forced and not blocks_tried:
                # below what greedy's lowest plan compiles to: block plans next (about one
                # forward pass of FLOPs, fast to compile), segments only if none fits
                blocks_tried = True
                block = _best_block_plan(model, analysis, requested, compile_plan)
                compiles += block[1]
                lowest = min(lowest, block[2] or lowest)
                if block[0] is not None:
                    break
                continue
            else:
                # below what greedy's lowest plan compiles to: Chen's sqrt(n) segments
                d, o = plan_segments(analysis, profile=model.profile).recompute, frozenset()
                seg_tried = True
                used = "segments"
        d = (d | floor) - o
        key = (d, o)
        ev = model.evaluate(d, o)
        if key in tried:
            dev, fig, note = tried[key]
        else:
            plan = make_plan(model, d, o, "budget", "budget")
            if compile_plan is not None and compiles < max_compiles:
                fig = compile_plan(plan)
                compiles += 1
                dev, note = _device_peak(model, plan, fig)
            elif compile_plan is not None:
                break
            else:
                fig, dev, note = None, ev.peak, None
            tried[key] = (dev, fig, note)
        lowest = min(lowest, dev)
        points.append((target, dev))
        if _DEBUG:
            print(f"jaxmem budget loop ({used}): target {fmt_bytes(target)}, predicted "
                  f"{fmt_bytes(ev.peak)}, compiled {fmt_bytes(dev)}, drop {len(d)}, "
                  f"offload {len(o)}")
        if dev <= requested:
            if best is None or ev.time < best[0]:
                best = (ev.time, d, o, fig, [note] if note else [], used)
            if requested - dev < 0.05 * requested or compile_plan is None or used != "greedy":
                break
        else:
            floor = d
            if seg_tried:
                break
        new_target = _next_target(points, requested)
        if new_target == target and fits_model:
            break
        target = new_target
    if (best is None or best[5] == "segments") and compile_plan is not None and not forced \
            and not blocks_tried:
        block = _best_block_plan(model, analysis, requested, compile_plan)
        compiles += block[1]
        lowest = min(lowest, block[2] or lowest)
    if block[0] is not None:
        blk, fig = block[0]
        best_flops = best[3].flops if best is not None and best[3] is not None else None
        if best_flops is None or fig.flops < best_flops:
            note = (f"planned as blocks (depth {blk.region_depth}) in "
                    f"{time.perf_counter() - t_start:.1f} s with {compiles} compiles: values "
                    "crossing blocks kept, each block re-run once in the backward pass; "
                    f"compiled peak {fmt_bytes(fig.peak)}, predicted recompute "
                    f"{100 * blk.recompute_flops / max(blk.baseline_flops, 1):.1f}% FLOPs")
            return dataclasses.replace(blk, strategy="budget:blocks", budget=requested,
                                       notes=(*notes, note)).with_figures(fig, base_fig)
    if best is None and block[0] is None and allow_off and compile_plan is not None \
            and not forced:
        # nothing save+recompute can do fits: park block boundary values in host memory
        found, k, low = _block_offload_plan(model, analysis, requested, compile_plan)
        compiles += k
        lowest = min(lowest, low or lowest)
        if found is not None:
            blk, fig, dev, dev_note, t = found
            parked = sum(c.residual.nbytes for c in blk.of(Decision.OFFLOAD))
            note = (f"planned as blocks (depth {blk.region_depth}) with {len(blk.offload)} "
                    f"boundary values ({fmt_bytes(parked)}) in host memory, in "
                    f"{time.perf_counter() - t_start:.1f} s with {compiles} "
                    f"compiles (profile {model.profile.name}): device peak {fmt_bytes(dev)}, "
                    f"predicted extra step time {1e3 * t:.3f} ms (exposed transfer "
                    f"{1e3 * model.transfer(blk.offload, blk.region_depth):.3f} ms); no plan "
                    "without offload fits")
            return dataclasses.replace(
                blk, strategy="budget:blocks+offload", budget=requested,
                notes=(*notes, note, *([dev_note] if dev_note else ()))
            ).with_figures(fig, base_fig)
    if best is None:
        raise BudgetError(
            f"no plan fits the budget {fmt_bytes(requested)}: the lowest peak jaxmem reached "
            f"is {fmt_bytes(lowest)} (plain jit: {fmt_bytes(plain)}; "
            f"{compiles} compiles). Try offload=True to park residuals in host memory"
            + (" (already on)" if allow_off else "")
            + ", jaxmem.chunked for a bottleneck layer (a wide MLP, an LM head), a smaller "
            "batch, or a larger budget.", requested, lowest)
    _, d, o, fig, extra, used = best
    ev = model.evaluate(d, o)
    summary = (f"planned by {used} in {time.perf_counter() - t_start:.1f} s with {compiles} "
               f"compiles (profile {model.profile.name}): predicted peak {fmt_bytes(ev.peak)}"
               + (f", compiled peak {fmt_bytes(fig.peak)}" if fig is not None else "")
               + f", predicted extra step time {1e3 * ev.time:.3f} ms"
               + (f" ({1e3 * ev.transfer_time:.3f} ms exposed transfer)" if o else ""))
    return finish(d, o, f"budget:{used.split(' ')[0]}", fig, [summary, *extra])


def _best_block_plan(model: CostModel, analysis: Analysis, requested: int,
                     compile_plan: Callable[[Plan], Figures]
                     ) -> tuple[tuple[Plan, Figures] | None, int, int | None]:
    """``jax.checkpoint(nothing_saveable)``-style block plans at every block depth, compiled:
    ``((plan, figures) of the fitting one with the fewest FLOPs or None, compiles, lowest
    compiled peak or None)``."""
    fitting, lowest, n = [], None, 0
    for depth in block_depths(model.program):
        blk = plan_blocks(analysis, depth)
        fig = compile_plan(blk)
        n += 1
        lowest = fig.peak if lowest is None else min(lowest, fig.peak)
        if _DEBUG:
            print(f"jaxmem budget loop (blocks, depth {depth}): compiled "
                  f"{fmt_bytes(fig.peak)}, {fig.flops:.4g} FLOPs")
        if fig.peak <= requested:
            fitting.append((fig.flops, depth, blk, fig))
    if fitting:
        # the block plan with the most headroom keeps some of what it re-creates again
        roomy = min(fitting, key=lambda t: (t[3].peak, t[0]))
        (blk, fig), k = _resaved(analysis, roomy[2], roomy[3], requested, compile_plan)
        n += k
        fitting.append((fig.flops, roomy[1], blk, fig))
    cheapest = min(fitting, key=lambda t: (t[0], t[1]), default=None)
    best = None if cheapest is None else (cheapest[2], cheapest[3])
    return best, n, lowest


def _block_offload_plan(model: CostModel, analysis: Analysis, requested: int,
                        compile_plan: Callable[[Plan], Figures]
                        ) -> tuple[tuple[Plan, Figures, int, str | None, float] | None, int,
                                   int | None]:
    """Block plans at the shallowest block depth with their boundary values offloaded,
    earliest first (the longest windows to hide a round trip in): all of them, then the
    earliest half, quarter, ... while the device peak still fits. Returns ``((plan, figures,
    device peak, device-peak note, predicted extra seconds) or None, compiles, lowest device
    peak or None)``."""
    prog = model.program
    depths = block_depths(prog)
    if not depths:
        return None, 0, None
    depth = depths[0]
    cands = sorted(block_offload_candidates(analysis, depth),
                   key=lambda v: prog.values[v].producer)
    found, n, lowest = None, 0, None
    k = len(cands)
    while k >= 1:
        blk = plan_blocks(analysis, depth, offload=cands[:k])
        fig = compile_plan(blk)
        n += 1
        dev, note = _device_peak(model, blk, fig)
        lowest = dev if lowest is None else min(lowest, dev)
        if _DEBUG:
            print(f"jaxmem budget loop (blocks+offload, depth {depth}, {k} offloaded): "
                  f"device peak {fmt_bytes(dev)}")
        if dev > requested:
            break
        t = (blk.recompute_flops / model.profile.flops_per_s
             + model.transfer(blk.offload, depth))
        found = (blk, fig, dev, note, t)
        k //= 2
    return found, n, lowest


def _resaved(analysis: Analysis, blk: Plan, fig: Figures, requested: int,
             compile_plan: Callable[[Plan], Figures], rounds: int = 4
             ) -> tuple[tuple[Plan, Figures], int]:
    """Spend a fitting block plan's headroom on keeping values again (:func:`resave`),
    compiling each round; a round that compiles over the budget is retried once with half
    the headroom. Returns ``((plan, figures), compiles)``."""
    n = 0
    aim = int(0.98 * requested)
    for _ in range(rounds):
        head = aim - fig.peak
        if head <= 0:
            break
        for h in (head, head // 2):
            cand = resave(analysis, blk, h)
            if cand is blk:
                return (blk, fig), n
            f = compile_plan(cand)
            n += 1
            if _DEBUG:
                print(f"jaxmem budget loop (re-save, {fmt_bytes(h)} headroom): compiled "
                      f"{fmt_bytes(f.peak)}, {f.flops:.4g} FLOPs")
            if f.peak <= requested and f.flops < fig.flops:
                blk, fig = cand, f
                break
        else:
            break
    return (blk, fig), n


def _next_target(points: list[tuple[int, int]], requested: int) -> int:
    """Next model target: a secant step on (model target -> compiled peak) towards the
    budget, aiming 2% under it; slope 1 with one point."""
    aim = 0.98 * requested
    t1, p1 = points[-1]
    slope = 1.0
    others = [(t, p) for t, p in points[:-1] if t != t1]
    if others:
        t0, p0 = min(others, key=lambda tp: abs(tp[1] - aim))
        if p1 != p0:
            slope = float(np.clip((p1 - p0) / (t1 - t0), 0.1, 10.0))
    return int(t1 + (aim - p1) / slope)


def plan_offload(analysis: Analysis, auto: Plan, offload: bool | str = True,
                 profile: DeviceProfile | str | None = None) -> Plan:
    """No budget: the auto plan plus offloads. Values tagged with :func:`offload_name` are
    always offloaded; with ``offload=True`` also every kept residual whose round trip the
    model says hides under compute (largest first)."""
    model = CostModel(analysis, profile)
    drop = set(auto.recompute)
    tagged = set(offload_tagged(analysis))
    drop -= tagged
    off = set(tagged)
    if offload is True:
        st = model.states(drop, off)
        anchors = set().union(*[s.anchors for s in st.values()]) if st else set()
        for v in sorted(model.offloadable() - drop - off - anchors,
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
    plan = make_plan(model, drop, off, "auto+offload", "auto", notes=auto.notes)
    return plan


def plan_segments(analysis: Analysis, segments: int | None = None,
                  profile: DeviceProfile | str | None = None) -> Plan:
    """Chen et al.'s sqrt(n) checkpointing through jaxmem's rewrite: keep every k-th heavy
    output (k = n / segments, default sqrt(n) segments) and recompute everything else."""
    model = CostModel(analysis, profile)
    heavy = sorted((v for v in model.candidates
                    if model.program.nodes[model.program.values[v].producer].kind == "heavy"),
                   key=lambda v: model.program.values[v].producer)
    n = len(heavy)
    segs = segments or max(1, round(math.sqrt(n)))
    k = max(1, math.ceil(n / segs))
    keep = {heavy[i] for i in range(0, n, k)}
    drop = model.candidates - keep
    return make_plan(model, drop, (), f"segments(sqrt(n)={segs})", "segments")


# --- Pareto sweep -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ParetoRow:
    budget: Any
    budget_bytes: int | None
    compiled_peak: int | None
    flops_overhead: float | None     # XLA's count: compiled / plain - 1
    predicted_overhead: float | None  # jaxmem's FLOPs count
    strategy: str
    fits: bool
    minimum_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Pareto:
    """Rows of (budget, compiled peak, FLOPs overhead); print it or ``.plot()`` it."""

    rows: tuple[ParetoRow, ...]
    plain_peak: int
    plain_flops: float

    def __str__(self) -> str:
        lines = [f"plain jit: peak {fmt_bytes(self.plain_peak)}, "
                 f"{self.plain_flops / 1e9:.3f} GFLOP",
                 f"{'budget':>12} {'bytes':>11} {'compiled':>11} {'% plain':>8} "
                 f"{'FLOPs +%':>9} {'strategy':<18}"]
        for r in self.rows:
            if r.fits:
                lines.append(
                    f"{r.budget!s:>12} {fmt_bytes(r.budget_bytes):>11} "
                    f"{fmt_bytes(r.compiled_peak):>11} "
                    f"{100 * r.compiled_peak / self.plain_peak:>7.1f}% "
                    f"{100 * r.flops_overhead:>8.2f}% {r.strategy:<18}")
            else:
                lines.append(f"{r.budget!s:>12} {fmt_bytes(r.budget_bytes or 0):>11} "
                             f"{'no plan':>11} (lowest {fmt_bytes(r.minimum_bytes or 0)})")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Compiled peak (x) against FLOPs overhead (y), one point per budget."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover
            raise ImportError("Pareto.plot needs matplotlib: pip install 'jaxmem[plot]'") from e
        if ax is None:
            _, ax = plt.subplots(figsize=(5, 3.5))
        ok = [r for r in self.rows if r.fits]
        xs = [r.compiled_peak / 2**20 for r in ok]
        ys = [100 * r.flops_overhead for r in ok]
        ax.plot(xs, ys, "o-")
        for r, x, y in zip(ok, xs, ys, strict=True):
            ax.annotate(str(r.budget), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.axvline(self.plain_peak / 2**20, color="C7", ls="--", lw=1)
        ax.set_xlabel("compiled peak (MiB)")
        ax.set_ylabel("FLOPs overhead (%)")
        ax.set_title("jaxmem budget sweep")
        return ax


def pareto(step: Callable[..., Any], *args: Any,
           budgets: Sequence[Any] = (1.0, 0.7, 0.5, 0.35), offload: bool | str = False,
           **optimize_kwargs: Any) -> Pareto:
    """Optimise ``step`` at each budget and tabulate (budget, compiled peak, FLOPs overhead).

    Example:
      >>> sweep = jaxmem.pareto(step, state, batch, budgets=(0.7, 0.5, 0.35))  # doctest: +SKIP
      >>> print(sweep); sweep.plot()                                            # doctest: +SKIP
    """
    from jaxmem.optimized import optimize

    rows = []
    plain_peak, plain_flops = 0, 0.0
    for b in budgets:
        opt = optimize(step, budget=b, offload=offload, **optimize_kwargs)
        try:
            plan = opt.plan(*args)
        except BudgetError as e:
            rows.append(ParetoRow(b, e.requested_bytes, None, None, None, "-", False,
                                  e.minimum_bytes))
            continue
        base, comp = plan.baseline, plan.compiled
        plain_peak, plain_flops = base.peak, base.flops
        rows.append(ParetoRow(
            b, plan.budget, comp.peak,
            comp.flops / base.flops - 1 if base.flops else 0.0, plan.predicted_overhead,
            plan.strategy, True))
    return Pareto(tuple(rows), plain_peak, plain_flops)
