"""``python -m benchmarks.compile_phases``: where a rewritten step's compile time goes.

Issue 37's time targets are bounded below by the compile of the plan that runs: on the H100
target a rewritten step compiles slower than the plain one. This compiles, one after
another in one fresh process (nothing else compiling beside it), the plain step, each
candidate plan of ``verify`` (:func:`jaxmem.compiling.choose.rewrite_candidates`) and the
block plan at each block depth (what a budget search falls back to), and records for each:
the compile's seconds, its compiled peak, the StableHLO operations of its lowering (by
kind, the kinds that grew most over the plain step's) and XLA's own timers (``HLO pass:
...``, ``RunHloPasses``, ``RunBackend``: XLA's scoped logging timers, read from its log with
``TF_CPP_VMODULE`` set for the process).

Usage::

    python -m benchmarks.compile_phases --model transformer --size bench --target h100

Writes ``benchmarks/results/compile_phases-<target>-<model>-<size>.json`` and ``.md``.

``--strip-barriers``: the same programs with every ``optimization_barrier`` the rewrite
emits made the identity (written with ``-nobarriers`` in the name): how much of a plan's
compile time is the recomputation the barriers keep apart from the forward pass (without
them XLA's CSE folds it back, and the peaks fall to the plain step's).

``--programs plans,blocks,builtins``: what is compiled after the plain step (default
``plans,blocks``); ``builtins`` adds ``jax.checkpoint(policy=dots_saveable)`` around the
loss and around each block, as ``verify="builtins"`` compiles them: what one compile of the
anchors' own rematerialisation costs on the same compiler. A choice other than the default
is written with it in the name (``...-plans-builtins``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
MARK = "@@compile_phases"

_CHILD = r"""
import collections, json, re, sys, time
import jax
import jaxmem
from jaxmem.compiling import choose, predicted
from jaxmem.planning.strategies import plan_blocks
from jaxmem.planning.block_plans import block_depths
from jaxmem.xla import measure
from benchmarks.workload import load
model, size, target = sys.argv[1:4]
MARK = sys.argv[4]
if sys.argv[5] == "strip":  # every optimization_barrier the rewrite emits is the identity
    from jax import lax as _lax
    import jaxmem.rewriting.emitters as _emitters, jaxmem.rewriting.settle as _settle
    class _NoBarriers:
        def __getattr__(self, name):
            return getattr(_lax, name)
        @staticmethod
        def optimization_barrier(x):
            return x
    _emitters.lax = _settle.lax = _NoBarriers()
w = load(model, size, target)
state, batch = w.state, w.batch
kinds = set(sys.argv[6].split(","))
got = {}
def captured(plan, analysis, step, options):
    got.update(analysis=analysis, step=step, donated=plan.donated,
               cands=choose.rewrite_candidates(plan, analysis, step, options))
    raise KeyboardInterrupt  # stop before anything is compiled
predicted.rewrite_candidates = captured
try:
    jaxmem.optimize(w.step).lower(state, batch)
except KeyboardInterrupt:
    pass
step, analysis = got["step"], got["analysis"]
programs = [("plain", step.plain)]
if "plans" in kinds:
    programs += [(c.plan.strategy, c.jitted) for c in got["cands"]]
if "blocks" in kinds:
    programs += [(f"blocks(depth={d}) [budget fallback]", step.rewrite(plan_blocks(analysis, d)))
                 for d in block_depths(analysis.program)]
if "builtins" in kinds:  # jax.checkpoint(policy=dots_saveable) around the loss / its blocks
    programs += [(f"{c.plan.strategy} [built-in]", c.jitted)
                 for c in choose.builtin_candidates(analysis, step, got["donated"])[0]]
def ops(text):
    return collections.Counter(re.findall(r"= \"?(stablehlo\.[a-z_]+)", text))
for name, jitted in programs:
    lowered = jitted.lower(*step.flat)
    print(f"{MARK} start {name}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    exe = measure.compile(lowered)
    seconds = time.perf_counter() - t
    print(f"{MARK} end", file=sys.stderr, flush=True)
    print(json.dumps({"program": name, "seconds": round(seconds, 2),
                      "peak": measure.figures(exe).peak,
                      "ops": dict(ops(lowered.as_text()))}), flush=True)
"""

#: XLA's scoped logging timers (GpuCompiler's phases, each HLO pass) for the child's log.
VMODULE = "hlo_pass_pipeline=2,gpu_compiler=1,compile_module_to_llvm_ir=1,cpu_compiler=1"


def timers(log: str) -> list[dict[str, float]]:
    """Per compile (between the child's markers), XLA's timers summed by name, seconds."""
    out: list[dict[str, float]] = []
    cur: collections.Counter | None = None
    for line in log.splitlines():
        if f"{MARK} start" in line:
            cur = collections.Counter()
        elif f"{MARK} end" in line and cur is not None:
            out.append(dict(cur))
            cur = None
        elif cur is not None:
            m = re.search(r"\] (.*?) time: ([\d.]+) (s|ms|us)\b", line)
            if m:
                scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(3)]
                cur[re.sub(r" for \S+$", "", m.group(1))] += float(m.group(2)) * scale
    return out


#: What ``--programs`` may name: the plain step is always compiled first.
PROGRAMS = ("plans", "blocks", "builtins")


def run(model: str, size: str, target: str, strip: bool = False,
        programs: str = "plans,blocks") -> list[dict[str, Any]]:
    """Each program's record (a fresh process for the whole step)."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=VMODULE)
    if target != "cpu":
        env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    r = subprocess.run([sys.executable, "-c", _CHILD, model, size, target, MARK,
                        "strip" if strip else "keep", programs], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    for row, t in zip(rows, timers(r.stderr), strict=False):
        row["xla_timers"] = dict(sorted(t.items(), key=lambda kv: -kv[1]))
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    plain = rows[0]
    n0 = sum(plain["ops"].values())
    lines = [f"`{meta['command']}` (commit {meta['git_commit'][:10]}, {meta['date']}, jax "
             f"{meta['jax']}; one process, one compile at a time). Seconds of each compile, "
             "its StableHLO operations, XLA's HLO passes and backend (its own timers), "
             "the two slowest passes and the operation kinds that grew most.", "",
             "| program | compile s (x plain) | peak MiB | StableHLO ops (x plain) | "
             "HLO passes s | backend s | slowest passes | grew most |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        t = r.get("xla_timers", {})
        passes = [(k.removeprefix("HLO pass: "), v) for k, v in t.items()
                  if k.startswith("HLO pass: ")][:2]
        n = sum(r["ops"].values())
        grew = sorted(((k, v - plain["ops"].get(k, 0)) for k, v in r["ops"].items()),
                      key=lambda kv: -kv[1])[:3]
        hlo = next((v for k, v in t.items() if k.endswith("RunHloPasses")), None)
        backend = next((v for k, v in t.items() if k.endswith("RunBackend")), None)
        lines.append(
            f"| {r['program']} | {r['seconds']:.2f} ({r['seconds'] / plain['seconds']:.2f}x) "
            f"| {r['peak'] / 2**20:.2f} | {n} ({n / n0:.2f}x) | "
            f"{'' if hlo is None else f'{hlo:.2f}'} | "
            f"{'' if backend is None else f'{backend:.2f}'} | "
            + ", ".join(f"{k} {v:.2f}" for k, v in passes) + " | "
            + ("" if r is plain else ", ".join(f"{k.removeprefix('stablehlo.')} +{d}"
                                               for k, d in grew if d > 0)) + " |")
    return "\n".join(lines) + "\n"


def step_arguments(doc: str, model: str) -> argparse.ArgumentParser:
    """The parser of a compile benchmark of one step: ``--model`` (default ``model``),
    ``--size``, ``--target``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default=model)
    ap.add_argument("--size", default="bench")
    ap.add_argument("--target", default="h100")
    return ap


def write(module: str, argv: list[str] | None, stem: str, rows: list[dict[str, Any]],
          markdown_of: Callable[[dict[str, Any], list[dict[str, Any]]], str]
          ) -> dict[str, Any]:
    """``rows`` with the run's metadata written to ``benchmarks/results/<stem>.json`` and,
    as ``markdown_of`` formats them, ``.md`` (printed too)."""
    import jax
    meta = {"command": f"python -m benchmarks.{module} " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                         capture_output=True, text=True).stdout.strip(),
            "cpus": os.cpu_count()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2)
                                      + "\n")
    md = markdown_of(meta, rows)
    (OUT / f"{stem}.md").write_text(md)
    print(md)
    return {"meta": meta, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = step_arguments(__doc__, "transformer")
    ap.add_argument("--strip-barriers", action="store_true",
                    help="compile each rewrite with its optimization_barriers made the "
                         "identity (a diagnosis: what the barriers' kept recomputation costs "
                         "in compile time; the peaks are not the plans')")
    ap.add_argument("--programs", default="plans,blocks",
                    help="what to compile after the plain step, comma-separated: plans "
                         "(verify's candidates), blocks (the budget search's block plan at "
                         "each depth), builtins (jax.checkpoint(policy=dots_saveable) around "
                         "the loss and around each block, as verify='builtins' compiles "
                         "them)")
    args = ap.parse_args(argv)
    unknown = set(args.programs.split(",")) - set(PROGRAMS)
    if unknown:
        ap.error(f"--programs: unknown {sorted(unknown)}; choose from {PROGRAMS}")
    rows = run(args.model, args.size, args.target, args.strip_barriers, args.programs)
    stem = (f"compile_phases-{args.target}-{args.model.replace(':', '-')}-{args.size}"
            + ("-nobarriers" if args.strip_barriers else "")
            + ("" if args.programs == "plans,blocks"
               else "-" + args.programs.replace(",", "-")))
    return write("compile_phases", argv, stem, rows, markdown)


if __name__ == "__main__":
    main()
