"""``python -m benchmarks.prediction --plans``: every candidate ``verify`` compiles, predicted.

For each zoo model (or corpus entry, ``corpus:NAME``) and target,
``jaxmem.optimize(step, donate_argnums=(0,)).plan(...)`` runs as it does for users (empty
plan cache); :func:`jaxmem.compiling.choose.compile_candidates` is wrapped for the run, so
the plain step and the candidates it compiles, and the figures ``verify`` chose on, are
read as they were made (what is chosen does not change). Each candidate gets the
predictions described in :mod:`benchmarks.prediction` and a row; each model and target a
ranking summary. Compiles one at a time (``JAXMEM_COMPILE_THREADS=1`` unless set) so a
shared machine's compile times stay comparable.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path
from typing import Any

import jax

import jaxmem
from benchmarks import zoo
from jaxmem.analyzing.analysis import from_program
from jaxmem.analyzing.costmodel import PROFILES, CostModel
from jaxmem.compiling import choose, plan_cache
from jaxmem.compiling.steps import rewrite_key

TIE = 0.01  # compiled peaks closer than this are a tie (jaxmem.xla.measure.PEAK_TIE: 0.01%)


def workload(name: str, size: str, target: str) -> Any:
    """The zoo model ``name``, or the corpus entry ``corpus:NAME`` (other people's train
    step, :mod:`benchmarks.external.corpus`) as a workload: ``args``, ``step`` and the
    sharding its arguments are placed with on a target (None: the first device)."""
    if not name.startswith("corpus:"):
        return zoo.make(name, size=size, abstract=True)
    from types import SimpleNamespace

    from benchmarks.external import corpus

    devices = None if target == "cpu" else jaxmem.targets.get(target).devices()
    e = corpus.make(name.removeprefix("corpus:"), size, devices)
    return SimpleNamespace(args=(e.state, e.batch), step=e.make_step(), sharding=e.sharding)


def placed(w: zoo.Workload, target: str) -> tuple[Any, ...]:
    """``w``'s arguments as they are compiled for ``target`` (on a target other than the
    CPU, placed on its devices with the workload's sharding)."""
    return w.args if target == "cpu" else jaxmem.targets.place(
        w.args, target, sharding=getattr(w, "sharding", None))


def _verify_all(w: zoo.Workload, target: str, compile_candidates: Any) -> Any:
    """``jaxmem.optimize(w.step, verify="all").plan`` on ``target`` with an empty plan
    cache, ``compile_candidates`` standing in for :func:`choose.compile_candidates` for the
    call; the plan chosen."""
    original = choose.compile_candidates
    plan_cache.clear_memory()
    choose.compile_candidates = compile_candidates
    try:
        return jaxmem.optimize(w.step, donate_argnums=(0,), verify="all").plan(
            *placed(w, target))
    finally:
        choose.compile_candidates = original


def captured(w: zoo.Workload, target: str) -> dict[str, Any]:
    """``verify``'s compiles of ``w`` on ``target``: step, candidates, compiled figures."""
    seen: list[tuple[Any, Any, Any, Any]] = []
    original = choose.compile_candidates

    def spy(step: Any, cands: Any) -> Any:
        base, compiled = original(step, cands)
        seen.append((step, cands, base, compiled))
        return base, compiled

    t0 = time.perf_counter()
    chosen = _verify_all(w, target, spy)
    seconds = time.perf_counter() - t0
    if not seen:
        raise RuntimeError(f"verify compiled no candidates (plan {chosen.strategy!r})")
    step, _, base, compiled = seen[-1]
    return {"step": step, "base": base, "compiled": compiled, "chosen": chosen,
            "seconds": seconds}


def _plain(step: Any, target: str) -> tuple[Any, Any, Any]:
    """``target``, the plain step's analysis on it, and its cost model."""
    t = jaxmem.targets.get(target)
    analysis = from_program(step.program, donated=step.donate_flat, platform=t.platform)
    return t, analysis, CostModel(analysis, t.profile if t.profile in PROFILES else None)


def _names(plans: list[Any]) -> list[str]:
    """The candidates' row names: their strategies, a repeated one suffixed (plan_auto's
    strict variant)."""
    names: list[str] = []
    for plan in plans:
        name = plan.strategy
        if name in names:
            name += " (strict: 5% per layer)" if name == "auto" else f" [{len(names)}]"
        names.append(name)
    return names


def predictions(cap: dict[str, Any], target: str) -> tuple[dict[str, Any], list[dict]]:
    """The plain step's row and one row per candidate: predictions and compiled peak."""
    step = cap["step"]
    t, analysis, model = _plain(step, target)
    plain = _row("plain", "plain", analysis.peak_bytes, None, cap["base"].figures)
    rows: list[dict[str, Any]] = []
    chosen = _identity(cap["chosen"])
    names = _names([c.candidate.plan for c in cap["compiled"]])
    for c, name in zip(cap["compiled"], names, strict=True):
        plan = c.candidate.plan
        kind = "builtin" if plan.loss_policy else "plan"
        t0 = time.perf_counter()
        try:
            rewritten = choose.rewritten_liveness(c.candidate, step, t.platform)
        except Exception as e:  # noqa: BLE001 - recorded; the others go on
            rewritten = None
            print(f"  {plan.strategy}: not analysed: {type(e).__name__}: {e}"[:200])
        ev = (model.evaluate(plan.recompute, plan.offload).peak if kind == "plan" else None)
        row = _row(name, kind, rewritten, ev, c.figures)
        row.update(analyse_s=round(time.perf_counter() - t0, 2),
                   n_recompute=len(plan.recompute), region_depth=plan.region_depth,
                   chosen=_identity(plan) == chosen)
        rows.append(row)
    return plain, rows


def _identity(plan: Any) -> Any:
    """What makes two candidates one program (the chosen plan is renamed and noted)."""
    return (plan.loss_policy, plan.loss_blocks) if plan.loss_policy else rewrite_key(plan)


def _row(name: str, kind: str, rewritten: int | None, model: int | None,
         fig: Any) -> dict[str, Any]:
    def err(p: int | None) -> float | None:
        return None if p is None or not fig.peak else round(100.0 * (p / fig.peak - 1.0), 2)
    return {"candidate": name, "kind": kind, "compiled": int(fig.peak), "flops": fig.flops,
            "rewritten": rewritten, "rewritten_error_pct": err(rewritten),
            "model": model, "model_error_pct": err(model)}


def ranking(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """How ``key``'s predictions rank ``rows`` against their compiled peaks: the pairs
    (compiled more than :data:`TIE` apart) in the same order (a predicted tie counts half),
    and the compiled peak of the predicted best against the best compiled peak."""
    rs = [r for r in rows if r.get(key) is not None]
    if len(rs) < 2:
        return None
    pairs, agree = 0, 0.0
    for a, b in combinations(rs, 2):
        if abs(a["compiled"] - b["compiled"]) <= TIE * max(a["compiled"], b["compiled"]):
            continue
        pairs += 1
        d_pred, d_comp = a[key] - b[key], a["compiled"] - b["compiled"]
        agree += 0.5 if d_pred == 0 else float((d_pred > 0) == (d_comp > 0))
    best = min(r["compiled"] for r in rs)
    pick = min(rs, key=lambda r: r[key])
    return {"n": len(rs), "pairs": pairs,
            "pairwise_agreement": round(agree / pairs, 3) if pairs else None,
            "predicted_best": pick["candidate"], "predicted_best_compiled": pick["compiled"],
            "compiled_best": min(rs, key=lambda r: r["compiled"])["candidate"],
            "compiled_best_peak": best,
            "predicted_best_over_best_pct": round(100.0 * (pick["compiled"] / best - 1), 2),
            "predicted_best_within_1pct": pick["compiled"] <= 1.01 * best}


def entry(name: str, size: str, target: str) -> dict[str, Any]:
    """One model on one target: its plain row, candidate rows and ranking summaries."""
    cap = captured(workload(name, size, target), target)
    plain, rows = predictions(cap, target)
    plans = [r for r in rows if r["kind"] == "plan"]
    overall = min(r["compiled"] for r in rows)
    rank = {"plans_rewritten": ranking(plans, "rewritten"),
            "plans_model": ranking(plans, "model"),
            "all_rewritten": ranking(rows, "rewritten")}
    for r in rank.values():  # the predicted best against every candidate's best
        if r:
            r["predicted_best_over_all_pct"] = round(
                100.0 * (r["predicted_best_compiled"] / overall - 1), 2)
    return {"model": name, "size": size, "target": target, "plain": plain,
            "candidates": rows, "ranking": rank, "chosen": cap["chosen"].strategy,
            "optimize_plan_s": round(cap["seconds"], 1)}


def _meta(argv: list[str] | None) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"command": "python -m benchmarks.prediction "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git_commit": commit, "jax": jax.__version__, "jaxlib": jax.lib.__version__,
            "ranking_tie": TIE}


def run(a: Any, argv: list[str] | None) -> int:
    """Every (size, model, target) of the parsed arguments ``a``; JSON after each."""
    os.environ.setdefault("JAXMEM_COMPILE_THREADS", "1")
    meta = _meta(argv)
    done: dict[Path, list[dict[str, Any]]] = {}
    for size in a.sizes.split(","):
        for target in a.targets.split(","):
            path = a.out / (f"plans-{target}.json" if size == "bench"
                            else f"plans-{target}-{size}.json")
            for name in a.models.split(","):
                try:
                    e = entry(name, size, target)
                except Exception as ex:  # noqa: BLE001 - recorded; the run goes on
                    e = {"model": name, "size": size, "target": target,
                         "error": f"{type(ex).__name__}: {ex}".splitlines()[0][:300]}
                done.setdefault(path, []).append(e)
                print(summary_line(e), flush=True)
                path.write_text(json.dumps({"meta": meta, "models": done[path]}, indent=1))
                path.with_suffix(".md").write_text(markdown(meta, done[path]))
    return 0


def summary_line(e: dict[str, Any]) -> str:
    if e.get("error"):
        return f"{e['model']:12s} {e['size']:5s} {e['target']:5s} error: {e['error']}"
    r = e["ranking"]
    bits = [f"{k}: agree {v['pairwise_agreement']}, best+{v['predicted_best_over_best_pct']}%"
            for k, v in r.items() if v]
    return (f"{e['model']:12s} {e['size']:5s} {e['target']:5s} "
            f"{len(e['candidates'])} candidates; " + "; ".join(bits))


def _mib(x: int | None) -> str:
    return "" if x is None else f"{x / 2**20:.2f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1f}%"


def markdown(meta: dict[str, Any], models: list[dict[str, Any]]) -> str:
    """The candidates' table and the ranking summaries of ``models``."""
    out = [f"`{meta.get('command')}` ({meta.get('date')}, commit "
           f"{str(meta.get('git_commit'))[:10]}, jax {meta.get('jax')})", ""]
    again = {(m["command"], str(m["git_commit"])[:10]) for e in models
             if (m := e.get("repredicted"))}
    out += [f"Predictions made again, compiled peaks kept: `{c}` (commit {g})" for c, g in
            sorted(again)] + ([""] if again else [])
    out += ["| model | target | candidate | kind | compiled MiB | rewritten MiB | error | "
           "model MiB | error |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for e in models:
        if e.get("error"):
            out.append(f"| {e['model']} | {e['target']} | error: {e['error'][:80]} |"
                       " | | | | | |")
            continue
        for r in [e["plain"]] + e["candidates"]:
            name = r["candidate"] + (" (chosen)" if r.get("chosen") else "")
            out.append(f"| {e['model']} | {e['target']} | {name} | {r['kind']} | "
                       f"{_mib(r['compiled'])} | {_mib(r.get('rewritten'))} | "
                       f"{_pct(r.get('rewritten_error_pct'))} | {_mib(r.get('model'))} | "
                       f"{_pct(r.get('model_error_pct'))} |")
    out += ["", "| model | target | prediction | n | pairs | pairwise agreement | "
            "predicted best | its compiled over the set's best | over every candidate's "
            "best |", "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for e in models:
        for k, v in (e.get("ranking") or {}).items():
            if v:
                out.append(f"| {e['model']} | {e['target']} | {k} | {v['n']} | {v['pairs']} "
                           f"| {v['pairwise_agreement']} | {v['predicted_best']} | "
                           f"{v['predicted_best_over_best_pct']:+.2f}% | "
                           f"{v['predicted_best_over_all_pct']:+.2f}% |")
    return "\n".join(out) + "\n"


class _Candidates(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by :func:`candidates`'s stand-in for ``compile_candidates``: the candidates
    are known, nothing is compiled."""

    def __init__(self, step: Any, cands: Any) -> None:
        super().__init__("candidates captured")
        self.step, self.cands = step, cands


def candidates(w: zoo.Workload, target: str) -> tuple[Any, list[Any]]:
    """The step and the candidates ``verify="all"`` would compile for ``w`` on ``target``
    (read where they are handed to the compiler), none compiled."""
    def stop(step: Any, cands: Any) -> Any:
        raise _Candidates(step, cands)

    try:
        _verify_all(w, target, stop)
    except _Candidates as got:
        return got.step, list(got.cands)
    raise RuntimeError("verify compiled no candidates")


def repredicted(e: dict[str, Any]) -> list[dict[str, Any]]:
    """The stored candidate rows of one ``--plans`` entry ``e``, each with ``now``: its
    rewritten step's liveness predicted with the model as it is now, and ``model_now``:
    the cost model's (plans only). Rows are matched by candidate name as
    :func:`predictions` names them; a stored row no candidate matches gets neither."""
    step, cands = candidates(workload(e["model"], e["size"], e["target"]), e["target"])
    t, analysis, model = _plain(step, e["target"])
    named = dict(zip(_names([c.plan for c in cands]), cands, strict=True))
    rows = []
    for r in e["candidates"]:
        r = dict(r)
        c = named.get(r["candidate"])
        if c is not None:
            r["now"] = choose.rewritten_liveness(c, step, t.platform)
            if not c.plan.loss_policy:
                r["model_now"] = model.evaluate(c.plan.recompute, c.plan.offload).peak
        rows.append(r)
    plain = dict(e["plain"], now=analysis.peak_bytes)
    return [plain] + rows


def rewrite_entry(e: dict[str, Any], rows: list[dict[str, Any]], meta: dict[str, Any]
                  ) -> None:
    """Store :func:`repredicted`'s ``rows`` in the ``--plans`` entry ``e``: each row's
    ``rewritten`` (and a plan's ``model``) becomes its new prediction, errors and the
    ranking summaries are recomputed as :func:`entry` makes them; compiled peaks are kept.
    A row no candidate matched keeps its stored figures."""
    def new(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k not in ("now", "model_now")}
    plain, *cands = rows
    e["plain"] = _updated(new(plain), plain.get("now"), None)
    e["candidates"] = [_updated(new(r), r.get("now"), r.get("model_now")) for r in cands]
    plans = [r for r in e["candidates"] if r["kind"] == "plan"]
    overall = min(r["compiled"] for r in e["candidates"])
    rank = {"plans_rewritten": ranking(plans, "rewritten"),
            "plans_model": ranking(plans, "model"),
            "all_rewritten": ranking(e["candidates"], "rewritten")}
    for r in rank.values():
        if r:
            r["predicted_best_over_all_pct"] = round(
                100.0 * (r["predicted_best_compiled"] / overall - 1), 2)
    e["ranking"] = rank
    e["repredicted"] = meta


def _updated(r: dict[str, Any], rewritten: int | None, model: int | None) -> dict[str, Any]:
    def err(p: int | None) -> float | None:
        return None if p is None or not r["compiled"] else round(
            100.0 * (p / r["compiled"] - 1.0), 2)
    if rewritten is not None:
        r["rewritten"], r["rewritten_error_pct"] = int(rewritten), err(rewritten)
    if model is not None:
        r["model"], r["model_error_pct"] = int(model), err(model)
    return r


def repredict(paths: list[Path], keep: dict[str, set[str]],
              write: dict[str, Any] | None = None) -> int:
    """Every candidate of the ``--plans`` files ``paths`` (``keep``: ``{"models"|"sizes"|
    "targets": names}``) predicted again with the model as it is now (rewritten step's
    liveness, and the cost model's for plans) against its stored compiled peak, nothing
    compiled: per row the stored and the new error, then the counts within 5% and 10%, the
    largest errors, and per step whether the lowest new prediction of the plans compiles
    within 1% of their best and their pairwise agreement (:func:`ranking`). ``write``: the
    meta of this run, to store the new figures in the files (:func:`rewrite_entry`)."""
    errors: dict[str, list[float]] = {"rewritten": [], "model": []}
    steps = held = 0
    for path in paths:
        doc = json.loads(Path(path).read_text())
        for e in doc["models"]:
            if e.get("error") or any(e[k[:-1]] not in v for k, v in keep.items()):
                continue
            rows = repredicted(e)
            print(f"{e['model']} {e['size']} {e['target']} ({path})", flush=True)
            if write is not None:
                rewrite_entry(e, rows, write)
            for r in rows:
                if "now" not in r:
                    print(f"  {r['candidate'][:48]:48s} not among today's candidates")
                    continue
                err = 100 * (r["now"] / r["compiled"] - 1)
                errors["rewritten"].append(err)
                line = (f"  {r['candidate'][:48]:48s} compiled {r['compiled'] / 2**20:9.2f} "
                        f"MiB  rewritten stored {_pct(r['rewritten_error_pct']):>7s} now "
                        f"{err:+6.1f}%")
                if "model_now" in r:
                    m = 100 * (r["model_now"] / r["compiled"] - 1)
                    errors["model"].append(m)
                    line += f"  model now {m:+6.1f}%"
                print(line, flush=True)
            plans = [dict(r, rewritten=r["now"]) for r in rows
                     if r["kind"] == "plan" and "now" in r]
            rank = ranking(plans, "rewritten")
            if rank:
                steps += 1
                held += rank["predicted_best_within_1pct"]
                print(f"  plans by rewritten now: agree {rank['pairwise_agreement']}, "
                      f"best +{rank['predicted_best_over_best_pct']}%", flush=True)
        if write is not None:
            Path(path).write_text(json.dumps(doc, indent=1))
            Path(path).with_suffix(".md").write_text(markdown(doc["meta"], doc["models"]))
    if not errors["rewritten"]:
        raise SystemExit("no stored --plans entry matches")
    for k, errs in errors.items():
        if errs:
            print(f"\n{k}: {len(errs)} rows, {sum(abs(x) <= 5 for x in errs)} within 5%, "
                  f"{sum(abs(x) <= 10 for x in errs)} within 10%; largest over "
                  f"{max(errs):+.1f}%, under {min(errs):+.1f}%, mean absolute "
                  f"{sum(abs(x) for x in errs) / len(errs):.1f}%")
    print(f"the lowest rewritten prediction compiles within 1% of the best plan on {held} "
          f"of {steps} steps")
    return 0
