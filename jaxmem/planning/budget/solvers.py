"""The budget solvers: a plan whose predicted peak is at most a limit, for the least
predicted extra step time.

Part of the third box of the data flow (``Analysis -> Plan`` under a budget). Both solve the
same cost model (:mod:`jaxmem.analyzing.costmodel`); :mod:`jaxmem.planning.budget.search` picks one.

- :func:`greedy` starts from "keep everything" (or a seed such as MEDL's plan) and
  repeatedly takes the decision — recompute or offload one value, or a value together with
  the chain starts its chain would newly need — with the best bytes saved per second of
  predicted extra step time, until the predicted peak is within the limit; then it undoes
  any decision the limit no longer needs. Heavy outputs (matmul, conv) are candidates too:
  dropping them makes chains grow through the heavy layer, which is how segment-style
  (Chen et al.'s sqrt(n)) checkpointing is reached when the budget asks for it.
- :func:`exact` writes the model as a mixed-integer program solved by scipy's ``milp``
  (HiGHS) with a time limit. Variables: ``d_v`` (drop v), ``o_v`` (offload v), ``z_v,i``
  (v is stored and still needed at region i or later), ``y_i,n`` (region i replays node n)
  and ``e`` (exposed transfer time).
"""

from __future__ import annotations

import dataclasses
import heapq
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxmem.analyzing import chains
from jaxmem.analyzing.costmodel import CostModel, RegionState

__all__ = ["exact", "exact_size", "greedy"]


# --- greedy ---------------------------------------------------------------------------------

@dataclasses.dataclass
class _State:
    drop: set[int]
    off: set[int]
    regions: dict[int, RegionState]
    sregs: dict[int, frozenset[int]]   # value -> regions whose chains start from it
    by_last: np.ndarray                # stored bytes by the last region that needs them
    trans: np.ndarray                  # per-region recompute working set
    time: float


@dataclasses.dataclass(frozen=True)
class _Change:
    """The effect of a change of the decision sets, before it is applied."""

    peak: int
    dtime: float
    regions: dict[int, RegionState]
    sregs: dict[int, frozenset[int]]
    by_last: np.ndarray
    trans: np.ndarray
    transfer: float


class _Greedy:
    def __init__(self, model: CostModel, drop: Iterable[int] = (), off: Iterable[int] = (),
                 allow_offload: bool = False) -> None:
        self.m = model
        self.allow_offload = allow_offload
        d, o = set(drop), set(off)
        n = max(1, len(model.regions))
        st = {i: model.walk(i, d, o) for i in range(len(model.regions))}
        sregs = {v: frozenset(r) for v, r in model.start_regions(st).items()}
        by_last = np.zeros(n, dtype=np.int64)
        trans = np.zeros(n, dtype=np.int64)
        for i, x in st.items():
            trans[i] = x.transient
        self.s = _State(d, o, st, sregs, by_last, trans, sum(x.time for x in st.values()))
        for v in model.activations | set(sregs):
            if self.is_stored(v, d, o, sregs):
                by_last[self.lr(v, sregs)] += model.bytes.get(v, 0)
        self.transfer = model.transfer(o)
        self.evals = 0
        self.heap: list[tuple[float, int, int, str]] | None = None   # run()'s, once scored
        self.version = 0

    def is_stored(self, v: int, drop: Any, off: Any, sregs: dict) -> bool:
        if v in drop or v in off:
            return False
        return v in self.m.activations or bool(sregs.get(v))

    def lr(self, v: int, sregs: dict) -> int:
        return self.m.last_region(v, sregs.get(v, ()))

    def _peak(self, by_last: np.ndarray, trans: np.ndarray) -> int:
        alive = np.cumsum(by_last[::-1])[::-1]
        return self.m.scale(max(int(alive[0]), int((alive + trans).max())))

    def peak(self) -> int:
        return self._peak(self.s.by_last, self.s.trans)

    def change(self, add_drop: set[int] = frozenset(), add_off: set[int] = frozenset(),
               rm: set[int] = frozenset()) -> _Change:
        """The effect of dropping ``add_drop``, offloading ``add_off`` and keeping ``rm``."""
        self.evals += 1
        m, s = self.m, self.s
        drop = (s.drop | add_drop) - rm
        off = (s.off | add_off) - rm
        changed = set(add_drop) | set(add_off) | set(rm)
        prods = {m.program.values[v].producer for v in changed}
        aff = [i for i, r in enumerate(m.regions)
               if (r.reads & changed) or (s.regions[i].starts & changed)
               or (s.regions[i].nodes & prods)]
        new = {i: m.walk(i, drop, off) for i in aff}
        sregs = dict(s.sregs)
        touched = set(changed)
        for i in aff:
            for a in s.regions[i].starts - new[i].starts:
                sregs[a] = sregs[a] - {i}
                touched.add(a)
            for a in new[i].starts - s.regions[i].starts:
                sregs[a] = sregs.get(a, frozenset()) | {i}
                touched.add(a)
        by_last = s.by_last.copy()
        for v in touched:
            b = m.bytes.get(v, 0)
            if not b:
                continue
            if self.is_stored(v, s.drop, s.off, s.sregs):
                by_last[self.lr(v, s.sregs)] -= b
            if self.is_stored(v, drop, off, sregs):
                by_last[self.lr(v, sregs)] += b
        trans = s.trans.copy()
        for i in aff:
            trans[i] = new[i].transient
        dtime = sum(new[i].time - s.regions[i].time for i in aff)
        tr = self.transfer
        if add_off or (rm & s.off):
            tr = m.transfer(off)
            dtime += tr - self.transfer
        return _Change(self._peak(by_last, trans), dtime, new, sregs, by_last, trans, tr)

    def apply(self, add_drop: set[int] = frozenset(), add_off: set[int] = frozenset(),
              rm: set[int] = frozenset()) -> None:
        c = self.change(add_drop, add_off, rm)
        s = self.s
        s.drop = (s.drop | add_drop) - rm
        s.off = (s.off | add_off) - rm
        s.regions.update(c.regions)
        s.sregs, s.by_last, s.trans = c.sregs, c.by_last, c.trans
        s.time += c.dtime
        self.transfer = c.transfer

    def moves(self, v: int, kind: str) -> list[tuple[float, set[int], set[int]]]:
        """Scored moves for value v: (score, drop-set, off-set); score = bytes per second."""
        cur = self.peak()
        out = []
        if kind == "d":
            c = self.change({v})
            out.append((cur - c.peak, c.dtime, {v}, set()))
            if c.peak >= cur:
                # the chain newly starts from values that were not stored: drop them with it
                extra = set()
                for st in c.regions.values():
                    extra |= {a for a in st.starts if a in self.m.candidates
                              and not self.is_stored(a, self.s.drop, self.s.off, self.s.sregs)}
                if extra:
                    c2 = self.change({v} | extra)
                    out.append((cur - c2.peak, c2.dtime, {v} | extra, set()))
        else:
            c = self.change(set(), {v})
            out.append((cur - c.peak, c.dtime, set(), {v}))
        return [(gain / (max(dt, 0.0) + 1e-9), d, o) for gain, dt, d, o in out if gain > 0]

    def run(self, limit: int, max_evals: int = 200_000,
            taken: list[tuple[set[int], set[int], int, int]] | None = None) -> bool:
        """Take the best-scored moves until the predicted peak is within ``limit`` (or no
        move helps, or ``max_evals``); resumable: a later call with a lower limit goes on
        from here. ``taken``: each move applied is appended as ``(drop, offload, peak
        after, evaluations after)``."""
        m = self.m
        if self.heap is None:
            self.heap = []
            drops = sorted(m.candidates - self.s.drop - self.s.off)
            offs = (sorted(m.offloadable() - self.s.drop - self.s.off)
                    if self.allow_offload else [])
            for kind, vs in (("d", drops), ("o", offs)):
                for v in vs:
                    best = max((x[0] for x in self.moves(v, kind)), default=0.0)
                    heapq.heappush(self.heap, (-best, -1, v, kind))
        heap = self.heap
        while self.peak() > limit and heap and self.evals < max_evals:
            _, ver, v, kind = heapq.heappop(heap)
            if v in self.s.drop or v in self.s.off:
                continue
            if ver == self.version:
                continue  # already re-scored at this state and found useless
            sc = self.moves(v, kind)
            if not sc:
                heapq.heappush(heap, (0.0, self.version, v, kind))
                continue
            best = max(sc, key=lambda t: t[0])
            if heap and -heap[0][0] > best[0] and heap[0][1] != self.version:
                heapq.heappush(heap, (-best[0], self.version, v, kind))
                continue
            self.apply(best[1], best[2])
            self.version += 1
            if taken is not None:
                taken.append((best[1], best[2], self.peak(), self.evals))
            # parked zero-score moves get another look after the state changed
            heap[:] = [(sc_, -1 if sc_ == 0.0 else ver_, v_, k_)
                       for sc_, ver_, v_, k_ in heap]
            heapq.heapify(heap)
        return self.peak() <= limit

    def improve(self, limit: int, max_evals: int = 20_000,
                keep: frozenset[int] = frozenset()) -> None:
        """Undo decisions the limit does not need (seeds and user tags in ``keep`` stay)."""
        changed = True
        while changed and self.evals < max_evals:
            changed = False
            for v in sorted((self.s.drop | self.s.off) - keep, key=lambda x: -x):
                if v not in self.s.drop and v not in self.s.off:
                    continue
                c = self.change(rm={v})
                if c.peak <= limit and c.dtime < 0:
                    self.apply(rm={v})
                    changed = True
                # offload is cheaper than recompute for some values: try swapping
                if v in self.s.drop and v in self.m.offloadable() and self.allow_offload:
                    self.apply(rm={v})
                    c2 = self.change(set(), {v})
                    if c2.peak <= limit and c2.dtime < -c.dtime:
                        self.apply(set(), {v})
                        changed = True
                    else:
                        self.apply({v})


class _Trajectory:
    """One greedy run from a seed, kept for its cost model (:data:`_RUNS`): a search asks
    greedy for several limits (its aims, its lowest plan, the block search's rival), and
    every such run takes the same moves in the same order, stopping at its own limit
    (the scores do not depend on it). Run once, as far as the lowest limit asked; an
    answer replays the moves up to its stopping point (one evaluation each, not the
    scoring of every candidate). GPT-2 small (bench size, H100 target, ``budget=0.5``):
    five greedy runs were 42 of the search's 103 profiled seconds."""

    def __init__(self, model: CostModel, seed: frozenset[int], forced: frozenset[int],
                 allow_offload: bool) -> None:
        self.args = (model, seed, forced)
        self.allow_offload = allow_offload
        self.g = _Greedy(model, seed, forced, allow_offload=allow_offload)
        self.taken: list[tuple[set[int], set[int], int, int]] = []
        # (peak, evaluations) before any move, once every move is scored (answer's first)
        self.start: tuple[int, int] | None = None
        self.done = False                 # ran out of moves or evaluations

    def _stop(self, limit: int) -> int | None:
        """How many moves a run to ``limit`` takes, where the moves so far reach it."""
        assert self.start is not None
        if self.start[0] <= limit:
            return 0
        return next((k + 1 for k, t in enumerate(self.taken) if t[2] <= limit), None)

    def answer(self, limit: int) -> tuple[_Greedy, bool]:
        """A fresh solver in the state a run to ``limit`` stops in (its evaluations
        counted as that run's), and whether it fits."""
        if self.start is None:   # a fresh run scores every move before it takes one
            self.g.run(self.g.peak())
            self.start = (self.g.peak(), self.g.evals)
        k = self._stop(limit)
        if k is None and not self.done:
            self.done = not self.g.run(limit, taken=self.taken)
            k = self._stop(limit)
        fits = k is not None
        k = len(self.taken) if k is None else k
        g = _Greedy(*self.args, allow_offload=self.allow_offload)
        for d, o, _, _ in self.taken[:k]:
            g.apply(d, o)
        g.evals = self.taken[k - 1][3] if k else self.start[1]
        return g, fits


#: The greedy runs of each cost model, by seed, offload tags and whether offload is allowed.
_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def greedy(model: CostModel, limit: int, *, allow_offload: bool = False,
           forced_offload: Iterable[int] = (), start: Iterable[int] = ()
           ) -> tuple[frozenset[int], frozenset[int], bool]:
    """Greedy plan whose predicted peak is at most ``limit`` bytes: ``(drop, offload, fits)``.

    ``start`` seeds the drop set (jaxmem.optimize seeds it with MEDL's auto plan when the
    budget is below the plain-jit peak); the undo pass may give seeds back. Runs from the
    same seed on the same model share their moves (:class:`_Trajectory`)."""
    forced_offload = frozenset(forced_offload)
    seed = frozenset(start) & model.candidates - forced_offload
    runs = _RUNS.setdefault(model, {})
    key = (seed, forced_offload, allow_offload)
    if key not in runs:
        runs[key] = _Trajectory(model, seed, forced_offload, allow_offload)
    g, fits = runs[key].answer(limit)
    if fits:
        g.improve(limit, keep=forced_offload | frozenset(start))
    return frozenset(g.s.drop), frozenset(g.s.off), fits


# --- exact (MILP) -------------------------------------------------------------------------

def _ancestors(model: CostModel, reads: Iterable[int]) -> set[int]:
    """Nodes region chains could replay: every droppable value dropped."""
    return set(chains.replay_chain(model.program, list(reads), _all_dropped(model))[0])


def _all_dropped(model: CostModel) -> Any:
    return chains.chain_start(model.program, dropped=model.candidates, kept=model.residual_ids)


def exact_size(model: CostModel) -> int:
    """Number of variables the MILP would have (a measure of its size)."""
    return (sum(len(_ancestors(model, r.reads & model.candidates)) for r in model.regions)
            + len(model.candidates | model.fixed) * len(model.regions))


class _Milp:
    """Columns and rows of the program, built up by name."""

    def __init__(self, model: CostModel, offl: list[int]) -> None:
        self.m = model
        self.cand = sorted(model.candidates)
        self.offl = offl
        self.stored = sorted(model.candidates | model.fixed)
        self.col: dict[tuple, int] = {}
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.anc = [_ancestors(model, r.reads & model.candidates) for r in model.regions]
        nreg = len(model.regions)
        for v in self.cand:
            self.var(("d", v))
        for v in offl:
            self.var(("o", v))
        for v in self.stored:
            for i in range(nreg):
                self.var(("z", v, i))   # v is stored and still needed at region i or later
        self.e_col = self.var(("e",))
        for i, nodes in enumerate(self.anc):
            for n in nodes:
                self.var(("y", i, n))

    def var(self, key: tuple) -> int:
        if key not in self.col:
            self.col[key] = len(self.col)
        return self.col[key]

    def keep_terms(self, u: int, coef: float) -> dict[int, float]:
        t = {}
        for k in ("d", "o"):
            if (k, u) in self.col:
                t[self.col[(k, u)]] = coef
        return t

    def storage_rows(self) -> None:
        """An offloaded value is not dropped; z is monotone; activations are stored up to
        their last reading region unless dropped or offloaded."""
        m, col, rows = self.m, self.col, self.rows
        nreg = len(m.regions)
        for v in self.offl:
            if ("d", v) in col:
                rows.append(({col[("d", v)]: 1, col[("o", v)]: 1}, -np.inf, 1))
        for v in self.stored:
            for i in range(nreg - 1):
                rows.append(({col[("z", v, i)]: 1, col[("z", v, i + 1)]: -1}, 0, np.inf))
        for v in m.activations:
            if v not in m.bytes or not nreg:
                continue
            t = {col[("z", v, m.last_region(v, ()))]: 1.0}
            t.update(self.keep_terms(v, 1.0))
            rows.append((t, 1, np.inf))

    def chain_rows(self) -> None:
        """A region replays the producer of each dropped value it reads, and a replayed node
        needs each input replayed too, or stored (a chain start)."""
        m, col, rows, prog = self.m, self.col, self.rows, self.m.program
        start = _all_dropped(m)
        for i, r in enumerate(m.regions):
            for v in r.reads & m.candidates:
                p = prog.values[v].producer
                rows.append(({col[("y", i, p)]: 1, col[("d", v)]: -1}, 0, np.inf))
            for n in self.anc[i]:
                yn = col[("y", i, n)]
                for u in dict.fromkeys(prog.nodes[n].inputs):
                    if u in m.fixed:
                        rows.append(({col[("z", u, i)]: 1, yn: -1}, 0, np.inf))
                        continue
                    if start(u):
                        continue  # an input, a constant, a backward value: there anyway
                    yp = col[("y", i, prog.values[u].producer)]
                    if u in m.candidates:
                        t = {yp: 1.0, yn: -1.0}
                        t.update(self.keep_terms(u, -1.0))
                        rows.append((t, -1, np.inf))        # y_p >= y_n - keep_u
                        t = {col[("z", u, i)]: 1.0, yn: -1.0}
                        t.update(self.keep_terms(u, 1.0))
                        rows.append((t, 0, np.inf))         # z_u,i >= y_n - d_u - o_u
                    else:
                        rows.append(({yp: 1.0, yn: -1.0}, 0, np.inf))

    def memory_rows(self, room: float) -> range:
        """Per region: stored bytes plus the replayed nodes' outputs fit in ``room``."""
        first = len(self.rows)
        for i, nodes in enumerate(self.anc):
            t = {self.col[("z", v, i)]: float(self.m.bytes.get(v, 0)) for v in self.stored}
            for n in nodes:
                t[self.col[("y", i, n)]] = float(self.m.node_out[n])
            self.rows.append((t, -np.inf, room))
        return range(first, len(self.rows))

    def objective(self) -> np.ndarray:
        """Replay time, plus each offload's transfer beyond its window, plus ``e``; ``e``
        bounds the round trips beyond what the step's compute can hide."""
        m, p = self.m, self.m.profile
        c = np.zeros(len(self.col))
        for key, j in self.col.items():
            if key[0] == "y":
                c[j] = m.node_time[key[2]]
            elif key[0] == "o":
                b = m.bytes.get(key[1], 0)
                c[j] = max(0.0, p.transfer_time(b) - m.window.get(key[1], 0.0))
        c[self.e_col] = 1.0
        if self.offl:
            t = {self.col[("o", v)]: 2 * p.transfer_time(m.bytes.get(v, 0)) for v in self.offl}
            t[self.e_col] = -1.0
            self.rows.append((t, -np.inf, p.overlap * m.step_time))
        return c * 1e6  # costs in microseconds, for HiGHS' tolerances

    def solve(self, c: np.ndarray, mem_rows: range, forced: set[int], node_limit: int,
              time_limit: float | None = None) -> Any:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        nv = len(self.col)
        r_idx, c_idx, vals, lb, ub = [], [], [], [], []
        for k, (t, lo, hi) in enumerate(self.rows):
            scale = 1.0 / 2**20 if k in mem_rows else 1.0   # bytes in MiB
            for j, a in t.items():
                r_idx.append(k)
                c_idx.append(j)
                vals.append(a * scale)
            lb.append(lo * scale if np.isfinite(lo) else lo)
            ub.append(hi * scale if np.isfinite(hi) else hi)
        A = coo_matrix((vals, (r_idx, c_idx)), shape=(len(self.rows), nv)).tocsr()
        integrality = np.zeros(nv)
        lo_b, hi_b = np.zeros(nv), np.ones(nv)
        for key, j in self.col.items():
            if key[0] in ("d", "o"):
                integrality[j] = 1
            if key[0] == "o" and key[1] in forced:
                lo_b[j] = 1
            if key[0] == "e":
                hi_b[j] = np.inf
        # Bounded by work (branch-and-bound nodes), not time: the plan must not depend on
        # how fast this machine is (every process of a multi-host job plans the same).
        options: dict[str, Any] = {"node_limit": int(node_limit), "disp": False}
        if time_limit is not None:
            options["time_limit"] = float(time_limit)
        return milp(c, constraints=LinearConstraint(A, lb, ub), integrality=integrality,
                    bounds=Bounds(lo_b, hi_b), options=options)


def exact(model: CostModel, limit: int, *, allow_offload: bool = False,
          forced_offload: Iterable[int] = (), node_limit: int = 5000,
          time_limit: float | None = None) -> tuple[frozenset[int], frozenset[int], str]:
    """Solve the model exactly with scipy's ``milp`` (HiGHS), predicted peak at most ``limit``.

    The search is bounded by ``node_limit`` branch-and-bound nodes, so its answer is a pure
    function of the model; ``time_limit`` (seconds, default none) adds a wall-clock bound,
    which makes the answer depend on the machine's speed.

    Returns ``(drop, offload, status)`` where status is ``"optimal"``, ``"work limit"``
    (feasible, maybe not optimal), ``"infeasible"`` or another failure string (then the
    sets are empty).
    """
    forced = set(forced_offload)
    offl = sorted(model.offloadable()) if allow_offload else sorted(
        forced & model.offloadable())
    lp = _Milp(model, offl)
    lp.storage_rows()
    lp.chain_rows()
    mem_rows = lp.memory_rows(model.unscale(limit))
    res = lp.solve(lp.objective(), mem_rows, forced, node_limit, time_limit)
    if res.x is None:
        status = "infeasible" if res.status == 2 else f"failed ({res.message})"
        if res.status == 1:
            status = "work limit"
        return frozenset(), frozenset(), status
    x = res.x
    drop = frozenset(v for v in lp.cand if x[lp.col[("d", v)]] > 0.5)
    off = frozenset(v for v in offl if x[lp.col[("o", v)]] > 0.5)
    return drop, off, "optimal" if res.status == 0 else "work limit"
