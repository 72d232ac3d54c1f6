"""``python -m benchmarks.ranked_choice``: the default ``verify=True`` and ``"builtins"``
against ``verify="all"``.

``verify="all"`` compiles every candidate plan, the plain step and the two built-ins
(:func:`jaxmem.compiling.choose.verified`), ``"builtins"`` the same with only the three
candidate plans the cost model predicts lowest (and the rewritten step's lowest), and the
default ``verify=True`` (:mod:`jaxmem.compiling.predicted`) the best-predicted candidates
one group at a time, the plain step only where the model's margin is not there. For each
zoo model, size and target this plans the step each way with an empty plan cache, each in
a fresh process (no JAX compile cache or plan carried from one to the other), and records
the peak each ends at, its strategy, the compiles jaxmem asked for
(``jaxmem.xla.measure.compile`` calls: the candidates and the winner) and the seconds.
Issue 37 asks the default to end within 1% of the exhaustive choice's peak.

Usage::

    python -m benchmarks.ranked_choice --models mlp,resnet,transformer --size test --targets cpu
    python -m benchmarks.ranked_choice --models mlp,resnet,transformer --size bench \\
        --targets cpu,h100

Writes ``benchmarks/results/ranked_choice/<size>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "ranked_choice"

_CHILD = r"""
import json, sys, time
import jaxmem
from benchmarks import zoo
from jaxmem.xla import measure
name, size, target, verify = sys.argv[1:5]
verify = True if verify == "default" else verify  # "all", "builtins" as given
calls = {"n": 0}
_compile = measure.compile
def counted(*a, **k):
    calls["n"] += 1
    return _compile(*a, **k)
measure.compile = counted
w = zoo.make(name, size=size)
args = w.args if target == "cpu" else jaxmem.targets.place(w.args, target)
t0 = time.perf_counter()
plan = jaxmem.optimize(w.step, donate_argnums=(0,), verify=verify).plan(*args)
print("RESULT " + json.dumps({"peak": int(plan.compiled.peak), "strategy": plan.strategy,
      "flops": plan.compiled.flops, "compiles": calls["n"],
      "seconds": round(time.perf_counter() - t0, 2)}))
"""


def one(name: str, size: str, target: str, verify: str, timeout: float) -> dict[str, Any]:
    """One plan in a fresh process (empty plan cache directory)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAXMEM_PLAN_CACHE_DIR=cache, PYTHONPATH=str(ROOT),
                   JAX_ENABLE_COMPILATION_CACHE="false")
        try:
            p = subprocess.run([sys.executable, "-c", _CHILD, name, size, target, verify],
                               cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def row(name: str, size: str, target: str, timeout: float) -> dict[str, Any]:
    r = {"model": name, "size": size, "target": target,
         **{k: one(name, size, target, k, timeout) for k in MODES}}
    a = r["all"]
    for k in MODES[1:]:
        if "peak" in a and "peak" in r[k]:
            r[f"{k}_over_all_pct"] = round(100.0 * (r[k]["peak"] / a["peak"] - 1.0), 3)
    return r


#: ``all``: verify="all"; ``builtins``: verify="builtins"; ``default``: verify=True.
#: (Results written before issue 37's default change name them ``all``, ``ranked``
#: (then the default, now ``"builtins"``) and ``predicted`` (now the default).)
MODES = ("all", "builtins", "default")


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out = [f"`{meta['command']}` ({meta['date']}, commit {meta['git_commit'][:10]}, "
           f"jax {meta['jax']}); each plan in a fresh process, empty plan cache\n",
           "| model | size | target | `verify=\"all\"`: peak MiB / compiles / s | "
           "`verify=\"builtins\"`: peak MiB / compiles / s | builtins vs all | "
           "`verify=True`: peak MiB / compiles / s | default vs all | "
           "strategies |",
           "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = []
        for k in MODES:
            v = r.get(k, {"error": "not run"})
            cells.append(v["error"] if "error" in v else
                         f"{v['peak'] / 2**20:.3f} / {v['compiles']} / {v['seconds']:.1f}")
            if k != "all":
                d = r.get(f"{k}_over_all_pct")
                cells.append("" if d is None else f"{d:+.2f}%")
        strat = " / ".join(r.get(k, {}).get("strategy", "-") for k in MODES)
        out.append(f"| {r['model']} | {r['size']} | {r['target']} | " + " | ".join(cells)
                   + f" | {strat} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,resnet,transformer")
    ap.add_argument("--size", default="test")
    ap.add_argument("--targets", default="cpu")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per plan")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    import jax

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    meta = {"command": "python -m benchmarks.ranked_choice "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git_commit": commit, "jax": jax.__version__}
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for target in a.targets.split(","):
        for name in a.models.split(","):
            rows.append(row(name, a.size, target, a.timeout))
            print(json.dumps(rows[-1]), flush=True)
            path = a.out / f"{a.size}.json"
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            path.with_suffix(".md").write_text(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
