"""``python -m benchmarks.planning_phases``: where a cold ``jaxmem.optimize`` first call's
seconds go, phase by phase, with the heap frozen during planning or walked by the collector.

``benchmarks.first_call`` times the first call whole; this times jaxmem's own phases inside
it (default ``verify=True``, cold plan cache, each run a fresh process), read by wrapping
the functions that do them:

- ``trace``: the step traced and its program built
  (:func:`jaxmem.compiling.trace_step.trace_step`);
- ``candidates``: the automatic mode's candidate plans
  (:func:`jaxmem.compiling.choose.rewrite_candidates`);
- ``rewritten steps``: the candidates' rewritten programs built
  (:func:`jaxmem.compiling.choose.rewritten_program`, to the growth limit) and their
  liveness analysed (:func:`jaxmem.compiling.choose.rewritten_peak`), with how many;
- ``lowering``: the chosen plans lowered before their compiles are handed to threads;
- ``before the compile``: from the call to the first XLA compile's start;
- ``XLA compile``: the compiles jaxmem asks for (:func:`jaxmem.xla.measure.compile`), wall;
- ``total``: the call, up to its executable (compile-only on a ``--target``).

``--heap walked`` replaces :func:`jaxmem.compiling.heap.frozen` with a context that does
nothing (the objects that exist before the miss are scanned by CPython's collector, as
before that was added); ``--heap both`` alternates the two, run by run.

Usage::

    python -m benchmarks.planning_phases --model corpus:tx_resnet18_ts --size bench \\
        --target h100 --heap both --repeat 3

Writes ``benchmarks/results/planning_phases-<target>-<model>-<size>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_CHILD = r"""
import contextlib, json, resource, sys, time
import jax
model, size, target, heap_mode = sys.argv[1:5]
from benchmarks.workload import load
import jaxmem
from jaxmem.compiling import build, choose, heap, predicted
from jaxmem.xla import measure
w = load(model, size, target)
jax.block_until_ready((w.state, w.batch))
if heap_mode == "walked":
    heap.frozen = contextlib.nullcontext
spans = {}
def timed(owner, name, phase):
    f = getattr(owner, name)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spans.setdefault(phase, []).append((t - T0, time.perf_counter() - T0))
    setattr(owner, name, g)
timed(build, "trace_step", "trace")
timed(predicted, "rewrite_candidates", "candidates")
timed(choose, "rewritten_program", "rewritten steps")
timed(choose, "rewritten_peak", "rewritten steps")
timed(predicted._Compiles, "start", "lowering")
timed(measure, "compile", "XLA compile")
T0 = time.perf_counter()
step = jaxmem.optimize(w.step)
if target == "cpu":
    jax.block_until_ready(step(w.state, w.batch))
else:
    step.lower(w.state, w.batch).compile()
total = time.perf_counter() - T0
rec = {k: sum(b - a for a, b in v) for k, v in spans.items()}
rec["rewritten steps n"] = len(spans.get("rewritten steps", ()))
rec["before the compile"] = min((a for a, _ in spans.get("XLA compile", [])), default=total)
rec["total"] = total
rec["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(rec))
"""

PHASES = ("trace", "candidates", "rewritten steps", "lowering", "before the compile",
          "XLA compile", "total", "max_rss_mib")


def _run(model: str, size: str, target: str, heap: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAXMEM_PLAN_CACHE_DIR", None)   # cold: no plan cache across the runs
    out = subprocess.run([sys.executable, "-c", _CHILD, model, size, target, heap],
                         capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"the child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--target", default="cpu", help="cpu (run the call), or a "
                    "jaxmem.targets name such as h100 (compile-only)")
    ap.add_argument("--heap", default="frozen", choices=("frozen", "walked", "both"))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each; medians kept")
    args = ap.parse_args(argv)
    heaps = ["walked", "frozen"] if args.heap == "both" else [args.heap]
    runs: dict[str, list[dict[str, float]]] = {h: [] for h in heaps}
    for _ in range(args.repeat):
        for h in heaps:   # alternated: the machine's drift falls on both alike
            runs[h].append(_run(args.model, args.size, args.target, h))
    result = {"command": "python -m benchmarks.planning_phases "
              + " ".join(sys.argv[1:] if argv is None else argv),
              "load_at_start": os.getloadavg()[0], "runs": runs,
              "median": {h: {p: statistics.median(r.get(p, 0.0) for r in rs) for p in PHASES}
                         for h, rs in runs.items()}}
    name = args.model.replace(":", "-")
    stem = RESULTS / f"planning_phases-{args.target}-{name}-{args.size}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_markdown(result, heaps))
    print(_markdown(result, heaps))
    return result


def _markdown(result: dict, heaps: list[str]) -> str:
    med = result["median"]
    n = {h: statistics.median(r.get("rewritten steps n", 0) for r in result["runs"][h])
         for h in heaps}
    lines = [f"`{result['command']}`: medians of {len(result['runs'][heaps[0]])} run(s), "
             "each a fresh process; seconds (peak RSS in MiB).", "",
             "| phase | " + " | ".join(f"heap {h}" for h in heaps) + " |",
             "|---|" + "---:|" * len(heaps)]
    for p in PHASES:
        label = f"{p} ({', '.join(f'{n[h]:g}' for h in heaps)} calls)" \
            if p == "rewritten steps" else p
        lines.append(f"| {label} | " + " | ".join(f"{med[h][p]:.2f}" for h in heaps) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
