"""How well ``Analysis.peak_bytes`` predicts the compiled peak, per zoo model and target.

``python -m benchmarks.prediction`` builds every zoo model (abstract state, nothing is
initialised), predicts its train step's peak with ``jaxmem.analyze(step, state, batch,
donate_argnums=0)`` for the arguments' target, compiles the same step with ``jax.jit(step,
donate_argnums=0)`` for that target and reads ``argument + output + temp - alias`` of
``memory_analysis()``. With ``--chosen`` it does the same for the step ``jaxmem.optimize``
rewrites (its jaxpr, ``jaxmem.optimize(step).trace(...)``, analysed with the state donated,
against the compiled figures of the plan it verified).

With ``--plans`` it lists, per model and target, every candidate ``jaxmem.optimize``'s
``verify`` compiles (:func:`jaxmem.compiling.choose.verified`, read by wrapping its
``compile_candidates``; the choice itself is unchanged), each with two predictions:

- ``rewritten``: ``Analysis.peak_bytes`` of the candidate's own jaxpr (the plan's rewrite,
  or the step with its loss under ``jax.checkpoint``), state donated, for the target;
- ``model`` (plans only): the cost model's peak of the plan's drop/offload sets,
  ``CostModel(analysis).evaluate(plan.recompute, plan.offload).peak``, what the budget
  search ranks with (blind to the plan's region grouping, ``region_depth`` / ``keep``);

its compiled peak (the figures ``verify`` chose on), the errors, and per prediction whether
it ranks the candidates as the compiler does: the fraction of pairs (compiled peaks more
than 1% apart) in the same order, and whether the predicted best compiles within 1% of
the compiled best. Writes ``plans-<target>.json`` (``plans-<target>-<size>.json`` for
another size than bench) and a ``.md`` summary under ``--out``.

Prints a table (model, size, target, step, predicted, compiled, error %) and writes
``prediction.json`` under ``--out`` after every row (partial results survive an interrupt).

Example::

    python -m benchmarks.prediction --sizes test,bench --targets cpu,h100
    python -m benchmarks.prediction --sizes test --targets cpu,h100 --chosen
    python -m benchmarks.prediction --sizes bench --targets cpu --models mlp,resnet --plans
    python -m benchmarks.prediction --docs docs/targets.md   # the table there, from the JSON
    python -m benchmarks.prediction --sizes bench --targets h100,cpu \
        --models corpus:eqx_bn_cnn,corpus:tx_gpt2_ts --out benchmarks/results/prediction_corpus

(``MODEL`` may be ``corpus:NAME``, an entry of :mod:`benchmarks.external.corpus`, as for
``--plans``.)

``--repredict`` compiles nothing either: it predicts the plain rows of ``--out``'s
``prediction.json`` again with the model as it is now and prints each beside its stored
compiled peak, with the counts within 5% and 10% and the largest errors (the 36 H100 rows
of the zoo and the corpus in a few minutes): how a change to the liveness model is
measured on every stored step before the compiles are re-run. ::

    python -m benchmarks.prediction --repredict --targets h100
    python -m benchmarks.prediction --repredict --out benchmarks/results/prediction_corpus

With ``--plans`` it does the same for every candidate of ``--out``'s ``plans-*.json``
(or ``--files``): the candidates ``verify="all"`` would compile are built as for a user
and stopped where they are handed to the compiler, each stored row is found among them by
name, and its rewritten step's liveness and the cost model's peak are predicted again
against its stored compiled peak (the zoo's three bench steps in under a minute)::

    python -m benchmarks.prediction --repredict --plans --files \
        benchmarks/results/prediction/plans-h100.json

``--write`` stores the new predictions in the files read (each stored compiled peak kept,
the rows' errors and, for plans, the rankings recomputed; ``repredicted`` names the commit
and command), so that :mod:`benchmarks.ranking_disagreements` and :mod:`benchmarks.ranking_union`
read the model as it is now without compiling the candidates again.

``--docs`` compiles nothing: it rewrites the table between ``<!-- prediction-table -->``
markers in the given file from ``prediction.json`` (plain steps), ``before.json`` (the model
before the per-target rules, same compiled peaks) and ``plans_test/prediction.json`` (the
plans ``jaxmem.optimize`` verified, ``--chosen``) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax
from jaxmem.program import from_jaxpr

import jaxmem
from benchmarks import zoo
from jaxmem import measure
from jaxmem.analyzing.analysis import from_program

DEFAULT_OUT = Path("benchmarks/results/prediction")


def _workload(name: str, size: str, target: str) -> Any:
    """A zoo model, or ``corpus:NAME`` (other people's train step, built for ``target``'s
    devices), named for the rows."""
    from benchmarks.prediction_plans import workload

    w = workload(name, size, target)
    if name.startswith("corpus:"):
        w.name, w.size = name, size
    return w


def _args(w: zoo.Workload, target: str) -> Any:
    from benchmarks.prediction_plans import placed

    return placed(w, target)


def plain_row(w: zoo.Workload, target: str) -> dict[str, Any]:
    """Predicted and compiled peak of ``w``'s plain step (state donated) on ``target``."""
    args = _args(w, target)
    t0 = time.perf_counter()
    predicted = jaxmem.analyze(w.step, *args, donate_argnums=0).peak_bytes
    t1 = time.perf_counter()
    compiled = measure.figures(measure.compile(
        jax.jit(w.step, donate_argnums=0).lower(*args))).peak
    return _row(w, target, "plain", predicted, compiled, t1 - t0, time.perf_counter() - t1)


def plan_row(w: zoo.Workload, target: str) -> dict[str, Any]:
    """Predicted and compiled peak of the step ``jaxmem.optimize`` rewrites for ``target``."""
    args = _args(w, target)
    step = jaxmem.optimize(w.step, donate_argnums=(0,))
    t0 = time.perf_counter()
    compiled = step.plan(*args).compiled.peak
    t1 = time.perf_counter()
    program = from_jaxpr(step.trace(*args).jaxpr)
    n_state = len(jax.tree_util.tree_leaves(w.state))
    platform = jaxmem.targets.get(target).platform
    predicted = from_program(program, donated=range(n_state), platform=platform).peak_bytes
    return _row(w, target, "jaxmem", predicted, compiled, time.perf_counter() - t1, t1 - t0)


def _row(w: zoo.Workload, target: str, step: str, predicted: int, compiled: int,
         analyse_s: float, compile_s: float) -> dict[str, Any]:
    return {"model": w.name, "size": w.size, "target": target, "step": step,
            "predicted": int(predicted), "compiled": int(compiled),
            "error_pct": 100.0 * (predicted / compiled - 1.0) if compiled else None,
            "analyse_s": round(analyse_s, 2), "compile_s": round(compile_s, 2)}


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of ``rows``."""
    out = ["| model | size | target | step | predicted MiB | compiled MiB | error |",
           "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        err = "error" if r.get("error") else f"{r['error_pct']:+.1f}%"
        pred = "" if r.get("error") else f"{r['predicted'] / 2**20:.2f}"
        comp = "" if r.get("error") else f"{r['compiled'] / 2**20:.2f}"
        out.append(f"| {r['model']} | {r['size']} | {r['target']} | {r['step']} | {pred} | "
                   f"{comp} | {err} |")
    ok = [abs(r["error_pct"]) for r in rows if not r.get("error")]
    if ok:
        within = sum(e <= 10.0 for e in ok)
        out.append(f"\n{within}/{len(ok)} within 10%; largest error {max(ok):.1f}%")
    return "\n".join(out)


_TARGET_NAMES = {"cpu": "CPU", "h100": "H100 target"}
_MARK = "<!-- prediction-table -->"
_END = "<!-- /prediction-table -->"


def _load(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["rows"] if path.exists() else []


def docs_table(rows: list[dict[str, Any]], before: list[dict[str, Any]],
               plans: list[dict[str, Any]]) -> str:
    """The docs' table: each plain row with the error before the per-target rules and the
    verified plan's prediction beside it, and the counts within 10%."""
    def key(r: dict[str, Any]) -> tuple[str, str, str]:
        return r["model"], r["size"], r["target"]

    old = {key(r): r for r in before if r.get("step", "plain") == "plain"}
    plan = {key(r): r for r in plans if r.get("step") == "jaxmem" and not r.get("error")}
    out = ["| model | size | target | before | predicted MiB | compiled MiB | error | "
           "jaxmem plan: predicted / compiled MiB, error |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    errs, olds, perrs = [], [], []
    for r in rows:
        if r.get("step", "plain") != "plain" or r.get("error"):
            continue
        k = key(r)
        b = old.get(k)
        b_txt = f"{100 * (b['predicted'] / r['compiled'] - 1):+.1f}%" if b else ""
        if b:
            olds.append(abs(100 * (b["predicted"] / r["compiled"] - 1)))
        p = plan.get(k)
        p_txt = (f"{p['predicted'] / 2**20:.2f} / {p['compiled'] / 2**20:.2f}, "
                 f"{p['error_pct']:+.1f}%") if p else ""
        if p:
            perrs.append(abs(p["error_pct"]))
        errs.append(abs(r["error_pct"]))
        out.append(f"| {r['model']} | {r['size']} | {_TARGET_NAMES.get(r['target'], r['target'])}"
                   f" | {b_txt} | {r['predicted'] / 2**20:.2f} | {r['compiled'] / 2**20:.2f} | "
                   f"{r['error_pct']:+.1f}% | {p_txt} |")
    out.append("")
    line = f"plain: {sum(e <= 10 for e in errs)}/{len(errs)} within 10%"
    if olds:
        line += f" (before: {sum(e <= 10 for e in olds)}/{len(olds)})"
    line += f"; largest {max(errs, default=0):.1f}%"
    if olds:
        line += f" (before {max(olds):.1f}%)"
    out.append(line)
    for size in sorted({r["size"] for r in rows}):
        e = [abs(r["error_pct"]) for r in rows
             if r["size"] == size and r.get("step", "plain") == "plain" and not r.get("error")]
        out.append(f"plain at {size} size: {sum(x <= 10 for x in e)}/{len(e)} within 10%; "
                   f"largest {max(e, default=0):.1f}%")
    if perrs:
        out.append(f"plans: {sum(e <= 10 for e in perrs)}/{len(perrs)} within 10%; "
                   f"largest {max(perrs):.1f}%")
    return "\n".join(out)


def render_docs(path: Path, out: Path) -> None:
    """Rewrite the marked table in ``path`` from the JSON files under ``out``."""
    text = path.read_text()
    if _MARK not in text or _END not in text:
        raise SystemExit(f"{path}: no {_MARK} ... {_END} block to rewrite")
    head, rest = text.split(_MARK, 1)
    _, tail = rest.split(_END, 1)
    table_md = docs_table(_load(out / "prediction.json"), _load(out / "before.json"),
                          _load(out / "plans_test" / "prediction.json"))
    path.write_text(f"{head}{_MARK}\n{table_md}\n{_END}{tail}")


def _meta_repredict(argv: list[str] | None) -> dict[str, Any]:
    from benchmarks import prediction_plans
    return prediction_plans._meta(argv)


def repredict(rows: list[dict[str, Any]], keep: dict[str, set[str]],
              write: dict[str, Any] | None = None) -> int:
    """Predict each plain row of ``rows`` (``keep``: ``{"models"|"sizes"|"targets": names}``)
    again with the model as it is now, and print it beside its stored prediction and
    compiled peak, then how many are within 5% and 10% and the largest errors either way:
    a change to the liveness model measured on every stored step in minutes, with no
    compile (the compiled peaks do not depend on the model). ``write``: this run's meta;
    each row predicted is updated in place (``predicted``, ``error_pct``, ``repredicted``)
    for the caller to store."""
    field = {"models": "model", "sizes": "size", "targets": "target"}
    errors = []
    for r in rows:
        if r.get("step", "plain") != "plain" or "compiled" not in r or any(
                r[field[k]] not in v for k, v in keep.items()):
            continue
        w = _workload(r["model"], r["size"], r["target"])
        now = jaxmem.analyze(w.step, *_args(w, r["target"]), donate_argnums=0).peak_bytes
        err = 100 * (now / r["compiled"] - 1)
        errors.append(err)
        print(f"{r['model']:30s} {r['size']:5s} {r['target']:5s} compiled "
              f"{r['compiled'] / 2**20:9.2f} MiB  stored {r['error_pct']:+6.1f}%  now "
              f"{err:+6.1f}%", flush=True)
        if write is not None:
            r.update(predicted=int(now), error_pct=err, repredicted=write)
    if not errors:
        raise SystemExit("no stored plain row matches")
    print(f"\n{len(errors)} rows: {sum(abs(e) <= 5 for e in errors)} within 5%, "
          f"{sum(abs(e) <= 10 for e in errors)} within 10%; largest over-prediction "
          f"{max(errors):+.1f}%, largest under-prediction {min(errors):+.1f}%, mean "
          f"absolute error {sum(abs(e) for e in errors) / len(errors):.1f}%")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prediction",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="test,bench")
    p.add_argument("--targets", default="cpu,h100")
    p.add_argument("--models", default=",".join(zoo.names()))
    p.add_argument("--chosen", action="store_true",
                   help="also the step jaxmem.optimize rewrites (compiles its candidates)")
    p.add_argument("--plans", action="store_true",
                   help="every candidate jaxmem.optimize compiles: predicted and compiled "
                        "peaks, ranking agreement (benchmarks/prediction_plans)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--docs", type=Path,
                   help="rewrite the prediction table in this markdown file from the JSON "
                        "under --out, and compile nothing")
    p.add_argument("--repredict", action="store_true",
                   help="predict the plain rows of --out's prediction.json again with the "
                        "model as it is now, against their stored compiled peaks; compile "
                        "nothing, write nothing (--models/--sizes/--targets filter when given)")
    p.add_argument("--files", type=Path, nargs="+",
                   help="with --repredict --plans: these plans files (default: --out's "
                        "plans-*.json)")
    p.add_argument("--write", action="store_true",
                   help="with --repredict: store the new predictions and their errors in "
                        "the files read (and, with --plans, the rankings); compiled peaks "
                        "kept, each row or entry notes the commit that predicted it")
    a = p.parse_args(argv)
    if a.docs:
        render_docs(a.docs, a.out)
        return 0
    if a.repredict:
        given = argv if argv is not None else __import__("sys").argv[1:]
        keep = {k: set(getattr(a, k).split(",")) for k in ("models", "sizes", "targets")
                if any(t == f"--{k}" or t.startswith(f"--{k}=") for t in given)}
        if a.plans:
            from benchmarks import prediction_plans
            return prediction_plans.repredict(
                sorted(a.out.glob("plans-*.json")) if a.files is None else a.files, keep,
                write=_meta_repredict(argv) if a.write else None)
        path = a.out / "prediction.json"
        doc = json.loads(path.read_text()) if path.exists() else {"rows": []}
        meta = _meta_repredict(argv) if a.write else None
        rc = repredict(doc["rows"], keep, meta)
        if meta is not None:
            path.write_text(json.dumps(doc, indent=1))
        return rc
    a.out.mkdir(parents=True, exist_ok=True)
    if a.plans:
        from benchmarks import prediction_plans
        return prediction_plans.run(a, argv)
    rows: list[dict[str, Any]] = []
    meta = {"jax": jax.__version__, "command": "python -m benchmarks.prediction "
            + " ".join(argv if argv is not None else __import__("sys").argv[1:])}
    for size in a.sizes.split(","):
        for name in a.models.split(","):
            for target in a.targets.split(","):
                w = _workload(name, size, target)
                for kind, fn in (("plain", plain_row), ("jaxmem", plan_row)):
                    if kind == "jaxmem" and not a.chosen:
                        continue
                    try:
                        r = fn(w, target)
                    except Exception as e:  # noqa: BLE001 - recorded; the run goes on
                        r = {"model": name, "size": size, "target": target, "step": kind,
                             "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
                    rows.append(r)
                    msg = r.get("error") or (f"pred {r['predicted'] / 2**20:9.2f} MiB  comp "
                                             f"{r['compiled'] / 2**20:9.2f} MiB  "
                                             f"{r['error_pct']:+6.1f}%")
                    print(f"{name:18s} {size:5s} {target:5s} {kind:6s} {msg}", flush=True)
                    (a.out / "prediction.json").write_text(
                        json.dumps({"meta": meta, "rows": rows}, indent=1))
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
