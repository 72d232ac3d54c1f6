"""Which first compiles would have held the compiled best, from ``prediction --plans`` JSON.

``python -m benchmarks.prediction --plans`` compiles every candidate plan of a step
(``verify="all"``) and records, per plan, its compiled peak, the cost model's prediction
(``model``) and the rewritten step's own liveness (``rewritten``). This reads those files
and says, per step, how far above the best compiled plan the best of each first set lands:

- ``model3``: the cost model's three lowest, and any tied with the third (what
  ``jaxmem.compiling.choose.ranked`` compiles first);
- ``rewritten1``: the rewritten step's lowest alone;
- ``union``: both (what ``verify="builtins"`` compiles first, ``with_rewritten_best``);
- ``default``: what ``verify=True`` compiles first since issue 37
  (:mod:`jaxmem.compiling.predicted`): the plans tied at the cost model's lowest (on a
  target in ``TIES_BY_REWRITTEN``: the one of them whose rewritten step is lowest), and the
  rewritten step's lowest among the plans the model puts within
  :data:`~jaxmem.compiling.predicted.REWRITTEN_WITHIN` of its lowest, and that of the
  others where it is more than :data:`~jaxmem.compiling.predicted.REWRITTEN_OVERRULES`
  below those; in a crowd (:data:`~jaxmem.compiling.predicted.CROWD`), less the model's
  plans whose rewritten step is more than
  :data:`~jaxmem.compiling.predicted.REWRITTEN_DEFERS` above that lowest, and less that
  lowest where one of the model's plans is left; its column is also
  against every compiled candidate, the built-ins and the plain step included (``all``).
  :data:`~jaxmem.compiling.predicted.LARGE_REWRITE` is not replicated: the files do not
  store the rewrites' sizes (it applies only where the model's first choice, outside a
  crowd, rewrites to over 1.5x the step's equations, as MEDL's region plans do on
  decoders; it was measured on the lm1b-width decoder, which is not among the files).

``--drop NAME`` (repeatable) leaves out the candidates whose name holds ``NAME``, as if
``auto_candidates`` did not list them; ``--kinds`` prints, per candidate kind (depths
as ``d``), the steps it appears in, compiles lowest of the plans, and within 1% of the
lowest: which kinds ever matter.

Run::

    python -m benchmarks.ranking_union benchmarks/results/prediction/plans-cpu.json \\
        benchmarks/results/prediction/plans-h100.json \\
        benchmarks/results/prediction_corpus/plans-h100.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jaxmem
from jaxmem.compiling.predicted import (
    CROWD,
    REWRITTEN_DEFERS,
    REWRITTEN_OVERRULES,
    REWRITTEN_WITHIN,
    TIES_BY_REWRITTEN,
    plain_bound,
)


def first(rows: list[dict[str, Any]], key: str, k: int) -> list[dict[str, Any]]:
    """The ``k`` rows lowest in ``key``, with every row tied with the ``k``-th."""
    known = sorted((r for r in rows if r.get(key) is not None), key=lambda r: r[key])
    if not known:
        return []
    cut = known[min(k, len(known)) - 1][key]
    return [r for r in known if r[key] <= cut]


def over_best(rows: list[dict[str, Any]], chosen: list[dict[str, Any]]) -> float | None:
    """How far (%) the lowest compiled peak of ``chosen`` is above the lowest of ``rows``."""
    if not chosen:
        return None
    best = min(r["compiled"] for r in rows)
    return 100.0 * (min(r["compiled"] for r in chosen) / best - 1.0)


def default(rows: list[dict[str, Any]], target: str = "cpu",
            plain_pred: int | None = None) -> list[dict[str, Any]]:
    """What ``verify=True`` compiles first: the rows tied at the lowest ``model`` figure
    (on a target in ``TIES_BY_REWRITTEN``, only the one of them with the lowest
    ``rewritten`` figure), and the lowest ``rewritten`` among those within
    ``REWRITTEN_WITHIN`` of it, and of the others where it is more than
    ``REWRITTEN_OVERRULES`` below them; where more than ``CROWD`` are within
    ``REWRITTEN_WITHIN`` and the plain step's prediction ``plain_pred`` is trusted
    (``plain_bound``), less the model's rows predicted (rewritten) more than
    ``REWRITTEN_DEFERS`` above the lowest of those, and less that lowest where one of the
    model's rows is left (it compiles alone)."""
    tied = first(rows, "model", 1)
    if not tied:
        return []
    if _platform(target) in TIES_BY_REWRITTEN and len(tied) > 1:
        tied = sorted(tied, key=lambda r: (r.get("rewritten") is None,
                                           r.get("rewritten") or 0))[:1]
    near = [r for r in rows if r.get("model") is not None
            and r["model"] <= tied[0]["model"] * (1 + REWRITTEN_WITHIN)]
    best = first(near, "rewritten", 1)[:1]
    ours = [r["rewritten"] for r in tied + best if r.get("rewritten") is not None]
    near_ids = {id(r) for r in near}
    far = first([r for r in rows if id(r) not in near_ids], "rewritten", 1)[:1]
    if ours and far and far[0]["rewritten"] < min(ours) * (1 - REWRITTEN_OVERRULES):
        best += far
    crowd = (plain_pred is not None and len(near) > CROWD
             and plain_bound(plain_pred, _platform(target)) is not None)
    if crowd and best and best[0].get("rewritten") is not None:
        lo = best[0]["rewritten"] * (1 + REWRITTEN_DEFERS)
        tied = [r for r in tied if r is best[0] or r.get("rewritten") is None
                or r["rewritten"] <= lo]
        if any(r is not best[0] for r in tied):   # the model's choice stands: alone
            return tied
    return list({id(r): r for r in tied + best}.values())


def _platform(target: str) -> str:
    """The jax platform a ``prediction --plans`` target compiles for."""
    return "cpu" if target == "cpu" else jaxmem.targets.get(target).platform


def step_rows(path: str, drop: tuple[str, ...] = ()
              ) -> list[tuple[str, str, int, dict[str, Any]]]:
    """Per step of a ``prediction --plans`` file: model, target, plans, the three sets'
    figures (``over``: % above the best; ``n``: plans in the set). ``drop``: candidates
    whose name holds one of these are left out, as if not listed."""
    out = []
    for m, rows in _steps(path, drop):
        model3, rewritten1 = first(rows, "model", 3), first(rows, "rewritten", 1)
        union = list({id(r): r for r in model3 + rewritten1}.values())
        sets = {"model3": model3, "rewritten1": rewritten1, "union": union,
                "default": default(rows, m["target"], m["plain"].get("rewritten"))}
        figs = {k: {"over": over_best(rows, v), "n": len(v)} for k, v in sets.items()}
        every = [c for c in m["candidates"] if c.get("compiled")] + [m["plain"]]
        figs["all"] = {"over": over_best(every, sets["default"]), "n": len(sets["default"])}
        out.append((m["model"], m["target"], len(rows), figs))
    return out


def _steps(path: str, drop: tuple[str, ...] = ()
           ) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each step of a ``prediction --plans`` file with a compiled plan: its entry (less
    the candidates whose name holds one of ``drop``) and its compiled plan rows."""
    for m in json.loads(Path(path).read_text())["models"]:
        m = dict(m, candidates=[c for c in m["candidates"]
                                if not any(d in c["candidate"] for d in drop)])
        rows = [c for c in m["candidates"] if c["kind"] == "plan" and c.get("compiled")]
        if rows:
            yield m, rows


def kind_of(name: str) -> str:
    """A candidate's kind: its name with block depths as ``d`` and a repeat's number
    dropped (``selective(depth=4, light unjoined)`` -> ``selective(depth=d, light
    unjoined)``)."""
    return re.sub(r" \[\d+\]$", "", re.sub(r"(depth[= ])\d+", r"\1d", name))


def kinds(paths: list[str]) -> dict[str, list[int]]:
    """Per candidate kind (:func:`kind_of`) over the steps of ``paths``: ``[steps it
    appears in, steps where it compiled lowest of the plans, steps where within 1% of
    the lowest]``."""
    out: dict[str, list[int]] = {}
    for path in paths:
        for _, rows in _steps(path):
            best = min(r["compiled"] for r in rows)
            low: dict[str, int] = {}
            for r in rows:
                k = kind_of(r["candidate"])
                low[k] = min(low.get(k, r["compiled"]), r["compiled"])
            for k, v in low.items():
                t = out.setdefault(k, [0, 0, 0])
                t[0], t[1], t[2] = t[0] + 1, t[1] + (v == best), t[2] + (v <= 1.01 * best)
    return out


def _cell(x: dict[str, Any]) -> str:
    return "–" if x["over"] is None else f"{x['over']:+.1f}% ({x['n']})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", help="prediction --plans JSON files")
    ap.add_argument("--drop", action="append", default=[], metavar="NAME",
                    help="leave out the candidates whose name holds NAME (repeatable): "
                    "what the first compiles would be were they not listed")
    ap.add_argument("--kinds", action="store_true", help="per candidate kind: the steps "
                    "it appears in, compiled lowest, and within 1%% of the lowest")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    paths, drop = args.paths, tuple(args.drop)
    if not paths:
        print(__doc__)
        return 2
    if args.kinds:
        print("| candidate kind | steps | lowest | within 1% |\n|---|---:|---:|---:|")
        for k, (n, low, near) in sorted(kinds(paths).items(), key=lambda t: -t[1][0]):
            print(f"| {k} | {n} | {low} | {near} |")
        return 0
    print("| step | target | plans | model's 3 | rewritten's 1 | both | default | default, "
          "against all |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    held = {"model3": 0, "rewritten1": 0, "union": 0, "default": 0}
    within = 0
    n = 0
    per_target: dict[str, list[int]] = {}  # target -> [steps, within 1%, plans compiled]
    for path in paths:
        for model, target, plans, sets in step_rows(path, drop):
            n += 1
            for k in held:
                held[k] += sets[k]["over"] is not None and sets[k]["over"] <= 0.0
            ok = sets["all"]["over"] is not None and sets["all"]["over"] <= 1.0
            within += ok
            t = per_target.setdefault(target, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + 1, t[1] + ok, t[2] + sets["default"]["n"]
            print(f"| {model} | {target} | {plans} | {_cell(sets['model3'])} | "
                  f"{_cell(sets['rewritten1'])} | {_cell(sets['union'])} | "
                  f"{_cell(sets['default'])} | {_cell(sets['all'])} |")
    print(f"\nThe compiled best held, of {n} steps: model's 3 {held['model3']}, "
          f"rewritten's 1 {held['rewritten1']}, both {held['union']}, default "
          f"{held['default']}; the default within 1% of every compiled candidate (built-ins "
          f"and plain included): {within}. "
          "Cells: % above the best compiled plan (plans in the set).")
    for target, (steps, ok, compiled) in per_target.items():
        print(f"{target}: the default within 1% on {ok} of {steps} steps, "
              f"{compiled / steps:.2f} plans in its first compiles a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
