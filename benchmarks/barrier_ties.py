"""``python -m benchmarks.barrier_ties``: which of the rewrite's barriers XLA keeps whole.

The rewrite orders a re-created value after its backward region by passing it through an
``optimization_barrier`` together with that region's cotangents (the *tie*,
:meth:`jaxmem.rewriting.rewrite._Replay.materialise`), and fences finished weight gradients
the same way (:func:`jaxmem.rewriting.settle.fence_finished`). Those extra operands are
there only for the order: nothing reads the barrier's outputs for them. XLA's algebraic
simplifier removes an element of a barrier whose output nothing reads once nothing but the
barrier reads its operand: where the value's other readers took its computation in (a
Triton matmul fusion absorbs an elementwise producer) or read it through a bitcast of
their own (layout normalisation, for a layout other than the default). ``python -m
benchmarks.barrier_ties --probe``: of three ties, one a matmul also reads, a transposed
copy made for the barrier, one an elementwise op also reads, only the last is kept. Where
a tie goes, the barrier orders nothing, and
XLA may compute the re-created values as early as their other operands allow, where the
liveness model (:mod:`jaxmem.analyzing.liveness`) assumes the order held.

This compiles the plain step and each candidate ``verify`` compiles for ``MODEL``
(``jaxmem.optimize(step, verify="all")``'s, read where they are handed to the compiler,
as :mod:`benchmarks.prediction_why` does) with XLA's dumps at the start of each pass
pipeline, and counts, per program, the barriers the lowering holds and those whose
operands XLA cut before it schedules (the first dump against the last one before the
barriers are expanded), with each program's compiled peak and the liveness model's.

``--budget B``: the plans ``jaxmem.optimize(step, budget=B)``'s search compiles instead (its
block plans, the solver's), each with the liveness model's peak of its rewritten step.

Usage::

    python -m benchmarks.barrier_ties --model llama --size bench --target h100
    python -m benchmarks.barrier_ties --model llama --size bench --target h100 --budget 0.5

Writes ``benchmarks/results/barrier_ties-<target>-<model>-<size>.{json,md}``. Read-only:
nothing in jaxmem changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"

_INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z\-]*)\((.*?)\)(?:, |$)")


def entry_instructions(hlo: str) -> dict[str, tuple[str, list[str]]]:
    """The entry computation of an HLO text dump: instruction name -> (opcode, operand
    names)."""
    at = hlo.find("\nENTRY")
    out: dict[str, tuple[str, list[str]]] = {}
    for line in hlo[at if at >= 0 else 0:].splitlines():
        m = _INSTR.match(line)
        if m:
            out[m.group(1)] = (m.group(3), re.findall(r"%([\w.\-]+)", m.group(4)))
    return out


def barrier_widths(hlo: str) -> dict[str, int]:
    """Each ``opt-barrier`` of the entry computation: its name (a ``.0`` suffix XLA's
    renaming adds dropped) -> how many operands its tuple has (1 where its operand is not a
    tuple)."""
    ins = entry_instructions(hlo)
    out = {}
    for name, (op, args) in ins.items():
        if op != "opt-barrier" or not args:
            continue
        tup = ins.get(args[0])
        out[name.removesuffix(".0")] = len(tup[1]) if tup and tup[0] == "tuple" else 1
    return out


def cut_barriers(first: str, scheduled: str) -> tuple[int, int, int]:
    """``(barriers, barriers XLA cut, operands cut)``: the barriers of the ``first`` dump
    of a module (as lowered) and how many of them hold fewer operands in ``scheduled`` (the
    dump before XLA expands them), and how many operands went in all."""
    a, b = barrier_widths(first), barrier_widths(scheduled)
    cut = [(w, b[n]) for n, w in a.items() if n in b and b[n] < w]
    return len(a), len(cut), sum(w - v for w, v in cut)


def module_dumps(files: list[Path]) -> tuple[str, str] | None:
    """Of one compile's dump files, the largest module's first pass-pipeline dump and its
    last one before ``cse_barrier_expander`` (the remat pipeline's start); None where they
    are missing."""
    mods: dict[str, list[tuple[int, Path]]] = {}
    for f in files:
        m = re.match(r"(module_\d+)\..+?\.(\d{4})\.", f.name)
        if m and f.suffix == ".txt":
            mods.setdefault(m.group(1), []).append((int(m.group(2)), f))
    if not mods:
        return None
    dumps = sorted(max(mods.values(), key=lambda v: max(f.stat().st_size for _, f in v)))
    last = [f for _, f in dumps if "remat-pipeline" in f.name]
    if not last:
        return None
    return dumps[0][1].read_text(), last[0].read_text()


def dump_to(dump: Path) -> None:
    """Set XLA's dumps at each pass pipeline's start into ``dump`` (before JAX starts: a
    child process calls it first), one compile at a time."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} "
                               "--xla_dump_hlo_pass_re=pipeline-start --xla_dump_hlo_as_text")
    os.environ.setdefault("JAXMEM_COMPILE_THREADS", "1")


def report(program: str, compiled: int, predicted: int, dump: Path, before: set[Path]
           ) -> None:
    """Print one row for the child's parent: ``program``'s peaks and the barriers XLA cut in
    the compile whose dumps are those in ``dump`` not in ``before`` (then deleted)."""
    new = [f for f in dump.iterdir() if f not in before]
    got = module_dumps(new)
    row = {"program": program, "compiled": compiled, "predicted": predicted}
    if got is not None:
        row.update(zip(("barriers", "cut", "operands_cut"), cut_barriers(*got), strict=True))
    for f in new:
        f.unlink()
    print("@@row " + json.dumps(row), flush=True)


_CHILD = r"""
import sys
from pathlib import Path
from benchmarks import barrier_ties
dump = Path(sys.argv[4])
barrier_ties.dump_to(dump)
import jaxmem
from benchmarks import prediction_plans, prediction_why
from jaxmem.analyzing.liveness import liveness
from jaxmem.compiling.steps import read
from jaxmem.tracing.program import from_jaxpr
from jaxmem.xla import measure
model, size, target = sys.argv[1:4]
w = prediction_plans.workload(model, size, target)
step, cands = prediction_why._candidates(w, target)
platform = jaxmem.targets.get(target).platform
for name, jitted in [("plain", step.plain)] + [(c.plan.strategy, c.jitted) for c in cands]:
    traced = jitted.trace(*step.flat)
    pred = liveness(from_jaxpr(traced.jaxpr), donated=step.donate_flat, platform=platform)[0]
    before = set(dump.iterdir())
    fig = read(measure.compile(traced.lower()), jitted, step.flat)
    barrier_ties.report(name, fig.peak, pred, dump, before)
"""

_BUDGET_CHILD = r"""
import sys
from pathlib import Path
from benchmarks import barrier_ties
dump = Path(sys.argv[4])
barrier_ties.dump_to(dump)
import jaxmem
from benchmarks.workload import load
from jaxmem.analyzing.liveness import liveness
from jaxmem.compiling import plan_step
model, size, target, budget = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[5])
compile_plan = plan_step._Compiles.plan
def plan(self, p):   # every plan the budget search compiles, as it compiles it
    before = set(dump.iterdir())
    fig = compile_plan(self, p)
    pred = liveness(self.step.rewritten(p), donated=self.step.donate_flat,
                    platform=self.step.platform)[0]
    barrier_ties.report(p.strategy, fig.peak, pred, dump, before)
    return fig
plan_step._Compiles.plan = plan
w = load(model, size)
state, batch = jaxmem.targets.place((w.state, w.batch), target)
try:
    jaxmem.optimize(w.step, budget=budget).lower(state, batch)
except jaxmem.BudgetError:
    pass
"""


def run(model: str, size: str, target: str, budget: float | None = None
        ) -> list[dict[str, Any]]:
    """The rows of ``model``: one per program, in a fresh process (XLA's dump flags are read
    when it starts); with ``budget``, the plans ``optimize(step, budget=budget)``'s search
    compiles (the plain step aside)."""
    dump = Path(tempfile.mkdtemp(prefix="jaxmem-barrier-ties-"))
    # a plan cache of its own: a cached plan would hand no candidates to the compiler
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAXMEM_PLAN_CACHE_DIR=str(dump / "plan-cache"))
    try:
        child = (_CHILD, "") if budget is None else (_BUDGET_CHILD, str(budget))
        r = subprocess.run([sys.executable, "-c", child[0], model, size, target, str(dump),
                            child[1]], cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    rows = [json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("@@row ")]
    # every run has the plain step's row; a budget search may compile no plan
    if r.returncode or (not rows and budget is None):
        raise RuntimeError(f"{model}: {r.stderr[-2000:]}")
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown rows of :func:`run`'s ``rows``."""
    out = ["| program | barriers | cut by XLA | operands cut | compiled MiB | predicted MiB "
           "| error |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        err = r["predicted"] / r["compiled"] - 1 if r["compiled"] else 0.0
        out.append(f"| {r['program']} | {r.get('barriers', '?')} | {r.get('cut', '?')} | "
                   f"{r.get('operands_cut', '?')} | {r['compiled'] / 2**20:.2f} | "
                   f"{r['predicted'] / 2**20:.2f} | {err:+.1%} |")
    return out


_PROBE = r"""
import sys, glob
from pathlib import Path
from benchmarks import barrier_ties
dump = sys.argv[1]
barrier_ties.dump_to(Path(dump))
import jax, jax.numpy as jnp
from jax import lax
import jaxmem
def f(w, x):
    ct = jnp.cos(jnp.tanh(x @ w)) * 3.0       # a matmul reads it too, and may fuse it in
    (w1,), _ = lax.optimization_barrier(((w,), (ct,)))
    (w2,), _ = lax.optimization_barrier(((w * 2,), (ct.T,)))   # a copy made for the tie
    cu = jnp.sin(jnp.tanh(x @ w)) * 3.0       # an elementwise op reads it too
    (w3,), _ = lax.optimization_barrier(((w * 3,), (cu,)))
    return ((ct @ w.T).sum() + jnp.sin(x @ w1).sum() + jnp.sin(x @ w2).sum()
            + jnp.sin(x @ w3).sum() + (cu * x).sum())
args = jaxmem.targets.place((jnp.ones((256, 256)), jnp.ones((128, 256))), sys.argv[2])
jax.jit(f).lower(*args).compile()
first, last = barrier_ties.module_dumps([Path(p) for p in glob.glob(f"{dump}/*")])
def ordered(widths):   # in program order: XLA numbers the barriers as it lowers them
    return [widths[k] for k in sorted(widths, key=lambda n: int(n.rsplit(".", 1)[-1]))]
print(ordered(barrier_ties.barrier_widths(first)), ordered(barrier_ties.barrier_widths(last)))
"""


def probe(target: str) -> str:
    """Three barriers, each passing a weight on and tying a matrix nothing reads through it:
    one a matmul reads too, a transposed copy of it made for the barrier alone, and one an
    elementwise op reads too. The barriers' operand counts in program order, as lowered and
    as XLA schedules them."""
    dump = tempfile.mkdtemp(prefix="jaxmem-barrier-probe-")
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, dump, target], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)),
                           capture_output=True, text=True)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return r.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--budget", type=float, default=None,
                    help="the plans optimize(step, budget=B)'s search compiles instead")
    ap.add_argument("--probe", action="store_true", help="only the two-barrier probe")
    a = ap.parse_args(argv)
    if a.probe:
        got = probe(a.target)
        print(f"operands per barrier, lowered and scheduled: {got}")
        return {"probe": got}
    rows = run(a.model, a.size, a.target, a.budget)
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    extra = "" if a.budget is None else f" --budget {a.budget}"
    head = (f"`python -m benchmarks.barrier_ties --model {a.model} --size {a.size} --target "
            f"{a.target}{extra}` (commit {commit}, {datetime.date.today()}). Per program: the "
            "barriers of its lowering, those whose operands XLA cut before scheduling, the "
            "operands cut, the compiled peak and the liveness model's.")
    md = "\n".join([head, "", *table(rows)]) + "\n"
    stem = (f"barrier_ties-{a.target}-{a.model.replace(':', '-')}-{a.size}"
            + ("" if a.budget is None else f"-budget-{a.budget}"))
    (OUT / f"{stem}.md").write_text(md)
    (OUT / f"{stem}.json").write_text(json.dumps(
        {"model": a.model, "size": a.size, "target": a.target, "budget": a.budget,
         "commit": commit, "rows": rows}, indent=1) + "\n")
    print(md)
    return {"rows": rows}


if __name__ == "__main__":
    main()
