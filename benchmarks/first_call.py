"""First-call time: ``jax.jit`` against ``jaxmem.optimize`` with a cold and a warm plan cache.

Each measurement runs in a fresh Python process (no JAX trace or compile cache carried
over; JAX's persistent compilation cache off), timing the first call of the step from
decoration to the result being ready: trace, plan, compile and run. ``cold``: an empty plan
cache directory; ``warm``: the directory the cold run filled (a restart, or another host
sharing it); ``background``: an empty plan cache directory and
``verify="background"`` (the first call runs one unverified candidate plan, the others
compile in a thread after it; ``verified_seconds`` is the time until the verified plan is
in place, ``step.plan`` waiting for it). Wall seconds and CPU seconds (user + system of the
process, every thread summed) are both recorded: on a shared machine the wall time of one
run swings with the load, its CPU time much less.

Run:  python -m benchmarks.first_call [--model transformer] [--size bench] [--repeat 1]
Writes benchmarks/results/first_call.json and .md.
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
from benchmarks import zoo
mode, model, size = sys.argv[1:4]
w = zoo.make(model, size=size)
jax.block_until_ready((w.state, w.batch))
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0, c0 = time.perf_counter(), cpu()
if mode == "plain":
    step = jax.jit(w.step, donate_argnums=0)
else:
    import jaxmem
    step = jaxmem.optimize(w.step, verify="background" if mode == "background" else True)
out = step(w.state, w.batch)
jax.block_until_ready(out)
t1, c1 = time.perf_counter(), cpu()
rec = {"seconds": t1 - t0, "cpu_seconds": c1 - c0}
if mode != "plain":  # until the verified plan is in place (background: step.plan waits)
    plan = step.plan(w.state, w.batch)
    rec.update(verified_seconds=time.perf_counter() - t0, strategy=plan.strategy,
               peak=plan.compiled.peak if plan.compiled else None)
print(json.dumps(rec))
"""


def _run(mode: str, model: str, size: str, cache_dir: str) -> dict[str, float]:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               JAXMEM_PLAN_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _CHILD, mode, model, size], cwd=ROOT, env=env,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each; the median is kept")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "cold": [], "warm": [],
                                               "background": []}
    load = os.getloadavg()  # the other work on the machine: wall and CPU time swing with it
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            runs["plain"].append(_run("plain", args.model, args.size, d))
            runs["cold"].append(_run("jaxmem", args.model, args.size, d))
            runs["warm"].append(_run("jaxmem", args.model, args.size, d))
        with tempfile.TemporaryDirectory() as d:
            runs["background"].append(_run("background", args.model, args.size, d))
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_seconds"] for r in v) for k, v in runs.items()}
    result = {"model": args.model, "size": args.size, "repeat": args.repeat, "seconds": med,
              "cpu_seconds": cpu, "cold_over_plain": med["cold"] / med["plain"],
              "warm_over_plain": med["warm"] / med["plain"],
              "cold_cpu_over_plain": cpu["cold"] / cpu["plain"],
              "warm_cpu_over_plain": cpu["warm"] / cpu["plain"],
              "background_over_plain": med["background"] / med["plain"],
              "background_cpu_over_plain": cpu["background"] / cpu["plain"],
              "verified_seconds": {k: statistics.median(r["verified_seconds"] for r in v)
                                   for k, v in runs.items() if k != "plain"},
              "runs": runs,
              "load_average": load, "cpu_count": os.cpu_count()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "first_call.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [("`jax.jit`", "plain"), ("`jaxmem.optimize`, cold plan cache", "cold"),
            ("`jaxmem.optimize`, warm plan cache", "warm"),
            ("`jaxmem.optimize(verify=\"background\")`, cold plan cache", "background")]
    ver = result["verified_seconds"]
    md = ("| first call | seconds | / plain jit | CPU seconds | / plain jit | verified plan "
          "in place, s |\n|---|---:|---:|---:|---:|---:|\n" + "".join(
              f"| {name} | {med[k]:.2f} | {med[k] / med['plain']:.2f} | {cpu[k]:.2f} | "
              f"{cpu[k] / cpu['plain']:.2f} | {f'{ver[k]:.2f}' if k in ver else ''} |\n"
              for name, k in rows))
    (RESULTS / "first_call.md").write_text(
        f"{args.model} ({args.size}), median of {args.repeat} run(s), each in a fresh "
        f"process: `python -m benchmarks.first_call --model {args.model} --size {args.size} "
        f"--repeat {args.repeat}`; {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f} at the start\n\n" + md)
    print(md)
    return result


if __name__ == "__main__":
    main()
