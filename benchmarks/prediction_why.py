"""Why a candidate's predicted peak is off: jaxmem's live set at its peak beside XLA's.

``python -m benchmarks.prediction_why MODEL CANDIDATE [--size bench] [--target cpu]`` (MODEL: a
zoo model, or ``corpus:NAME``, an entry of :mod:`benchmarks.external.corpus`)
lists ``MODEL``'s candidates as ``jaxmem.optimize``'s ``verify`` would compile them (read
where they are handed to the compiler; none of the others is compiled), compiles the one
whose name starts with ``CANDIDATE`` (``plain``: the plain step) with XLA's dumps on
(``--xla_dump_to``, set before JAX starts), and prints (``CANDIDATE`` ``all``: compiles
the plain step and every candidate and prints each compiled peak, nothing else)

- jaxmem's prediction of that candidate's jaxpr: the values live at its predicted peak, by
  primitive and phase (the liveness model of :mod:`jaxmem.analyzing.liveness` without its
  per-unit transients), largest first;
- XLA's: the values of its temp allocation live at the peak of its own schedule
  (:func:`xla_live_at_peak`, from the ``*buffer-assignment.txt``, ``*live-range.txt`` and
  HLO dumps, which are left in ``--dump`` for reading), by ``op_name`` and phase, beside
  jaxmem's: where the two lists differ is what the model gets wrong.

``--budget B``: ``CANDIDATE`` names a plan ``jaxmem.optimize(step, budget=B)``'s search
compiles instead (the first whose name starts with it; ``budget`` is the solver's), reported
as it is compiled, with the liveness model's live set of its rewritten step.

Read-only: nothing in jaxmem changes; a diagnosis tool for docs/first_call.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def _jaxmem_live(program: Any, donated: tuple[int, ...], platform: str, top: int) -> None:
    import numpy as np

    from jaxmem.analyzing.liveness import aliased_outputs, buffers, liveness
    from jaxmem.analyzing.schedule import schedule

    peak, _, _ = liveness(program, donated=donated, platform=platform)
    mat, late = buffers(program, platform)
    aliased = aliased_outputs(program, donated)
    order = schedule(program, mat, aliased, late)
    last = order.last_use(program)
    made = order.made_at(late)
    steps = len(order.order)
    delta = np.zeros(steps + 2, dtype=np.int64)
    spans = []
    for v in program.values:
        if v.producer is None or not mat[v.id] or v.id in aliased:
            continue
        start = made.get(v.id, order.position[v.producer])
        end = max(last.get(v.id, start), start)
        delta[min(start, steps)] += v.nbytes
        delta[end + 1] -= v.nbytes
        spans.append((start, end, v))
    live = np.cumsum(delta)[:max(steps, 1)]
    at = int(live.argmax())
    args = sum(program.values[i].nbytes for i in program.inputs)
    print(f"jaxmem: predicted peak {peak / 2**20:.2f} MiB (arguments {args / 2**20:.2f}, "
          f"intermediates at the peak {live[at] / 2**20:.2f}, at step {at}/{steps})")
    groups: Counter[tuple[str, str]] = Counter()
    count: Counter[tuple[str, str]] = Counter()
    for start, end, v in spans:
        if start <= at <= end:
            n = program.nodes[v.producer]
            groups[(n.primitive, n.phase)] += v.nbytes
            count[(n.primitive, n.phase)] += 1
    for (prim, phase), b in groups.most_common(top):
        print(f"  {b / 2**20:8.2f} MiB  {count[(prim, phase)]:4d} x {prim:24s} {phase}")


def xla_live_at_peak(assignment: str, live_range: str, hlo: str
                     ) -> tuple[int, int, list[tuple[int, str, str, int, int]]]:
    """XLA's own live set at the peak of its temp allocation, from three of its dumps of one
    module (``*buffer-assignment.txt``, ``*live-range.txt``, the ``*after_optimizations.txt``
    HLO): ``(temp allocation bytes, live bytes at the peak, [(bytes, value, op_name, start,
    end)])``, the values of the ``preallocated-temp`` allocation live at the schedule position
    where their bytes sum highest, largest first.

    The live-range dump's own "Live ranges at N (peak)" list is not that set (it missed a
    third of the temp bytes on the cnn_bn bench step on the H100 target): the values' live
    ranges (``BufferLiveRange``) and sizes are read instead. Their sum at the peak is at
    least the allocation (values may share a buffer), so no bytes are lost to packing."""
    temp: dict[str, int] = {}
    total, in_temp = 0, False
    for line in assignment.splitlines():
        if line.startswith("allocation"):
            in_temp = "preallocated-temp" in line
            if in_temp:
                total = int(re.search(r"size (\d+)", line).group(1))
            continue
        m = in_temp and re.search(r"value: <\d+ (\S+) @\d+> \(size=(\d+),", line)
        if m:
            temp[m.group(1)] = int(m.group(2))
    ranges: dict[str, tuple[int, int]] = {}
    section = False
    for line in live_range.splitlines():
        if "BufferLiveRange" in line or "Live ranges at" in line:
            section = "BufferLiveRange" in line
            continue
        m = section and re.match(r"\s+(\S+):(\d+)-(\d+)$", line)
        if m:
            name = m.group(1)[:-2] if m.group(1).endswith("{}") else m.group(1)
            ranges[name] = (int(m.group(2)), int(m.group(3)))
    ops = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]+)\"", hlo, flags=re.M))
    spans = [(temp[n], n, *ranges[n]) for n in temp if n in ranges]
    if not spans:
        return total, 0, []
    events: Counter[int] = Counter()
    for size, _, start, end in spans:
        events[start] += size
        events[end + 1] -= size
    run, best, at = 0, -1, 0
    for pos in sorted(events):
        run += events[pos]
        if run > best:
            best, at = run, pos
    live = [(size, n, ops.get(re.sub(r"\{.*\}$", "", n), ""), start, end)
            for size, n, start, end in spans if start <= at <= end]
    return total, best, sorted(live, reverse=True)


def _xla_report(files: list[Path], top: int) -> None:
    # one set of dumps per module the compile made (JAX compiles small helper modules
    # too): the step's is the one with the largest buffer assignment
    modules: dict[str, dict[str, Path]] = {}
    for f in files:
        if "_after_optimizations" in f.name:
            module, suffix = f.name.split("_after_optimizations", 1)
            modules.setdefault(module, {})[suffix] = f
    need = ("-buffer-assignment.txt", "-live-range.txt", ".txt")
    found = [m for m in modules.values() if all(k in m for k in need)]
    if not found:
        print("XLA: no buffer-assignment, live-range and HLO dumps found")
        return
    by_suffix = max(found, key=lambda m: m[need[0]].stat().st_size)
    total, live, values = xla_live_at_peak(*(by_suffix[k].read_text() for k in need))
    print(f"XLA: temp allocation {total / 2**20:.2f} MiB; its values live at its peak "
          f"{live / 2**20:.2f} MiB ({by_suffix[need[0]].name})")
    groups: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for size, _, op, _, _ in values:
        phase = "backward" if "transpose(jvp" in op else "forward" if "jvp(" in op else "other"
        key = f"{op.rsplit('/', 1)[-1] or '(no op_name: a copy or layout change)':34s} {phase}"
        groups[key] += size
        count[key] += 1
    for key, b in groups.most_common(top):
        print(f"  {b / 2**20:8.2f} MiB  {count[key]:4d} x {key}")


def _candidates(w: Any, target: str) -> tuple[Any, list[Any]]:
    """The step and the candidates ``verify`` would compile for ``w`` on ``target``, read
    where ``jaxmem.optimize`` hands them to the compiler, and nothing compiled."""
    import jaxmem
    from jaxmem.compiling import choose, plan_cache

    class _Got(Exception):
        pass

    got: dict[str, Any] = {}

    def spy(step: Any, cands: Any) -> Any:
        got.update(step=step, cands=cands)
        raise _Got

    args = w.args if target == "cpu" else jaxmem.targets.place(w.args, target)
    original, choose.compile_candidates = choose.compile_candidates, spy
    plan_cache.clear_memory()
    try:
        jaxmem.optimize(w.step, donate_argnums=(0,), verify="all").plan(*args)
    except _Got:
        pass
    finally:
        choose.compile_candidates = original
    if not got:
        raise SystemExit("verify compiles no candidates for this step")
    return got["step"], got["cands"]


def _budget_plan(a: Any) -> int:
    """``--budget``: the first plan the budget search compiles whose name starts with
    ``a.candidate``, reported when it is compiled (the search goes on as it would)."""
    import jaxmem
    from benchmarks.workload import load
    from jaxmem.compiling import plan_step

    compile_plan, seen = plan_step._Compiles.plan, []

    def plan(self: Any, p: Any) -> Any:
        before = set(a.dump.iterdir())
        fig = compile_plan(self, p)
        if not seen and p.strategy.startswith(a.candidate):
            seen.append(p.strategy)
            print(f"{a.model} ({a.size}) on {a.target}, budget {a.budget}: {p.strategy}, "
                  f"compiled peak {fig.peak / 2**20:.2f} MiB")
            _jaxmem_live(self.step.rewritten(p), self.step.donate_flat,
                         self.step.platform, a.top)
            _xla_report([f for f in a.dump.iterdir() if f not in before], a.top)
        return fig

    plan_step._Compiles.plan = plan
    w = load(a.model, a.size)
    args = jaxmem.targets.place((w.state, w.batch), a.target)
    try:
        jaxmem.optimize(w.step, budget=a.budget).lower(*args)
    except jaxmem.BudgetError:
        pass
    finally:
        plan_step._Compiles.plan = compile_plan
    if not seen:
        raise SystemExit(f"the budget search compiled no plan named {a.candidate!r}...")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("candidate", help="the start of the candidate's name (as --plans lists), "
                    "or 'all': compile every candidate and print its peak, no dumps")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--dump", type=Path, default=Path("/tmp/jaxmem-why"))
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--budget", type=float, default=None,
                    help="CANDIDATE names a plan this budget's search compiles")
    a = ap.parse_args(argv)
    if "jax" in sys.modules and a.candidate != "all":
        raise SystemExit("run as python -m benchmarks.prediction_why (XLA's dump flags)")
    if a.candidate != "all":
        a.dump.mkdir(parents=True, exist_ok=True)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_dump_to={a.dump} --xla_dump_hlo_as_text").strip()
    os.environ.setdefault("JAXMEM_COMPILE_THREADS", "1")
    if a.budget is not None:
        return _budget_plan(a)
    from jaxmem.program import from_jaxpr

    import jaxmem
    from benchmarks import prediction_plans
    from jaxmem.compiling.steps import read
    from jaxmem.xla import measure

    w = prediction_plans.workload(a.model, a.size, a.target)  # zoo, or corpus:NAME
    step, cands = _candidates(w, a.target)
    if a.candidate == "all":  # every candidate's compiled peak, the plain step's first
        for name, jitted in [("plain", step.plain)] + [(c.plan.strategy, c.jitted)
                                                       for c in cands]:
            fig = read(measure.compile(jitted.lower(*step.flat)), jitted, step.flat)
            print(f"{name:55s} {fig.peak / 2**20:10.2f} MiB", flush=True)
        return 0
    if a.candidate == "plain":  # the step as jax.jit compiles it
        name, jitted = "plain", step.plain
    else:
        pick = [c for c in cands if c.plan.strategy.startswith(a.candidate)]
        if not pick:
            raise SystemExit(f"no candidate {a.candidate!r}; there are 'plain' and "
                             f"{[c.plan.strategy for c in cands]}")
        name, jitted = pick[0].plan.strategy, pick[0].jitted
    platform = jaxmem.targets.get(a.target).platform
    program = from_jaxpr(jitted.trace(*step.flat).jaxpr)
    before = set(a.dump.iterdir())
    fig = read(measure.compile(jitted.lower(*step.flat)), jitted, step.flat)  # the only compile
    print(f"{a.model} ({a.size}) on {a.target}: {name}, compiled peak "
          f"{fig.peak / 2**20:.2f} MiB (argument {fig.argument / 2**20:.2f}, "
          f"output {fig.output / 2**20:.2f}, temp {fig.temp / 2**20:.2f}, "
          f"alias {fig.alias / 2**20:.2f})")
    _jaxmem_live(program, step.donate_flat, platform, a.top)
    _xla_report([f for f in a.dump.iterdir() if f not in before], a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
