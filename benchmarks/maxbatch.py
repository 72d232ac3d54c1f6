"""The largest batch that fits a fixed memory budget, per zoo model and variant.

``python -m benchmarks.maxbatch [--quick] [--models mlp,resnet] [--out results/maxbatch]``

For each model the budget is fixed at the compiled peak of the *plain* ``jax.jit`` step at the
model's ``bench`` batch, so plain jit fits exactly that batch. Then, for each variant, the
largest batch whose compiled peak fits the budget is searched for: doubling from the bench
batch until a batch does not fit, then bisection down to a resolution of ``--tol`` (default
1/16 of the batch). Only compiled figures are used (``jaxmem.measure``: ``argument + output +
temp - alias`` of ``memory_analysis()``, barrier flag on CPU); nothing is run.

Variants:

- ``plain``: ``jax.jit(step, donate_argnums=0)``.
- ``builtin``: JAX's best built-in per-block policy: ``nn.remat`` per block with
  ``dots_saveable`` and with ``nothing_saveable``, each searched; the one that fits the larger
  batch is reported (its name in the ``builtin policy`` column).
- ``jaxmem``: ``jaxmem.optimize(step, budget=<budget bytes>, donate_argnums=0)``; a batch fits
  when planning does not raise :class:`jaxmem.BudgetError` and the compiled peak is within
  the budget.

Prints a markdown table and writes ``maxbatch.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

import jaxmem
from benchmarks import zoo
from jaxmem import measure

DONATE = (0,)
DEFAULT_OUT = Path("results/maxbatch")
#: Models searched by default. On 2 CPU cores each takes 3-5 minutes, most of it jaxmem's
#: budget search (up to 6 compiles per batch tried); the transformers, densenet and nnx_mlp
#: can be added with --models (slower compiles).
DEFAULT_MODELS = ("mlp", "cnn_bn", "resnet")
BUILTIN = {
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


def plan_under(fn: Callable[..., Any], args: Any, budget: int, **options: Any
               ) -> tuple[jaxmem.Optimized, Any, jaxmem.BudgetError | None]:
    """``jaxmem.optimize(fn, budget=budget, **options)`` (state donated) planned for ``args``:
    ``(optimized step, plan, None)``, or ``(optimized step, None, the BudgetError)``."""
    step = jaxmem.optimize(fn, budget=budget, donate_argnums=DONATE, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return step, step.plan(*args), None
    except jaxmem.BudgetError as e:
        return step, None, e


@dataclasses.dataclass
class Search:
    """The outcome of one batch search: ``batch`` fits, ``too_big`` does not (None: capped)."""

    variant: str
    batch: int
    peak: int | None
    too_big: int | None
    compiles: int
    seconds: float
    policy: str | None = None
    trail: list[tuple[int, int | None, bool]] = dataclasses.field(default_factory=list)


#: The compile target (``--target``): None compiles for this machine's CPU; a
#: :mod:`jaxmem.targets` spec (``h100``, ``v5e``...) compiles for that device, deviceless.
TARGET: Any = None


def _workload(name: str, size: str, batch: int, policy: Any = None) -> zoo.Workload:
    # Abstract state (ShapeDtypeStructs): compiling needs shapes only, and skipping the
    # parameter initialisation keeps the search fast. Same shapes as zoo.make(..., batch=B).
    w = zoo._make(name, size, batch, policy, 0, abstract=True)
    if TARGET is not None:
        state, batch = jaxmem.targets.place(w.args, TARGET)
        w = dataclasses.replace(w, state=state, batch=batch)
    return w


def plain_peak(name: str, size: str, batch: int, policy: Any = None) -> int:
    """Compiled peak of ``jax.jit(step)`` (state donated), per-block ``policy`` if given."""
    w = _workload(name, size, batch, policy)
    jitted = jax.jit(w.step, donate_argnums=DONATE)
    return measure.figures(measure.compile(jitted.lower(*w.args))).peak


def jaxmem_peak(name: str, size: str, batch: int, budget: int) -> int:
    """Compiled peak of ``jaxmem.optimize(step, budget=budget)``.

    When planning raises :class:`jaxmem.BudgetError`, the lowest peak it found
    (``minimum_bytes``, above the budget) stands in.
    """
    w = _workload(name, size, batch)
    step = jaxmem.optimize(w.step, budget=budget, donate_argnums=DONATE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return measure.figures(measure.compile(step.lower(*w.args))).peak
    except jaxmem.BudgetError as e:
        return max(e.minimum_bytes, budget + 1)


def search(peak_of: Callable[[int], int], budget: int, start: int, *,
           tol: float = 1 / 16, cap: int = 32, variant: str = "",
           known: dict[int, int] | None = None) -> Search:
    """Largest batch ``b`` with ``peak_of(b) <= budget``, in few compiles.

    Compiled peaks grow almost linearly with the batch, so the next batch tried is where the
    line through the two nearest measured points meets the budget (a secant step), kept
    strictly inside the bracket; the first step doubles (or halves) ``start``. Stops when the
    fitting and the non-fitting batch are within ``max(1, tol * batch)``; never searches beyond
    ``cap * start``. ``peak_of`` returns a peak in bytes (a value above the budget when the
    batch cannot fit at all); ``known`` holds peaks already measured.
    """
    t0 = time.perf_counter()
    peaks: dict[int, int] = dict(known or {})
    trail: list[tuple[int, int | None, bool]] = []
    limit = cap * start

    def peak(b: int) -> int:
        if b not in peaks:
            peaks[b] = peak_of(b)
            trail.append((b, peaks[b], peaks[b] <= budget))
        return peaks[b]

    lo, hi = (start, None) if peak(start) <= budget else (None, start)
    for _ in range(40):
        close = hi is not None and lo is not None and hi - lo <= max(1, int(tol * lo))
        if lo is not None and (lo >= limit or close):
            break
        if lo is None and hi == 1:
            break
        step = max(1, int(tol * (lo or 1)))
        known_b = sorted(peaks)
        if lo is not None and hi is not None:
            a, c = lo, hi
        elif lo is not None:
            a, c = (known_b[-2], lo) if len(known_b) > 1 and known_b[-2] < lo else (lo, None)
        else:
            a, c = (hi, known_b[1]) if len(known_b) > 1 and known_b[1] > hi else (None, hi)
        guess = None
        if a is not None and c is not None and peaks[c] != peaks[a]:
            slope = (peaks[c] - peaks[a]) / (c - a)
            if slope > 0:
                guess = int(a + (budget - peaks[a]) / slope)
        if lo is not None and hi is not None:
            b = guess if guess is not None else (lo + hi) // 2
            b = min(max(b, lo + step), hi - step) if hi - lo > 2 * step else lo + step
            b = min(max(b, lo + 1), hi - 1)
        elif lo is not None:
            b = min(limit, max(guess or 2 * lo, lo + step) if guess else 2 * lo)
        else:
            b = max(1, min(guess or hi // 2, hi - 1) if guess else hi // 2)
        if peak(b) <= budget:
            lo = b
        else:
            hi = b
    lo = lo or 0
    return Search(variant, lo, peaks.get(lo), hi, len(trail), time.perf_counter() - t0,
                  trail=trail)


def run_model(name: str, size: str, tol: float, cap: int, log: Callable[[str], None]) -> dict:
    """Budget = plain peak at the size's batch; search plain, built-in policies and jaxmem."""
    start = zoo.config(name, size)["batch"]
    budget = plain_peak(name, size, start)
    log(f"{name}: budget {measure.fmt_bytes(budget)} (plain jit peak at batch {start})")
    out: dict[str, Any] = {"model": name, "size": size, "start_batch": start, "budget": budget,
                           "tol": tol}
    plain = search(lambda b: plain_peak(name, size, b), budget, start, tol=tol, cap=cap,
                   variant="plain", known={start: budget})
    log(f"  plain    -> {plain.batch} ({plain.compiles} compiles, {plain.seconds:.0f}s)")
    builtins = []
    for pname, pol in BUILTIN.items():
        s = search(lambda b, pol=pol: plain_peak(name, size, b, pol), budget, start, tol=tol,
                   cap=cap, variant="builtin")
        s.policy = pname
        builtins.append(s)
        log(f"  {pname} -> {s.batch} ({s.compiles} compiles, {s.seconds:.0f}s)")
    builtin = max(builtins, key=lambda s: (s.batch, -(s.peak or 0)))
    jm = search(lambda b: jaxmem_peak(name, size, b, budget), budget, start, tol=tol, cap=cap,
                variant="jaxmem")
    log(f"  jaxmem   -> {jm.batch} ({jm.compiles} compiles, {jm.seconds:.0f}s)")
    out["plain"] = dataclasses.asdict(plain)
    out["builtin"] = dataclasses.asdict(builtin)
    out["builtin_all"] = [dataclasses.asdict(s) for s in builtins]
    out["jaxmem"] = dataclasses.asdict(jm)
    return out


def _bound(s: dict) -> str:
    capped = "" if s["too_big"] is not None else "+ (cap)"
    return f"{s['batch']}{capped}"


def _x(s: dict, base: dict) -> str:
    return f"{s['batch'] / base['batch']:.2f}x" if base["batch"] else ""


def markdown(rows: Sequence[dict]) -> str:
    """The result table: one row per model."""
    head = ("| model | budget | plain | builtin (best policy) | jaxmem | jaxmem vs plain | "
            "jaxmem vs builtin |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        p, b, j = r["plain"], r["builtin"], r["jaxmem"]
        vs_b = f"{j['batch'] / b['batch']:.2f}x" if b["batch"] else ""
        lines.append(
            f"| {r['model']} | {measure.fmt_bytes(r['budget'])} | {_bound(p)} | "
            f"{_bound(b)} ({b['policy']}) | {_bound(j)} | {_x(j, p)} | {vs_b} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of ``python -m benchmarks.maxbatch``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.maxbatch",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="test sizes, mlp and resnet only, coarse resolution (< 1 min)")
    p.add_argument("--models", help=f"comma list (default {','.join(DEFAULT_MODELS)})")
    p.add_argument("--size", choices=zoo.SIZES, help="zoo size (default bench; test if --quick)")
    p.add_argument("--tol", type=float, help="bisection resolution as a fraction of the batch "
                   "(default 1/16; 1/4 if --quick)")
    p.add_argument("--cap", type=int, default=32, help="largest multiple of the start batch "
                   "searched (default 32)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}/")
    p.add_argument("--target", help="compile for this device (jaxmem.targets: h100, h200, "
                   "a100, v5e, ...), deviceless; default: this machine's CPU")
    p.add_argument("--update", action="store_true",
                   help="re-measure only --models and merge them into the maxbatch.json "
                   "already in --out (its other rows, and their commands, are kept)")
    a = p.parse_args(argv)
    a.size = a.size or ("test" if a.quick else "bench")
    a.tol = a.tol if a.tol is not None else (0.25 if a.quick else 1 / 16)
    default = ("mlp", "resnet") if a.quick else DEFAULT_MODELS
    a.models = [m.strip() for m in a.models.split(",")] if a.models else list(default)
    for m in a.models:
        if m not in zoo.names():
            p.error(f"unknown model {m!r}; choose from {zoo.names()}")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Search every model; print the table; write ``maxbatch.json``."""
    args = parse_args(argv)
    from benchmarks.run import machine_info

    global TARGET
    TARGET = jaxmem.targets.require(args.target) if args.target else None

    t0 = time.perf_counter()
    log = lambda s: print(s, file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for m in args.models:
        rows.append(run_model(m, args.size, args.tol, args.cap, log))
        # after every model, so a run stopped early keeps what it measured
        (args.out / "maxbatch.partial.json").write_text(json.dumps({"results": rows},
                                                                   indent=2))
    commands = []
    old = args.out / "maxbatch.json"
    if args.update and old.exists():
        prev = json.loads(old.read_text())
        fresh = {r["model"] for r in rows}
        rows = [r for r in prev["results"] if r["model"] not in fresh] + rows
        order = {m: i for i, m in enumerate(zoo.names())}
        rows.sort(key=lambda r: order.get(r["model"], len(order)))
        commands = prev["meta"].get("commands", [prev["meta"].get("command")])
    table = markdown(rows)
    print(table)
    print(f"\nbudget = plain jax.jit's compiled peak at the {args.size} batch (so plain fits "
          f"exactly that batch); batch = largest found within a resolution of "
          f"{args.tol:.3g} x batch; compiled figures only (jaxmem.measure), state donated.")
    meta = machine_info()
    meta.update(command=" ".join(["python -m benchmarks.maxbatch",
                                  *(sys.argv[1:] if argv is None else argv)]),
                size=args.size, tol=args.tol, cap=args.cap,
                target=str(TARGET) if TARGET is not None else "cpu",
                seconds=round(time.perf_counter() - t0, 1),
                compiler_options=measure.compiler_options(
                    TARGET.platform if TARGET is not None else "cpu"))
    if commands:
        meta["commands"] = [*commands, meta["command"]]
    (args.out / "maxbatch.json").write_text(json.dumps({"meta": meta, "results": rows},
                                                       indent=2))
    (args.out / "maxbatch.md").write_text(table + "\n")
    (args.out / "maxbatch.partial.json").unlink(missing_ok=True)
    print(f"wrote {args.out / 'maxbatch.json'} and {args.out / 'maxbatch.md'} "
          f"({meta['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
