"""Benchmark runner: every zoo model under every registered variant, measured the jaxmem way.

``python -m benchmarks`` compiles each zoo model's train step once per *variant* (plain
``jax.jit``, per-block ``jax.checkpoint`` policies, and ``jaxmem.optimize`` once it exists),
reads the compiled peak and FLOPs with :mod:`jaxmem.measure` only, times the step on the CPU,
prints one table per model and writes ``results.json`` and ``results.csv``.

Every variant is compiled the same way: ``donate_argnums=(0,)`` (the train state is donated)
and :func:`jaxmem.measure.compile` (the CPU barrier flag, so remat is not undone on CPU).

A variant is a function ``build(workload) -> jitted``, where ``jitted`` has ``.lower(*args)``
like ``jax.jit``'s result. Add one with :func:`register`::

    @register("my_variant")
    def _mine(w: zoo.Workload):
        return jax.jit(my_transform(w.step), donate_argnums=DONATE_ARGNUMS)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from benchmarks import zoo
from jaxmem import measure

#: Every variant donates the train state (argument 0), so that peaks are comparable.
DONATE_ARGNUMS: tuple[int, ...] = (0,)

Build = Callable[[zoo.Workload], Any]

#: The variant registry: name -> ``build(workload)`` returning a jitted-like callable.
VARIANTS: dict[str, Build] = {}

#: One line per variant, shown under the tables.
DESCRIPTIONS: dict[str, str] = {}

#: The variant that the "vs plain" columns compare against.
BASELINE = "plain"

DEFAULT_OUT = Path("results/bench")


def register(name: str, description: str = "") -> Callable[[Build], Build]:
    """Decorator adding ``build(workload) -> jitted`` to :data:`VARIANTS` under ``name``."""

    def deco(build: Build) -> Build:
        VARIANTS[name] = build
        DESCRIPTIONS[name] = description or (build.__doc__ or "").strip().splitlines()[0]
        return build

    return deco


@register("plain", "jax.jit(step), no remat")
def _plain(w: zoo.Workload) -> Any:
    return jax.jit(w.step, donate_argnums=DONATE_ARGNUMS)


def _per_block(policy: Any) -> Build:
    def build(w: zoo.Workload) -> Any:
        return jax.jit(w.with_remat(policy).step, donate_argnums=DONATE_ARGNUMS)

    return build


register("dots_saveable", "nn.remat per block, policy=jax.checkpoint_policies.dots_saveable")(
    _per_block(jax.checkpoint_policies.dots_saveable)
)
register("nothing_saveable", "nn.remat per block, policy=jax.checkpoint_policies.nothing_saveable")(
    _per_block(jax.checkpoint_policies.nothing_saveable)
)


def _register_jaxmem() -> None:
    """Register ``jaxmem`` (``jaxmem.optimize(step)``) once the library provides it."""
    optimize = getattr(jaxmem, "optimize", None)
    if optimize is None:
        return
    try:
        takes_donate = "donate_argnums" in inspect.signature(optimize).parameters
    except (TypeError, ValueError):
        takes_donate = False

    @register("jaxmem", "jaxmem.optimize(step) (default strategy)")
    def _jaxmem(w: zoo.Workload) -> Any:
        if takes_donate:
            return optimize(w.step, donate_argnums=DONATE_ARGNUMS)
        return optimize(w.step)


_register_jaxmem()


# --------------------------------------------------------------------------------------------
# Measuring one (model, variant)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """One (model, variant) measurement. Bytes are per device; times in seconds."""

    model: str
    variant: str
    size: str
    batch: int
    n_blocks: int
    peak: int | None = None
    argument: int | None = None
    output: int | None = None
    temp: int | None = None
    alias: int | None = None
    flops: float | None = None
    compile_s: float | None = None
    step_s: float | None = None
    step_times: list[float] = dataclasses.field(default_factory=list)
    loss: float | None = None
    timed: str = "compiled"
    error: str | None = None
    target: str = "cpu"
    flops_source: str = "xla"
    #: The plan's strategy, for a jaxmem variant (``Plan.strategy``).
    strategy: str | None = None


def _copy(tree: Any) -> Any:
    """A fresh copy, so that donating it leaves the workload's own state intact."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def measure_variant(w: zoo.Workload, variant: str, runs: int = 3, warmup: int = 1,
                    target: str = "cpu") -> Result:
    """Compile ``w`` under ``variant``; read peak and FLOPs; time ``runs`` steps after warm-up.

    The timed executable is the measured one (``jaxmem.measure.compile``). Errors are caught
    and recorded in :attr:`Result.error` so that one failing variant does not stop the run.
    ``target``: a :mod:`jaxmem.targets` name; other than ``"cpu"`` the step is compiled for
    that device without it (compile only: no timing; FLOPs are jaxmem's count where the
    compiler gives none, for every variant alike).
    """
    r = Result(w.name, variant, w.size, w.batch_size, w.n_blocks)
    try:
        args = w.args if target == "cpu" else jaxmem.targets.place(w.args, target)
        t0 = time.perf_counter()
        jitted = VARIANTS[variant](w)
        compiled = measure.compile(jitted.lower(*args))
        r.compile_s = time.perf_counter() - t0
        if hasattr(jitted, "plan"):  # jaxmem.optimize: its plan holds the figures it chose
            plan = jitted.plan(*args)
            f, r.strategy = plan.compiled, plan.strategy
        else:
            f = measure.compiled_figures(compiled, jitted, args,
                                         platform=jaxmem.targets.platform_of(args) or "cpu")
        r.peak, r.flops, r.flops_source = f.peak, f.flops, f.flops_source
        r.argument, r.output, r.temp, r.alias = f.argument, f.output, f.temp, f.alias
        r.target = target
        if target != "cpu":
            return r
        run, state, batch, times = compiled, _copy(w.state), w.batch, []
        for i in range(max(warmup, 0) + runs):
            t0 = time.perf_counter()
            try:
                state, metrics = run(state, batch)
            except TypeError:
                if i or run is jitted:
                    raise
                # A Compiled that does not take the step's own pytrees (jaxmem.optimize's
                # takes the flattened leaves): time the variant's own callable instead, which
                # runs the plan it compiled the jaxmem way.
                run, r.timed, state = jitted, "callable", _copy(w.state)
                state, metrics = run(state, batch)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t0)
            if i == 0:
                r.loss = float(metrics["loss"])
        r.step_times = times[max(warmup, 0) :]
        r.step_s = statistics.median(r.step_times) if r.step_times else None
    except Exception as e:  # noqa: BLE001 - recorded, reported, and the run goes on
        r.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return r


# --------------------------------------------------------------------------------------------
# Tables and files
# --------------------------------------------------------------------------------------------


def _pct(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return ""
    return f"{100.0 * (x - base) / base:+.1f}%"


#: Marks a step time taken through the variant's callable, not the measured ``Compiled``.
CALLABLE_MARK = "†"


def _ms(r: dict[str, Any]) -> str:
    if r.get("step_s") is None:
        return ""
    mark = f" {CALLABLE_MARK}" if r.get("timed") == "callable" else ""
    return f"{1e3 * r['step_s']:.1f}{mark}"


def table_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Format result dicts (one model) as display rows; the % columns compare with plain."""
    base = next((r for r in results if r["variant"] == BASELINE and not r.get("error")), None)
    rows = []
    for r in results:
        if r.get("error"):
            rows.append({"variant": r["variant"], "peak": "error: " + r["error"][:60] + "…"})
            continue
        rows.append(
            {
                "variant": r["variant"],
                "peak": measure.fmt_bytes(r["peak"]),
                "peak vs plain": _pct(r["peak"], base and base["peak"]),
                "GFLOP": f"{r['flops'] / 1e9:.3f}",
                "FLOPs vs plain": _pct(r["flops"], base and base["flops"]),
                "step ms": _ms(r),
                "compile s": f"{r['compile_s']:.1f}",
            }
        )
    return rows


COLUMNS = ("variant", "peak", "peak vs plain", "GFLOP", "FLOPs vs plain", "step ms", "compile s")


def format_text_table(title: str, results: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table of one model's results."""
    rows = table_rows(results)
    widths = {c: max([len(c)] + [len(row.get(c, "")) for row in rows]) for c in COLUMNS}
    line = "  ".join(c.ljust(widths[c]) for c in COLUMNS)
    out = [title, line, "-" * len(line)]
    for row in rows:
        out.append("  ".join(row.get(c, "").ljust(widths[c]) for c in COLUMNS).rstrip())
    return "\n".join(out)


def machine_info() -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    import flax
    import jaxlib
    import optax

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "platform": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "os": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "jaxmem": jaxmem.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_results(out: Path, meta: dict[str, Any], results: Sequence[Result]) -> None:
    """``out/results.json`` (meta + results) and ``out/results.csv`` (one row per result)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(r) for r in results]
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    fields = [f.name for f in dataclasses.fields(Result) if f.name != "step_times"]
    meta_cols = ("platform", "cpu_count", "jax", "date")
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*fields, *meta_cols])
        writer.writeheader()
        for row in rows:
            writer.writerow({**{k: row[k] for k in fields}, **{k: meta[k] for k in meta_cols}})


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The runner's command line (see ``python -m benchmarks --help``)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Compiled peak, FLOPs and CPU step time of the jaxmem zoo under each "
        "variant. `python -m benchmarks table` renders results.json as markdown.",
    )
    p.add_argument("--quick", action="store_true", help="test sizes, 1 timing run (< 2 min)")
    p.add_argument("--size", choices=zoo.SIZES, help="zoo size (default: bench; test if --quick)")
    p.add_argument("--models", help=f"comma list (default all: {','.join(zoo.names())})")
    p.add_argument("--variants", help="comma list (default all registered)")
    p.add_argument("--runs", type=int, help="timed runs per variant (default 3; 1 if --quick)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}/")
    p.add_argument("--list", action="store_true", help="list models and variants, then exit")
    p.add_argument("--target", default="cpu",
                   help="compile for this device (jaxmem.targets: h100, h200, a100, v5e, ...); "
                   "other than cpu, compile only: peaks and FLOPs, no step times")
    args = p.parse_args(argv)
    args.size = args.size or ("test" if args.quick else "bench")
    args.runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    args.models = _split(args.models) or zoo.names()
    args.variants = _split(args.variants) or list(VARIANTS)
    for m in args.models:
        if m not in zoo.names():
            p.error(f"unknown model {m!r}; choose from {zoo.names()}")
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; registered: {list(VARIANTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print tables; write results. Returns 1 if any variant errored."""
    args = parse_args(argv)
    if args.list:
        for m in zoo.names():
            print(f"model    {m:18s} {zoo.describe(m)}")
        for v in VARIANTS:
            print(f"variant  {v:18s} {DESCRIPTIONS[v]}")
        return 0
    from tqdm import tqdm

    meta = machine_info()
    meta.update(
        command=" ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)]),
        size=args.size,
        runs=args.runs,
        warmup=args.warmup,
        donate_argnums=list(DONATE_ARGNUMS),
        compiler_options=measure.compiler_options(
            "cpu" if args.target == "cpu" else jaxmem.targets.get(args.target).platform),
        target=str(jaxmem.targets.get(args.target)),
        variants={v: DESCRIPTIONS[v] for v in args.variants},
        models={m: zoo.describe(m) for m in args.models},
    )
    results: list[Result] = []
    bar = tqdm(total=len(args.models) * len(args.variants), unit="compile", file=sys.stderr)
    for name in args.models:
        bar.set_description(f"{name}: build")
        w = zoo.make(name, size=args.size)
        mine = []
        for variant in args.variants:
            bar.set_description(f"{name}: {variant}")
            mine.append(measure_variant(w, variant, runs=args.runs, warmup=args.warmup,
                                        target=args.target))
            bar.update()
        results.extend(mine)
        # after every model, so a run stopped early keeps what it measured
        write_results(args.out, dict(meta, partial=True), results)
        title = (
            f"\n{name} ({args.size}, batch {w.batch_size}, {w.n_blocks} blocks): {w.description}"
        )
        tqdm.write(format_text_table(title, [dataclasses.asdict(r) for r in mine]))
    bar.close()
    print(
        f"\npeak = argument + output + temp - alias (jaxmem.measure), per device; every variant "
        f"jitted with donate_argnums={DONATE_ARGNUMS} (state donated) and compiled with "
        f"{meta['compiler_options']}; step = median of {args.runs} run(s) after "
        f"{args.warmup} warm-up on {meta['platform']} ({meta['cpu_count']} CPUs). FLOPs: XLA "
        f"counts a scan body once. {CALLABLE_MARK}: timed through the variant's own callable "
        "(its Compiled does not take the step's pytrees)."
        + ("" if args.target == "cpu" else f" Compiled for {meta['target']} without the "
           "device (jaxmem.targets): compile-only figures, no step times; FLOPs are jaxmem's "
           "count of each variant's program (the target compiler reports none without the "
           "device), which "
           "counts a scan body once per iteration.")
    )
    write_results(args.out, meta, results)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.csv'}")
    failed = [r for r in results if r.error]
    for r in failed:
        print(f"ERROR {r.model}/{r.variant}: {r.error}", file=sys.stderr)
    return 1 if failed else 0
