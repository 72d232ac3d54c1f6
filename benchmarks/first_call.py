"""First-call time: ``jax.jit`` against ``jaxmem.optimize`` with a cold and a warm plan cache.

Each measurement runs in a fresh Python process (no JAX trace or compile cache carried
over; JAX's persistent compilation cache off), timing the first call of the step from
decoration to the result being ready: trace, plan, compile and run. ``cold``: an empty plan
cache directory; ``warm``: the directory the cold run filled (a restart, or another host
sharing it); ``background``: an empty plan cache directory and
``verify="background"`` (the first call runs one unverified candidate plan, the others
compile in a thread after it; ``verified_seconds`` is the time until the verified plan is
in place, ``step.plan`` waiting for it). Wall seconds and CPU seconds (user + system of the
process, every thread summed, and of the subprocesses it waited for: compiling for an
NVIDIA target, XLA runs ``ptxas`` in subprocesses, 3.48 of a ResNet18 compile's 9.23 CPU
seconds; before 2026-12-07 they were not counted) are both recorded: on a shared machine
the wall time of one run swings with the load, its CPU time much less.

``cold`` and ``warm`` run ``optimize``'s default ``verify=True`` (since issue 37: the
best-predicted candidates compiled in full, the plain step only when the model's margin is
not there, :mod:`jaxmem.compiling.predicted`); ``builtins``: an empty plan cache directory
and ``verify="builtins"`` (the default before: the three best-predicted plans, the plain
step and the two built-in policies compiled, the lowest kept); ``predicted``: the
default's earlier name, for results recorded before the change.

``budget``: an empty plan cache directory and ``budget=--budget`` (default 0.5: the budget
search's compiles; a budget no plan meets raises ``BudgetError``, recorded as ``error``);
``budget_warm``: the same budget again on the directory the ``budget`` run filled;
``budget_exhaustive``: the same with ``Budget(--budget, search="exhaustive")``, the budget
search before issue 37 ranked it (MEDL's plan and every block plan compiled).
Each process also records its peak host memory (``ru_maxrss``, the high-water mark of
that process alone, and the same before the step was decorated: the model built), the
number of XLA compiles (``jax.monitoring``'s ``/jax/core/compile/backend_compile_duration``
events, every compile JAX or jaxmem asks for, with their seconds) and of
``jaxmem.xla.measure.compile`` calls (jaxmem's own: the candidates, the budget search, the
winner compiled in full). All three are read when the first call returns, before the
report (``step.plan``) is asked for: where ``verify=True`` checked its plan against the
plain step's predicted peak, ``step.plan`` compiles the plain step for the plan's
``baseline``, and that compile is not the first call's (results before 2026-12-06 counted
it, one compile and its host memory more than the first call had; ``background``: the
compiles after the first call are not counted now).

``--target h100`` (any :mod:`jaxmem.targets` name) places the arguments on that target's
topology devices and times the first call's work up to its executable, compile-only
(``.lower(state, batch).compile()``: trace, plan, compile; nothing runs), and records the
compiled peak each mode ends at (``jax.jit``'s from its ``memory_analysis()``).

``--model corpus:NAME`` times an entry of :mod:`benchmarks.external.corpus` (another
project's train step, ``step(state, batch)``) instead of a zoo model.

Run:  python -m benchmarks.first_call [--model transformer] [--size bench] [--repeat 1]
      [--target cpu] [--modes plain,cold,warm,budget,background,predicted]
Writes benchmarks/results/first_call.json and .md (``first_call-<model>-<size>.*`` for
another model or size; ``first_call-<target>-<model>-<size>-<modes>-<budget>.*`` for a
target).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_CHILD = r"""
import json, resource, sys, time
import jax
import jax.monitoring
mode, model, size, budget, target = sys.argv[1:6]
xla = {"n": 0, "s": 0.0}
def on_event(event, secs, **_):
    if event == "/jax/core/compile/backend_compile_duration":  # every XLA compile
        xla["n"] += 1
        xla["s"] += secs
jax.monitoring.register_event_duration_secs_listener(on_event)
from jaxmem.xla import measure
calls = {"n": 0}
_compile = measure.compile
def counted(*a, **k):  # the compiles jaxmem asks for (candidates, budget search, winner)
    calls["n"] += 1
    return _compile(*a, **k)
measure.compile = counted
from benchmarks.workload import load
w = load(model, size)  # a zoo model, or corpus:NAME (another project's train step)
jax.block_until_ready((w.state, w.batch))
state, batch = w.state, w.batch
if target != "cpu":  # compile-only: the arguments on the target's topology devices
    import jaxmem
    state, batch = jaxmem.targets.place((state, batch), target)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n0, s0 = xla["n"], xla["s"]
def cpu():  # this process and the subprocesses it waited for (XLA:GPU's ptxas)
    r, k = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + k.ru_utime + k.ru_stime
t0, c0 = time.perf_counter(), cpu()
if mode == "plain":
    step = jax.jit(w.step, donate_argnums=0)
else:
    import jaxmem
    kw = {"budget": float(budget)} if mode == "budget" else {}
    if mode == "budget_exhaustive":  # the budget search before issue 37's ranking
        kw = {"budget": jaxmem.Budget(float(budget), search="exhaustive")}
    verify = mode if mode in ("background", "predicted", "builtins") else True
    step = jaxmem.optimize(w.step, verify=verify, **kw)
err = None
peak = None
try:  # a budget below what any plan reaches raises BudgetError: its compiles still count
    if target == "cpu":
        jax.block_until_ready(step(state, batch))
    else:  # nothing to run on: the first call's work up to the executable
        exe = step.lower(state, batch).compile()
        if mode == "plain":
            m = exe.memory_analysis()
            peak = (m.argument_size_in_bytes + m.output_size_in_bytes
                    + m.temp_size_in_bytes - m.alias_size_in_bytes)
except Exception as e:
    err = f"{type(e).__name__}: {e}"[:300]
t1, c1 = time.perf_counter(), cpu()
rec = {"seconds": t1 - t0, "cpu_seconds": c1 - c0}
# ru_maxrss: the process's high-water mark, KiB on Linux (the model built: rss_before).
# Read, with the compile counts, before the report below: step.plan() compiles the plain
# step for the plan's baseline where the first call did not need it (verify=True checked
# against its predicted peak), and that compile is not the first call's.
rec.update(max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           rss_before_mib=rss0 / 1024, xla_compiles=xla["n"] - n0,
           xla_compile_seconds=xla["s"] - s0, jaxmem_compiles=calls["n"])
if err:
    rec.update(error=err, verified_seconds=t1 - t0)
elif mode != "plain":  # until the verified plan is in place (background: step.plan waits)
    plan = step.plan(state, batch)
    rec.update(verified_seconds=time.perf_counter() - t0, strategy=plan.strategy,
               peak=plan.compiled.peak if plan.compiled else None,
               flops=plan.compiled.flops if plan.compiled else None)
if peak is not None:
    rec.update(peak=peak)
print(json.dumps(rec))
"""


def _run(mode: str, model: str, size: str, cache_dir: str,
         budget: float = 0.5, target: str = "cpu") -> dict[str, float]:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               JAXMEM_PLAN_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _CHILD, mode, model, size, str(budget), target],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{mode}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each; the median is kept")
    ap.add_argument("--budget", type=float, default=0.5, help="the budget mode's budget")
    ap.add_argument("--target", default="cpu",
                    help="cpu (run the first call), or a jaxmem.targets name such as h100: "
                         "compile-only, the first call's work up to its executable")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"which of {','.join(MODES)} (warm needs cold, budget_warm "
                         "needs budget)")
    args = ap.parse_args(argv)
    modes = [m for m in MODES if m in args.modes.split(",")]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    load = os.getloadavg()  # the other work on the machine: wall and CPU time swing with it
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            for m in ("plain", "cold", "warm"):
                if m in runs:
                    runs[m].append(_run("jaxmem" if m != "plain" else m, args.model,
                                        args.size, d, target=args.target))
        for m in ("budget", "budget_exhaustive", "background", "predicted", "builtins"):
            if m in runs:
                with tempfile.TemporaryDirectory() as d:
                    runs[m].append(_run(m, args.model, args.size, d, args.budget,
                                        args.target))
                    if m == "budget" and "budget_warm" in runs:  # the directory it filled
                        runs["budget_warm"].append(_run(m, args.model, args.size, d,
                                                        args.budget, args.target))
    result = _summary(args, runs, load)
    name = args.model.replace(":", "-")  # corpus:NAME -> a file name
    suffix = "" if args.size == "bench" and args.model == "transformer" else \
        f"-{name}-{args.size}"
    if modes != list(MODES):  # a subset: a file of its own
        suffix = f"-{name}-{args.size}-{'-'.join(modes)}-{args.budget:g}"
    if args.target != "cpu":
        suffix = f"-{args.target}-{name}-{args.size}-{'-'.join(modes)}-{args.budget:g}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"first_call{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = _markdown(result)
    (RESULTS / f"first_call{suffix}.md").write_text(
        f"{args.model} ({args.size}), median of {args.repeat} run(s), each in a fresh "
        f"process: `python -m benchmarks.first_call --model {args.model} --size {args.size} "
        f"--repeat {args.repeat} --target {args.target} --modes {','.join(modes)}`"
        f"{' (compile-only: the seconds are up to the executable)' if args.target != 'cpu' else ''}"
        f"; {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f} at the start; jax {result['jax']}, commit "
        f"{str(result['git_commit'])[:10]}"
        f"{' with uncommitted changes' if result.get('git_dirty') else ''}, "
        f"{result['date']}\n\n" + md)
    print(md)
    return result


MODES = ("plain", "cold", "warm", "budget", "budget_warm", "budget_exhaustive", "background",
         "predicted", "builtins")
_NAMES = {"plain": "`jax.jit`", "cold": "`jaxmem.optimize`, cold plan cache",
          "warm": "`jaxmem.optimize`, warm plan cache",
          "budget": "`jaxmem.optimize(budget=0.5)`, cold plan cache",
          "budget_warm": "`jaxmem.optimize(budget=0.5)`, warm plan cache",
          "budget_exhaustive": "`jaxmem.optimize(budget=Budget(0.5, search=\"exhaustive\"))`, "
                               "cold plan cache",
          "background": "`jaxmem.optimize(verify=\"background\")`, cold plan cache",
          "predicted": "`jaxmem.optimize(verify=\"predicted\")`, cold plan cache",
          "builtins": "`jaxmem.optimize(verify=\"builtins\")`, cold plan cache"}
_KEYS = ("seconds", "cpu_seconds", "max_rss_mib", "rss_before_mib", "xla_compiles",
         "xla_compile_seconds", "jaxmem_compiles")


def _summary(args: argparse.Namespace, runs: dict[str, list[dict]], load: tuple) -> dict:
    """Medians per mode and the ratios to plain jax.jit."""
    med = {k: {m: statistics.median(r[k] for r in v) for m, v in runs.items()}
           for k in _KEYS}
    result = {"model": args.model, "size": args.size, "target": args.target,
              "repeat": args.repeat,
              "budget": args.budget, **med}
    plain = "plain" in runs
    for m in runs:
        if plain and m != "plain":
            result[f"{m}_over_plain"] = med["seconds"][m] / med["seconds"]["plain"]
            result[f"{m}_cpu_over_plain"] = med["cpu_seconds"][m] / med["cpu_seconds"]["plain"]
            result[f"{m}_rss_over_plain"] = med["max_rss_mib"][m] / med["max_rss_mib"]["plain"]
    result["verified_seconds"] = {m: statistics.median(r["verified_seconds"] for r in v)
                                  for m, v in runs.items() if m != "plain"}
    result.update(runs=runs, load_average=load, cpu_count=os.cpu_count(), **_meta(argv=None))
    return result


def _meta(argv: list[str] | None) -> dict:
    import datetime

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        # the code measured is not that commit's where jaxmem or the benchmarks differ
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "jaxmem",
                                     "benchmarks/*.py"], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    jax_version = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
    return {"command": "python -m benchmarks.first_call " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git_commit": commit, "git_dirty": dirty, "jax": jax_version}


def _peak(runs: list[dict]) -> str:
    """The compiled peak the mode ends at (the first run's: it is deterministic), MiB, and
    its FLOPs (GFLOP) where recorded."""
    peak, flops = runs[0].get("peak"), runs[0].get("flops")
    return (f"{peak / 2**20:.2f}" if peak else "") + (f" / {flops / 1e9:.2f}" if flops else "")


def _markdown(result: dict) -> str:
    med = {k: result[k] for k in _KEYS}
    ver = result["verified_seconds"]
    plain = med["seconds"].get("plain")
    rows = []
    errors = {m: v[0]["error"] for m, v in result["runs"].items() if v[0].get("error")}
    for m in med["seconds"]:
        name = _NAMES[m].replace("0.5", f"{result['budget']:g}") + (" (raised)" if m in errors
                                                                      else "")
        ratio = f"{med['seconds'][m] / plain:.2f}" if plain else ""
        rows.append(
            f"| {name} | {med['seconds'][m]:.2f} | {ratio} | {med['cpu_seconds'][m]:.2f} "
            f"| {f'{ver[m]:.2f}' if m in ver else ''} | {med['max_rss_mib'][m]:.0f} | "
            f"{med['max_rss_mib'][m] - med['rss_before_mib'][m]:.0f} | "
            f"{med['xla_compiles'][m]:.0f} | {med['xla_compile_seconds'][m]:.2f} | "
            f"{med['jaxmem_compiles'][m]:.0f} | {_peak(result['runs'][m])} |\n")
    return ("| first call | seconds | / plain jit | CPU seconds | verified plan in place, s | "
            "peak RSS MiB | RSS growth in the call MiB | XLA compiles | XLA compile s | "
            "jaxmem compiles | compiled peak MiB / GFLOP |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
            + "".join(rows) + "".join(f"\n{_NAMES[m]}: {e}\n" for m, e in errors.items()))


if __name__ == "__main__":
    main()
