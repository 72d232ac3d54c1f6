"""``python -m benchmarks.builtin_order``: which built-in fallback compiles lowest.

When jaxmem's budget search cannot meet a budget, the step is tried with its loss under
JAX's built-in policies (:func:`jaxmem.compiling.builtin_fallbacks.builtin_within`):
``dots_saveable`` and ``nothing_saveable``, around each block of the loss and around the
whole loss. The fallback compiles :data:`~jaxmem.compiling.builtin_fallbacks.FIRST_BUILTIN`
(``nothing_saveable`` per block) first and the others only where it compiles within
:data:`~jaxmem.compiling.builtin_fallbacks.BUILTIN_SPREAD` of the budget: it saves a subset
of what each of the others saves. This compiles all four on each step
(each step in a fresh process; the search itself is not run: it is made to give up with a
budget every built-in fits, so that the fallback compiles them all) and records their
compiled peaks, so the rule is checked against the compiler: the first must be the lowest,
or within ``BUILTIN_SPREAD`` of it, wherever it applies.

Usage::

    python -m benchmarks.builtin_order --models mlp,resnet,transformer --size test \\
        --targets cpu,h100

Writes ``benchmarks/results/builtin_order-<size>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jaxmem.compiling.builtin_fallbacks import BUILTIN_POLICIES, FIRST_BUILTIN

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
ZOO = "mlp,resnet,transformer,cnn_bn,densenet,unet,llama"
CORPUS = "corpus:eqx_bn_cnn,corpus:tx_resnet18_ts"

_CHILD = r"""
import json, sys
import jax
import jaxmem
from jaxmem.compiling import builtin_fallbacks as bf, plan_step, steps
from jaxmem.planning.budget import BudgetError
from benchmarks.builtin_order import _label
from benchmarks.workload import load
name, size, target = sys.argv[1:4]
w = load(name, size, target)
state, batch = w.state, w.batch
last, peaks = {}, {}
loss = steps.Step.loss
def named_loss(self, policy, per_block=False):
    last["k"] = _label(policy, per_block)
    return loss(self, policy, per_block)
steps.Step.loss = named_loss
read = bf.read
def recorded(exe, jitted, flat):
    fig = read(exe, jitted, flat)
    peaks[last["k"]] = fig.peak
    return fig
bf.read = recorded
def gave_up(analysis, budget, **kw):  # every built-in fits: the fallback compiles all four
    raise BudgetError("search skipped (benchmarks.builtin_order)", 10**15, 10**15)
plan_step.plan_with_budget = gave_up
jaxmem.optimize(w.step, budget=10**15).lower(state, batch).compile()
print(json.dumps(peaks))
"""


def _label(policy: str, per_block: bool) -> str:
    """How the child names a built-in: ``"<policy> per block"`` or ``"<policy> whole"``."""
    return f"{policy} {'per block' if per_block else 'whole'}"


def run(model: str, size: str, target: str) -> dict[str, Any]:
    """The four built-ins' compiled peaks for one step (a fresh process)."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=str(ROOT))
    if target != "cpu":
        env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    r = subprocess.run([sys.executable, "-c", _CHILD, model, size, target], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    if r.returncode:
        return {"error": r.stderr.strip().splitlines()[-1][:300]}
    peaks = json.loads(r.stdout.strip().splitlines()[-1])
    first = _label(*FIRST_BUILTIN)
    lowest = min(peaks.values()) if peaks else None
    return {"peaks": peaks, "first": peaks.get(first),
            "first_is_lowest": None if first not in peaks else peaks[first] <= lowest,
            "first_over_lowest_pct": None if first not in peaks
            else round(100.0 * (peaks[first] / lowest - 1.0), 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=f"{ZOO},{CORPUS}")
    ap.add_argument("--size", default="test")
    ap.add_argument("--targets", default="cpu,h100")
    args = ap.parse_args(argv)
    rows = []
    for target in args.targets.split(","):
        for model in args.models.split(","):
            rows.append({"model": model, "size": args.size, "target": target,
                         **run(model, args.size, target)})
            print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    import jax
    result = {"meta": {"command": "python -m benchmarks.builtin_order " + " ".join(
        sys.argv[1:] if argv is None else argv), "date": datetime.date.today().isoformat(),
        "git_commit": commit, "jax": jax.__version__}, "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    stem = f"builtin_order-{args.size}"
    (OUT / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    kinds = [_label(*FIRST_BUILTIN)] + [
        k for k in (_label(p, b) for b in (True, False) for p in BUILTIN_POLICIES[::-1])
        if k != _label(*FIRST_BUILTIN)]
    lines = [f"`{result['meta']['command']}` (commit {commit[:10]}, {result['meta']['date']}, "
             f"jax {jax.__version__}). Compiled peaks, KiB; the first column is compiled "
             "first by the fallback.", "",
             "| step | target | " + " | ".join(kinds) + " | first is lowest |",
             "|---|---|" + "---:|" * (len(kinds) + 1)]
    for r in rows:
        p = r.get("peaks", {})
        cells = [f"{p[k] / 1024:,.1f}" if k in p else "–" for k in kinds]
        held = {True: "yes", False: f"no (+{r.get('first_over_lowest_pct')}%)",
                None: "n/a" if "error" not in r else r["error"][:60]}[r.get("first_is_lowest")]
        lines.append(f"| {r['model']} ({r['size']}) | {r['target']} | " + " | ".join(cells)
                     + f" | {held} |")
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
