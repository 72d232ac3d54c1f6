"""First-call time: ``jax.jit`` against ``jaxmem.optimize`` with a cold and a warm plan cache.

Each measurement runs in a fresh Python process (no JAX trace or compile cache carried
over; JAX's persistent compilation cache off), timing the first call of the step from
decoration to the result being ready: trace, plan, compile and run. ``cold``: an empty plan
cache directory; ``warm``: the directory the cold run filled (a restart, or another host
sharing it).

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
import json, sys, time
import jax
from benchmarks import zoo
mode, model, size = sys.argv[1:4]
w = zoo.make(model, size=size)
t0 = time.perf_counter()
if mode == "plain":
    step = jax.jit(w.step, donate_argnums=0)
else:
    import jaxmem
    step = jaxmem.optimize(w.step)
out = step(w.state, w.batch)
jax.block_until_ready(out)
t1 = time.perf_counter()
print(json.dumps({"seconds": t1 - t0}))
"""


def _run(mode: str, model: str, size: str, cache_dir: str) -> float:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               JAXMEM_PLAN_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _CHILD, mode, model, size], cwd=ROOT, env=env,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each; the median is kept")
    args = ap.parse_args(argv)
    times: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            times["plain"].append(_run("plain", args.model, args.size, d))
            times["cold"].append(_run("jaxmem", args.model, args.size, d))
            times["warm"].append(_run("jaxmem", args.model, args.size, d))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"model": args.model, "size": args.size, "repeat": args.repeat, "seconds": med,
              "cold_over_plain": med["cold"] / med["plain"],
              "warm_over_plain": med["warm"] / med["plain"], "runs": times}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "first_call.json").write_text(json.dumps(result, indent=2) + "\n")
    md = ("| first call | seconds | / plain jit |\n|---|---:|---:|\n"
          f"| `jax.jit` | {med['plain']:.2f} | 1.00 |\n"
          f"| `jaxmem.optimize`, cold plan cache | {med['cold']:.2f} | "
          f"{result['cold_over_plain']:.2f} |\n"
          f"| `jaxmem.optimize`, warm plan cache | {med['warm']:.2f} | "
          f"{result['warm_over_plain']:.2f} |\n")
    (RESULTS / "first_call.md").write_text(
        f"{args.model} ({args.size}), median of {args.repeat} run(s), each in a fresh "
        f"process: `python -m benchmarks.first_call --model {args.model} --size {args.size} "
        f"--repeat {args.repeat}`\n\n" + md)
    print(md)
    return result


if __name__ == "__main__":
    main()
