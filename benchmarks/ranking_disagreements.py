"""Where the cost model (or the rewritten steps' liveness) orders candidate plans unlike the
compiler, pair by pair, and why.

``python -m benchmarks.prediction --plans`` compiles every candidate plan of a step and
records its compiled peak, the cost model's prediction (``model``) and the rewritten step's
own liveness (``rewritten``). This reads those files, traces each step again (nothing is
compiled) to rebuild its candidates, and adds a third figure:

- ``fused``: the cost model's peak where a residual that the step's compiler fuses into its
  readers (not materialised: :func:`jaxmem.analyzing.liveness.materialised`, the rule the
  plain step's predicted peak already uses) is not charged as stored; the materialised
  values it is made from are (its chain starts), as for a dropped value. Calibrated as the
  model is (keeping everything predicts the plain step's predicted peak). The cost model
  charges every residual at its full size and scales all of them by one factor fitted to
  the plain step, so where many residuals fuse (on XLA:GPU: elementwise ops, converts,
  broadcasts) that factor also shrinks the residuals a plan keeps, and plans come out low.

Then every pair of plans whose compiled peaks differ by more than 1% and that the model
orders the other way (or ties) is listed with its cause, the first that applies:

- ``tied``: the model predicts both alike (the same values dropped, grouped or cut into
  regions differently: the model sees a plan's drop set, not its grouping);
- ``fused``: the ``fused`` figure orders them as the compiler does;
- ``rewritten``: the rewritten step's liveness does (the rewrite's regions, barriers and
  re-created values, which the drop set does not show);
- ``compiler``: neither does (XLA's own scheduling and fusion of the rewritten step, beyond
  jaxmem's liveness model).

Run::

    python -m benchmarks.ranking_disagreements \\
        benchmarks/results/prediction/plans-h100.json \\
        benchmarks/results/prediction/plans-h100-test.json \\
        benchmarks/results/prediction_corpus/plans-h100.json \\
        benchmarks/results/prediction_corpus/plans-h100-jraph.json \\
        --out benchmarks/results/prediction/disagreements-h100

A step whose candidates today differ from the file's (names, count) is reported and
skipped: its figures were taken on other plans.

``--key rewritten`` checks the rewritten steps' liveness instead (the figure
``verify=True`` ranks its first compiles by, beside the model's): nothing is traced, the
figures are the files'; a pair it orders unlike the compiler is ``tied`` (equal
predictions), ``model`` (the cost model orders it right) or ``compiler``::

    python -m benchmarks.ranking_disagreements --key rewritten \
        benchmarks/results/prediction/plans-h100.json ... \
        --out benchmarks/results/prediction/disagreements-rewritten-h100
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.prediction_plans import TIE  # compiled peaks closer than this are a tie


class FusedFree:
    """The cost model's peak with the residuals its compiler fuses into their readers not
    stored (see the module's docstring): ``FusedFree(model).peak(drop, off)``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.fused = frozenset(v for v in model.activations if not model.mat[v])
        a = model.analysis
        raw = self.raw(frozenset(), frozenset())
        self.floor = min(a.argument_bytes, a.peak_bytes)
        self.kappa = float(np.clip((a.peak_bytes - self.floor) / max(raw, 1), 0.05, 1.0))
        self.base = a.peak_bytes - self.kappa * raw

    def raw(self, drop: Iterable[int], off: Iterable[int]) -> int:
        """Model bytes at the worst backward region: the stored values still needed there
        (fused residuals re-created from their chain starts) and its recompute working
        set."""
        m = self.model
        drop, off = frozenset(drop) | self.fused, frozenset(off)
        states = m.states(drop, off)
        return m.raw_peak(m.alive_bytes(drop, off, states), states)

    def peak(self, drop: Iterable[int] = (), off: Iterable[int] = ()) -> int:
        return int(self.base + self.kappa * self.raw(drop, off))


def apart(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether rows ``a`` and ``b`` compiled more than :data:`TIE` apart (a pair to
    order)."""
    return abs(a["compiled"] - b["compiled"]) > TIE * max(a["compiled"], b["compiled"])


#: Per figure ranked (``--key``): the other figures that may order a pair it gets wrong,
#: tried in this order (the first that orders it right names the cause).
OTHERS = {"model": ("fused", "rewritten"), "rewritten": ("model",)}


def cause(a: dict[str, Any], b: dict[str, Any], key: str = "model") -> str | None:
    """Why the ``key`` figures of rows ``a`` and ``b`` order them unlike their ``compiled``
    peaks (None: they agree, or the compiled peaks tie within :data:`TIE`): ``tied`` (equal
    ``key`` figures), the first of :data:`OTHERS` that orders them right, or
    ``compiler``."""
    if not apart(a, b):
        return None

    def right(k: str) -> bool:
        if a.get(k) is None or b.get(k) is None or a[k] == b[k]:
            return False
        return (a[k] < b[k]) == (a["compiled"] < b["compiled"])

    if right(key):
        return None
    if a.get(key) is not None and a[key] == b.get(key):
        return "tied"
    for other in OTHERS[key]:
        if right(other):
            return other
    return "compiler"


@contextlib.contextmanager
def _caught() -> Iterator[dict[str, Any]]:
    """What ``verify=True`` is handed (plan, analysis, step, options), caught before it
    compiles anything."""
    from jaxmem.compiling import predicted

    cap: dict[str, Any] = {}

    class _Stop(Exception):
        pass

    def spy(plan: Any, analysis: Any, step: Any, options: Any) -> Any:
        cap.update(plan=plan, analysis=analysis, step=step, options=options)
        raise _Stop

    original = predicted.predicted
    predicted.predicted = spy
    try:
        with contextlib.suppress(_Stop):
            yield cap
    finally:
        predicted.predicted = original


def candidates(name: str, size: str, target: str) -> tuple[Any, list[Any]]:
    """The cost model of ``name``'s step on ``target`` and its candidate plans, as
    ``jaxmem.optimize``'s default ``verify`` builds them (traced, not compiled)."""
    import jaxmem
    from benchmarks.workload import load
    from jaxmem.analyzing.costmodel import CostModel
    from jaxmem.compiling import choose, plan_cache

    w = load(name, size, target)
    plan_cache.clear_memory()
    with _caught() as cap:
        jaxmem.optimize(w.step, donate_argnums=(0,)).plan(w.state, w.batch)
    if not cap:
        raise RuntimeError("verify was not reached (a cached plan?)")
    cands = choose.rewrite_candidates(cap["plan"], cap["analysis"], cap["step"],
                                      cap["options"])
    return CostModel(cap["analysis"]), [c.plan for c in cands]


def _strategy(row_name: str) -> str:
    """A row's candidate name as the plan's strategy (the file notes the chosen one and
    renames MEDL's strict variant)."""
    return row_name.removesuffix(" (chosen)").split(" (strict")[0].split(" [")[0]


def step(entry: dict[str, Any], key: str = "model") -> dict[str, Any]:
    """One step of a plans file: its plan rows (``key`` ``model``: with ``fused`` added, the
    step traced again), the pairs ``key`` orders unlike the compiler and their causes, and
    the mean absolute errors of ``model``, ``fused`` and ``rewritten``."""
    rows = [dict(r) for r in entry["candidates"] if r["kind"] == "plan"]
    if key == "model":
        model, plans = candidates(entry["model"], entry["size"], entry["target"])
        names = [p.strategy for p in plans]
        if names != [_strategy(r["candidate"]) for r in rows]:
            return {"skipped": f"candidates differ from the file's: now {names}"}
        ff = FusedFree(model)
        for r, p in zip(rows, plans, strict=True):
            r["model_now"] = model.evaluate(p.recompute, p.offload).peak
            r["fused"] = ff.peak(p.recompute, p.offload)
    pairs = []
    for a, b in combinations(rows, 2):
        why = cause(a, b, key)
        if why is not None:
            pairs.append({"a": a["candidate"], "b": b["candidate"], "cause": why,
                          "compiled": [a["compiled"], b["compiled"]],
                          "model": [a["model"], b["model"]],
                          "fused": [a.get("fused"), b.get("fused")],
                          "rewritten": [a["rewritten"], b["rewritten"]]})
    n_pairs = sum(apart(a, b) for a, b in combinations(rows, 2))

    def mean_err(k: str) -> float | None:
        errs = [abs(r[k] / r["compiled"] - 1) for r in rows if r.get(k)]
        return round(100 * float(np.mean(errs)), 1) if errs else None

    return {"rows": rows, "pairs": n_pairs, "disagreements": pairs,
            "err_model_pct": mean_err("model"), "err_fused_pct": mean_err("fused"),
            "err_rewritten_pct": mean_err("rewritten"),
            "model_reproduced": (all(r["model_now"] == r["model"] for r in rows)
                                 if key == "model" else None)}  # None: not traced again


def causes(key: str) -> tuple[str, ...]:
    """The causes a disagreement of ``key``'s figures is put down to (:func:`cause`)."""
    return ("tied", *OTHERS[key], "compiler")


def markdown(meta: dict[str, Any], steps: list[dict[str, Any]]) -> str:
    key = meta.get("key", "model")
    kinds = causes(key)
    out = [f"`{meta['command']}` ({meta['date']}, commit {str(meta['git_commit'])[:10]})", "",
           f"| step | plans | pairs | {key} orders unlike the compiler | " +
           " | ".join(kinds) + " | mean abs. error: model | fused | rewritten |",
           "|---|---:|---:|---:|" + "---:|" * len(kinds) + "---:|---:|---:|"]
    total: Counter[str] = Counter()
    n_pairs = 0
    for s in steps:
        if "skipped" in s:
            out.append(f"| {s['key']} | skipped: {s['skipped'][:120]} |")
            continue
        c = Counter(p["cause"] for p in s["disagreements"])
        total.update(c)
        n_pairs += s["pairs"]
        out.append(f"| {s['key']} | {len(s['rows'])} | {s['pairs']} | "
                   f"{len(s['disagreements'])} | " + " | ".join(str(c[k]) for k in kinds)
                   + f" | {_pct(s['err_model_pct'])} | {_pct(s['err_fused_pct'])} | "
                   f"{_pct(s['err_rewritten_pct'])} |")
    bad = sum(total.values())
    out += ["", f"{bad} of {n_pairs} pairs ordered unlike the compiler "
            f"({100 * (1 - bad / max(n_pairs, 1)):.1f}% agree); causes: "
            + ", ".join(f"{k} {total[k]}" for k in kinds) + ".", "",
            "| step | plan a | plan b | compiled MiB | model MiB | fused MiB | rewritten MiB "
            "| cause |", "|---|---|---|---|---|---|---|---|"]

    def mib(x: list[int | None]) -> str:
        return " / ".join("–" if v is None else f"{v / 2**20:.2f}" for v in x)

    for s in steps:
        for p in s.get("disagreements", ()):
            out.append(f"| {s['key']} | {p['a']} | {p['b']} | {mib(p['compiled'])} | "
                       f"{mib(p['model'])} | {mib(p['fused'])} | {mib(p['rewritten'])} | "
                       f"{p['cause']} |")
    return "\n".join(out) + "\n"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="JSON of python -m benchmarks.prediction --plans")
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    ap.add_argument("--key", choices=sorted(OTHERS), default="model",
                    help="the figure whose order is checked: the cost model's (each step "
                    "traced again) or the rewritten steps' liveness (read from the files)")
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip() or None
    meta = {"command": "python -m benchmarks.ranking_disagreements "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git_commit": commit, "tie": TIE, "key": a.key}
    steps = []
    for f in a.files:
        for e in json.loads(Path(f).read_text())["models"]:
            if e.get("error"):
                continue
            key = f"{e['model']} ({e['size']}, {e['target']})"
            try:
                s = step(e, a.key)
            except Exception as ex:  # noqa: BLE001 - reported; the others go on
                s = {"skipped": f"{type(ex).__name__}: {ex}".splitlines()[0]}
            s["key"] = key
            steps.append(s)
            print(key, s.get("skipped") or
                  f"{len(s['disagreements'])} of {s['pairs']} pairs", flush=True)
    md = markdown(meta, steps)
    print(md)
    if a.out:
        a.out.with_suffix(".md").write_text(md)
        a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "steps": steps},
                                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
