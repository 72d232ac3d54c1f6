"""How well ``Analysis.peak_bytes`` predicts the compiled peak, per zoo model and target.

``python -m benchmarks.prediction`` builds every zoo model (abstract state, nothing is
initialised), predicts its train step's peak with ``jaxmem.analyze(step, state, batch,
donate_argnums=0)`` for the arguments' target, compiles the same step with ``jax.jit(step,
donate_argnums=0)`` for that target and reads ``argument + output + temp - alias`` of
``memory_analysis()``. With ``--plans`` it does the same for the step ``jaxmem.optimize``
rewrites (its jaxpr, ``jaxmem.optimize(step).trace(...)``, analysed with the state donated,
against the compiled figures of the plan it verified).

Prints a table (model, size, target, step, predicted, compiled, error %) and writes
``prediction.json`` under ``--out`` after every row (partial results survive an interrupt).

Example::

    python -m benchmarks.prediction --sizes test,bench --targets cpu,h100
    python -m benchmarks.prediction --sizes test --targets cpu,h100 --plans
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax

import jaxmem
from benchmarks import zoo
from jaxmem import measure
from jaxmem.analysis import from_program
from jaxmem.program import from_jaxpr

DEFAULT_OUT = Path("benchmarks/results/prediction")


def _args(w: zoo.Workload, target: str) -> Any:
    return w.args if target == "cpu" else jaxmem.targets.place(w.args, target)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prediction",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="test,bench")
    p.add_argument("--targets", default="cpu,h100")
    p.add_argument("--models", default=",".join(zoo.names()))
    p.add_argument("--plans", action="store_true",
                   help="also the step jaxmem.optimize rewrites (compiles its candidates)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    meta = {"jax": jax.__version__, "command": "python -m benchmarks.prediction "
            + " ".join(argv if argv is not None else __import__("sys").argv[1:])}
    for size in a.sizes.split(","):
        for name in a.models.split(","):
            w = zoo.make(name, size=size, abstract=True)
            for target in a.targets.split(","):
                for kind, fn in (("plain", plain_row), ("jaxmem", plan_row)):
                    if kind == "jaxmem" and not a.plans:
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
