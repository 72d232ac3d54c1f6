"""The budget search's block plans, predicted two ways and compiled.

``python -m benchmarks.budget_blocks --models transformer,llama,corpus:eqx_bn_cnn
[--size bench] [--target h100]`` takes each step as ``jaxmem.optimize`` traces it and, for
every block plan the ranked budget search may compile
(:func:`jaxmem.planning.budget.fallbacks.block_variants`), records

- the cost model's peak (:func:`~jaxmem.planning.budget.fallbacks.predicted_peak`,
  calibrated on the plain step's compiled peak as the search calibrates it);
- the liveness model's peak of the plan's rewritten step (what the search's ``rewritten``
  predictor gives, :meth:`jaxmem.compiling.plan_step._Compiles.rewritten`);
- XLA's compiled peak and the compile's seconds (one at a time, in one process per model).

Results: ``benchmarks/results/budget_blocks-<target>.{json,md}``; the ranked search's
:data:`~jaxmem.planning.budget.ranked_blocks.REWRITTEN_OVER` is checked against them by
``tests/test_prediction.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"

_CHILD = r"""
import json, sys, time
import jaxmem
from jaxmem.analyzing.costmodel import CostModel
from jaxmem.analyzing.liveness import liveness
from jaxmem.compiling import predicted
from jaxmem.planning.budget import fallbacks
from jaxmem.planning.budget.fallbacks import block_variants, predicted_peak
from jaxmem.tracing.program import from_jaxpr
from jaxmem.xla import measure
from benchmarks.workload import load
model, size, target, unfenced = sys.argv[1:5]
w = load(model, size, target)
got = {}
def captured(plan, analysis, step, options):  # the step and analysis verify would use
    got.update(analysis=analysis, step=step)
    raise KeyboardInterrupt
predicted.rewrite_candidates = captured
try:
    jaxmem.optimize(w.step).lower(w.state, w.batch)
except KeyboardInterrupt:
    pass
step, analysis = got["step"], got["analysis"]
t = time.perf_counter()
plain = measure.figures(measure.compile(step.plain.lower(*step.flat))).peak
print(json.dumps({"program": "plain", "compiled": plain, "model": analysis.peak_bytes,
                  "seconds": round(time.perf_counter() - t, 2)}), flush=True)
cm = CostModel(analysis, None, base_peak=plain)
for depth, p in block_variants(analysis):
    rec = {"program": p.strategy, "depth": depth, "model": predicted_peak(cm, p),
           "recompute_flops": p.recompute_flops}
    t = time.perf_counter()
    jitted = step.rewrite(p)
    traced = jitted.trace(*step.flat)
    rec["rewritten"] = liveness(from_jaxpr(traced.jaxpr), donated=step.donate_flat,
                                platform=step.platform)[0]
    rec["rewritten_seconds"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    rec["compiled"] = measure.figures(measure.compile(traced.lower())).peak
    rec["seconds"] = round(time.perf_counter() - t, 2)
    if unfenced == "1":  # the same plan with its gradients unfenced (the retry when none fits)
        traced = step.rewrite(fallbacks.unfenced(p)).trace(*step.flat)
        rec["unfenced_rewritten"] = liveness(from_jaxpr(traced.jaxpr), donated=step.donate_flat,
                                             platform=step.platform)[0]
        rec["unfenced_compiled"] = measure.figures(measure.compile(traced.lower())).peak
    print(json.dumps(rec), flush=True)
"""


def _pct(pred: int, compiled: int) -> float:
    return round(100 * (pred / compiled - 1), 1)


def run(model: str, size: str, target: str, unfenced: bool = False) -> list[dict]:
    """Every block plan of ``model`` (one child process): its rows, the plain step first;
    ``unfenced``: each also rewritten, predicted and compiled with its gradients unfenced."""
    r = subprocess.run([sys.executable, "-c", _CHILD, model, size, target,
                        "1" if unfenced else "0"], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        row["model_error_pct"] = _pct(row["model"], row["compiled"])
        if "rewritten" in row:
            row["rewritten_error_pct"] = _pct(row["rewritten"], row["compiled"])
    return rows


def _markdown(result: dict) -> str:
    mib = 2 ** 20
    lines = [f"`{result['command']}` ({result['date']}, commit {result['git_commit'][:10]})",
             "",
             "Each block plan the ranked budget search may compile: the cost model's peak "
             "(calibrated on the plain step's compiled peak), the liveness model's peak of "
             "the plan's rewritten step, and XLA's compiled peak.", "",
             "| model | plan | compiled MiB | cost model MiB | error | rewritten step MiB "
             "| error | compile s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in result["models"].items():
        for r in rows:
            rew = (f"{r['rewritten'] / mib:.2f} | {r['rewritten_error_pct']:+.1f}%"
                   if "rewritten" in r else " | ")
            lines.append(f"| {name} | {r['program']} | {r['compiled'] / mib:.2f} | "
                         f"{r['model'] / mib:.2f} | {r['model_error_pct']:+.1f}% | {rew} | "
                         f"{r['seconds']:.2f} |")
    pairs = [r for rows in result["models"].values() for r in rows if "unfenced_compiled" in r]
    if pairs:
        lines += ["", "Unfenced (the gradients left where the scheduler puts them):", "",
                  "| model | plan | fenced: rewritten / compiled MiB | unfenced: rewritten / "
                  "compiled MiB | same direction |", "|---|---|---:|---:|---|"]
        for name, rows in result["models"].items():
            for r in rows:
                if "unfenced_compiled" in r:
                    same = ((r["unfenced_rewritten"] < r["rewritten"])
                            == (r["unfenced_compiled"] < r["compiled"]))
                    lines.append(
                        f"| {name} | {r['program']} | {r['rewritten'] / mib:.2f} / "
                        f"{r['compiled'] / mib:.2f} | {r['unfenced_rewritten'] / mib:.2f} / "
                        f"{r['unfenced_compiled'] / mib:.2f} | {'yes' if same else 'no'} |")
    blocks = [r for rows in result["models"].values() for r in rows if "rewritten" in r]
    if blocks:
        me = [r["model_error_pct"] for r in blocks]
        re_ = [r["rewritten_error_pct"] for r in blocks]
        lines += ["", f"{len(blocks)} block plans: cost model {min(me):+.1f}% to {max(me):+.1f}%,"
                  f" rewritten step {min(re_):+.1f}% to {max(re_):+.1f}% "
                  f"(largest rewritten over compiled: "
                  f"{max(r['rewritten'] / r['compiled'] for r in blocks):.3f}x)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="transformer,llama,resnet,corpus:eqx_bn_cnn,"
                    "corpus:tx_resnet18_ts")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--unfenced", action="store_true",
                    help="also each plan unfenced (results ...-unfenced.*)")
    args = ap.parse_args(argv)
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    result = {"command": " ".join(["python -m benchmarks.budget_blocks",
                                    *(sys.argv[1:] if argv is None else argv)]),
              "date": datetime.datetime.now(datetime.UTC).isoformat(
                  timespec="seconds"),
              "git_commit": git, "size": args.size, "target": args.target, "models": {}}
    for name in args.models.split(","):
        result["models"][name] = run(name, args.size, args.target, args.unfenced)
        print(f"{name}: {len(result['models'][name]) - 1} block plans", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / f"budget_blocks-{args.target}{'-unfenced' if args.unfenced else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))
    return result


if __name__ == "__main__":
    main()
