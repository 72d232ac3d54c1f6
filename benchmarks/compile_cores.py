"""``python -m benchmarks.compile_cores``: how many cores one XLA compile keeps busy, and
what a second compile beside it gains.

Issue 37's first-call designs overlap work with the plain step's compile: jaxmem's Python
(the rewritten steps' analysis) beside it, and, proposed, a second candidate's compile
beside it. Which pays depends on the cores one compile already uses. This compiles the
user's plain step (a fresh ``jax.jit`` each time, so nothing is cached) in fresh processes:

- ``alone``: one compile; its wall seconds, this process's CPU seconds and those of the
  subprocesses it waited for (compiling for an NVIDIA target, XLA runs ``ptxas`` in
  subprocesses);
- ``sequential``: two compiles one after another, in one process;
- ``threads``: two compiles started together in two threads of one process;
- ``processes``: two processes, each lowering first, then compiling at the same moment
  (what threads would reach were a lock inside the process in the way).

Usage::

    python -m benchmarks.compile_cores --model corpus:tx_resnet18_ts --size bench --target h100

Writes ``benchmarks/results/compile_cores-<target>-<model>-<size>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import compile_phases

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, resource, sys, threading, time
import jax
from benchmarks.workload import load
model, size, target, how, ready, go = sys.argv[1:7]
w = load(model, size, target)
def lowered():  # a new function each time: its own trace, lowering and compile
    return jax.jit(lambda s, b: w.step(s, b), donate_argnums=0).lower(w.state, w.batch)
def cpu():
    r, k = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime, k.ru_utime + k.ru_stime
todo = [lowered() for _ in range(1 if how in ("alone", "one") else 2)]
if how == "one":  # one of two processes: compile when the parent says go
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
(s0, k0), t0 = cpu(), time.perf_counter()
if how == "threads":
    ts = [threading.Thread(target=lo.compile) for lo in todo]
    [t.start() for t in ts]
    [t.join() for t in ts]
else:
    [lo.compile() for lo in todo]
(s1, k1), t1 = cpu(), time.perf_counter()
print(json.dumps({"how": how, "seconds": t1 - t0, "cpu_self": s1 - s0,
                  "cpu_children": k1 - k0, "compiles": len(todo)}), flush=True)
"""

HOWS = ("alone", "sequential", "threads", "processes")


def _env(target: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=str(ROOT))
    if target != "cpu":
        env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    return env


def _child(model: str, size: str, target: str, how: str, ready: str = "",
           go: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, model, size, target, how,
                             ready, go], cwd=ROOT, env=_env(target),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _record(p: subprocess.Popen) -> dict[str, Any]:
    out, err = p.communicate()
    if p.returncode:
        raise RuntimeError(err[-2000:])
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def _processes(model: str, size: str, target: str) -> dict[str, Any]:
    """Two processes, each compiling once, started together once both have lowered."""
    with tempfile.TemporaryDirectory() as d:
        ready = [os.path.join(d, f"ready{i}") for i in range(2)]
        go = os.path.join(d, "go")
        ps = [_child(model, size, target, "one", r, go) for r in ready]
        while not all(os.path.exists(r) for r in ready):
            if any(p.poll() not in (None, 0) for p in ps):
                raise RuntimeError(ps[0].stderr.read()[-2000:] if ps[0].stderr else "")
            time.sleep(0.05)
        t0 = time.perf_counter()
        open(go, "w").close()
        recs = [_record(p) for p in ps]
    return {"how": "processes", "seconds": max(r["seconds"] for r in recs),
            "cpu_self": sum(r["cpu_self"] for r in recs),
            "cpu_children": sum(r["cpu_children"] for r in recs), "compiles": 2,
            "parent_seconds": time.perf_counter() - t0}


def run(model: str, size: str, target: str) -> list[dict[str, Any]]:
    """One record per way of compiling (:data:`HOWS`), each in fresh processes."""
    rows = []
    for how in HOWS:
        rows.append(_processes(model, size, target) if how == "processes"
                    else _record(_child(model, size, target, how)))
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    alone = rows[0]["seconds"]
    lines = [f"`{meta['command']}` (commit {meta['git_commit'][:10]}, {meta['date']}, jax "
             f"{meta['jax']}, {meta['cpus']} CPUs). The plain step's compile: wall seconds "
             "(x one compile alone), CPU seconds of the compiling process(es) and of the "
             "subprocesses they waited for, and the cores kept busy (CPU over wall).", "",
             "| compiles | wall s (x alone) | CPU s, process | CPU s, subprocesses | "
             "cores busy |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        cpu = r["cpu_self"] + r["cpu_children"]
        lines.append(f"| {r['how']} ({r['compiles']}) | {r['seconds']:.2f} "
                     f"({r['seconds'] / alone:.2f}x) | {r['cpu_self']:.2f} | "
                     f"{r['cpu_children']:.2f} | {cpu / r['seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = compile_phases.step_arguments(__doc__, "corpus:tx_resnet18_ts").parse_args(argv)
    rows = run(args.model, args.size, args.target)
    stem = f"compile_cores-{args.target}-{args.model.replace(':', '-')}-{args.size}"
    return compile_phases.write("compile_cores", argv, stem, rows, markdown)


if __name__ == "__main__":
    main()
