"""Memory budgets and offload, measured: ``python benchmarks/budget.py [--quick] [--models ...]``.

For each zoo model: the plain-``jax.jit`` compiled peak, then ``jaxmem.optimize(step,
budget=f)`` for f in 0.7, 0.5, 0.35 (compiled peak, fits or ``BudgetError`` with the lowest
peak found, FLOPs overhead by XLA's count, planning time), beside Chen et al.'s sqrt(n)
segments through jaxmem's rewrite (:func:`jaxmem.planning.budget.plan_segments`, with the segment
recomputed per backward region and, ``+persist``, once) and JAX's ``nothing_saveable`` per
block. Then the ResNet-50-sized planning-time check and the offload table.

Every variant donates the train state and is compiled the jaxmem way
(:func:`jaxmem.measure.compile`, CPU barrier flag), like ``python -m benchmarks``. Writes
``budget.json``, ``budget.csv`` and ``budget.md`` under ``--out`` (default
``results/budget``). On CPU the offload rows are predictions (XLA strips host placement when
compiling for CPU); see docs/offload.md.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxmem  # noqa: E402
from benchmarks import zoo  # noqa: E402
from jaxmem import measure  # noqa: E402
from jaxmem.analyzing.analysis import from_program  # noqa: E402
from jaxmem.planning.budget import Budget, BudgetError, CostModel, plan_segments, plan_with_budget  # noqa: E402
from jaxmem.planning.strategies import plan_auto  # noqa: E402
from jaxmem.rewriting.rewrite import rewrite  # noqa: E402

FRACTIONS = (0.7, 0.5, 0.35)
#: bench-size models of the full run: transformer_scan and nnx_mlp repeat transformer and
#: mlp through another front end, and are left to ``--models`` to keep the run in minutes.
FULL = ("mlp", "cnn_bn", "resnet", "densenet", "transformer")
QUICK = ("mlp", "cnn_bn")
MiB = 2**20


def _fig(lowered: Any) -> measure.Figures:
    return measure.figures(measure.compile(lowered))


def _donate(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(range(len(jax.tree_util.tree_leaves(args[0]))))


def _rewritten(program: Any, analysis: Any, recompute: frozenset[int], args: tuple[Any, ...],
               persist: bool = False) -> measure.Figures:
    res = frozenset(r.value for r in analysis.residuals)
    fn = rewrite(program, recompute, frozenset(), res,
                 persist=recompute if persist else frozenset())
    flat = jax.tree_util.tree_leaves(args)
    return _fig(jax.jit(fn, donate_argnums=_donate(args)).lower(*flat))


def bench_model(name: str, size: str, fractions: tuple[float, ...],
                per_region: bool = True) -> list[dict[str, Any]]:
    w = zoo.make(name, size=size)
    rows: list[dict[str, Any]] = []
    plain = _fig(jax.jit(w.step, donate_argnums=(0,)).lower(*w.args))

    def row(variant: str, fig: measure.Figures | None, seconds: float, **extra: Any) -> None:
        rows.append(dict(
            model=name, size=size, variant=variant, plain_peak=plain.peak,
            peak=fig.peak if fig else None,
            peak_frac=round(fig.peak / plain.peak, 4) if fig else None,
            flops_overhead=round(fig.flops / plain.flops - 1, 4) if fig and plain.flops else None,
            seconds=round(seconds, 2), **extra))

    row("plain", plain, 0.0)
    t = time.perf_counter()
    ns = w.with_remat(jax.checkpoint_policies.nothing_saveable)
    row("nothing_saveable/block", _fig(jax.jit(ns.step, donate_argnums=(0,)).lower(*ns.args)),
        time.perf_counter() - t)
    t = time.perf_counter()
    program = jaxmem.trace(w.step, *w.args)
    analysis = from_program(program)
    seg = plan_segments(analysis)
    seg_s = time.perf_counter() - t
    for persist in (False, True) if per_region else (True,):
        t = time.perf_counter()
        fig = _rewritten(program, analysis, seg.recompute, w.args, persist=persist)
        row(seg.strategy + ("+persist" if persist else ""), fig,
            seg_s + time.perf_counter() - t)
    for f in fractions:
        t = time.perf_counter()
        opt = jaxmem.optimize(w.step, budget=Budget(f, max_compiles=5))
        try:
            plan = opt.plan(*w.args)
        except BudgetError as e:
            row(f"budget={f}", None, time.perf_counter() - t, budget=e.requested_bytes,
                fits=False, minimum=e.minimum_bytes)
            continue
        dt = time.perf_counter() - t
        note = next((n for n in plan.notes if n.startswith("planned by")), "")
        compiles = note.split(" compiles")[0].rsplit(" ", 1)[-1] if "compiles" in note else ""
        row(f"budget={f}", plan.compiled, dt, budget=plan.budget,
            fits=plan.compiled.peak <= plan.budget, strategy=plan.strategy,
            predicted_overhead=round(plan.predicted_overhead, 4), compiles=compiles)
    return rows


# --- ResNet-50-sized planning time ----------------------------------------------------------

def resnet50_step(batch: int = 2, image: int = 32) -> tuple[Any, tuple[Any, ...]]:
    """A ResNet-50-shaped linen model (bottleneck blocks 3-4-6-3, widths 64..2048, batch
    norm) at a small image size: the graph size of ResNet-50, the memory of a toy."""
    import flax.linen as nn
    import optax

    class Bottleneck(nn.Module):
        width: int
        stride: int

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            bn = lambda name: nn.BatchNorm(use_running_average=False, name=name)  # noqa: E731
            y = nn.relu(bn("bn1")(nn.Conv(self.width, (1, 1), use_bias=False)(x)))
            y = nn.relu(bn("bn2")(nn.Conv(self.width, (3, 3), (self.stride,) * 2,
                                          use_bias=False)(y)))
            y = bn("bn3")(nn.Conv(4 * self.width, (1, 1), use_bias=False)(y))
            if x.shape[-1] != 4 * self.width or self.stride != 1:
                x = bn("bn_proj")(nn.Conv(4 * self.width, (1, 1), (self.stride,) * 2,
                                          use_bias=False)(x))
            return nn.relu(x + y)

    class ResNet50(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.BatchNorm(use_running_average=False)(
                nn.Conv(64, (3, 3), use_bias=False)(x)))
            for s, (n, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
                for i in range(n):
                    x = Bottleneck(width, 2 if (i == 0 and s > 0) else 1,
                                   name=f"stage{s}_block{i}")(x)
            return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))

    model = ResNet50()
    x = jnp.ones((batch, image, image, 3))
    y = jnp.zeros((batch,), jnp.int32)
    variables = model.init(jax.random.PRNGKey(0), x)
    tx = optax.sgd(0.1, momentum=0.9)
    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))

    def step(state: Any, batch: Any) -> Any:
        params, stats, opt = state

        def loss(p: Any) -> Any:
            logits, upd = model.apply({"params": p, "batch_stats": stats}, batch[0],
                                      mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean(), upd

        (val, upd), g = jax.value_and_grad(loss, has_aux=True)(params)
        u, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, u), upd["batch_stats"], opt), val

    return step, (state, (x, y))


def planning_time() -> dict[str, Any]:
    step, args = resnet50_step()
    t0 = time.perf_counter()
    program = jaxmem.trace(step, *args)
    t1 = time.perf_counter()
    analysis = from_program(program)
    t2 = time.perf_counter()
    auto = plan_auto(analysis)
    t3 = time.perf_counter()
    # halfway between the arguments and the predicted plain peak; model only, no compiles
    budget = int(analysis.argument_bytes + 0.5 * (analysis.peak_bytes - analysis.argument_bytes))
    try:
        outcome = plan_with_budget(analysis, budget, auto=auto).strategy
    except BudgetError as e:  # the model alone found no plan: planning time still counts
        outcome = f"BudgetError (model minimum {e.minimum_bytes / 2**20:.1f} MiB)"
    t4 = time.perf_counter()
    return dict(model="ResNet-50-shaped (linen, 3-4-6-3 bottlenecks, 32x32, batch 2)",
                nodes=len(program.nodes), residuals=len(analysis.residuals),
                trace_s=round(t1 - t0, 2), analyze_s=round(t2 - t1, 2),
                plan_auto_s=round(t3 - t2, 2), plan_budget_s=round(t4 - t3, 2),
                planning_s=round(t4 - t1, 2), strategy=outcome,
                under_5s=(t4 - t1) < 5.0)


# --- offload --------------------------------------------------------------------------------

#: A deeper, larger-batch mlp for the "below what recompute reaches" offload rows: its block
#: boundary values are a large share of the peak (built abstract: nothing is allocated).
OFFLOAD_DEEP = {"bench": dict(depth=16, batch=4096), "test": dict(depth=4)}


def offload_rows(name: str, size: str, overrides: dict[str, Any] | None = None,
                 below: bool = False) -> list[dict[str, Any]]:
    """Recompute only vs offload allowed at one budget, on the h200 and cpu profiles.

    ``below=False``: a budget 10% below what the auto plan (save + recompute within its 5%
    FLOPs cap) compiles to; both may fit. ``below=True``: a budget 20% below the lowest peak
    save + recompute reaches at all (``BudgetError.minimum_bytes`` of a recompute-only plan),
    so only offload can fit. The model is built abstract (nothing initialised), so
    ``overrides`` may make it larger than this machine's memory.
    """
    overrides = dict(overrides or {})
    w = zoo.make(name, size=size, abstract=True, **overrides)
    label = name + "".join(f" {k}={v}" for k, v in overrides.items())
    opt = jaxmem.optimize(w.step, donate_argnums=(0,))
    auto = opt.plan(*w.args)
    analysis = opt.analysis(*w.args)
    reach = auto.compiled.peak
    if below:
        try:  # a budget just above the arguments: nothing fits; the error says how low it got
            jaxmem.optimize(w.step, budget=analysis.argument_bytes + 1, offload=False,
                            donate_argnums=(0,)).plan(*w.args)
        except BudgetError as e:
            reach = e.minimum_bytes
    target = int((0.8 if below else 0.9) * reach)
    out = []
    for prof in ("h200", "cpu"):
        row: dict[str, Any] = dict(model=label, size=size, profile=prof, below=below,
                                   plain_peak=auto.baseline.peak, save_recompute_peak=reach,
                                   budget=target)
        for off in (False, True):
            key = "offload" if off else "recompute_only"
            t = time.perf_counter()
            try:
                plan = jaxmem.optimize(w.step, budget=Budget(target, profile=prof),
                                       offload=off, donate_argnums=(0,)).plan(*w.args)
            except BudgetError as e:
                row[f"{key}_fits"] = False
                row[f"{key}_minimum"] = e.minimum_bytes
                continue
            model = CostModel(analysis, prof, base_peak=auto.baseline.peak)
            depth = plan.region_depth
            extra = (plan.recompute_flops / model.profile.flops_per_s
                     + model.transfer(plan.offload, depth))
            note = next((n for n in plan.notes if "predicted device peak" in n), "")
            dev = plan.compiled.peak
            if note:
                dev = int(float(re.search(r"predicted device peak ([0-9.]+) MiB", note)[1])
                          * MiB)
            row.update({
                f"{key}_fits": True, f"{key}_seconds": round(time.perf_counter() - t, 1),
                f"{key}_strategy": plan.strategy,
                f"{key}_compiled_peak": plan.compiled.peak,
                f"{key}_device_peak": dev,
                f"{key}_flops_overhead": round(plan.compiled.flops / auto.baseline.flops - 1, 4),
                f"{key}_n_offload": len(plan.offload),
                f"{key}_offload_bytes": sum(c.residual.nbytes
                                            for c in plan.of(jaxmem.Decision.OFFLOAD)),
                f"{key}_pred_extra_ms": round(1e3 * extra, 3),
                f"{key}_pred_transfer_ms": round(1e3 * model.transfer(plan.offload, depth), 3),
                f"{key}_pred_step_ms": round(1e3 * model.step_time, 3),
                f"{key}_device_peak_note": note[:200],
            })
        out.append(row)
    return out


# --- output ---------------------------------------------------------------------------------

def _mib(x: Any) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def markdown(rows: list[dict[str, Any]], plan_t: dict[str, Any], off: list[dict[str, Any]],
             cmd: str) -> str:
    lines = [f"# jaxmem budgets: `{cmd}`", "",
             f"jax {jax.__version__}, {jax.default_backend()}, {platform.machine()}, "
             f"{datetime.date.today()}. Peaks are compiled `argument + output + temp - alias` "
             "(MiB); FLOPs by XLA's `cost_analysis` against plain jit.", "",
             "| model | variant | peak MiB | % plain | FLOPs + | fits | s |",
             "|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        fits = "" if "fits" not in r else ("yes" if r["fits"] else
                                          f"no (min {_mib(r.get('minimum'))})")
        pct = "-" if r["peak_frac"] is None else f"{100 * r['peak_frac']:.0f}%"
        fl = "-" if r["flops_overhead"] is None else f"{100 * r['flops_overhead']:+.1f}%"
        var = r["variant"] + (f" ({r['strategy']})" if r.get("strategy") else "")
        lines.append(f"| {r['model']} | {var} | {_mib(r['peak'])} | {pct} | {fl} | {fits} | "
                     f"{r['seconds']} |")
    if plan_t:
        lines += ["", "## Planning time, ResNet-50-sized", "",
                  f"{plan_t['model']}: {plan_t['nodes']} nodes, {plan_t['residuals']} residuals. "
                  f"trace {plan_t['trace_s']} s (not planning), analyse {plan_t['analyze_s']} s, "
                  f"auto plan {plan_t['plan_auto_s']} s, budget plan (model only) "
                  f"{plan_t['plan_budget_s']} s: **planning {plan_t['planning_s']} s** "
                  f"(target < 5 s: {'met' if plan_t['under_5s'] else 'missed'})."]
    if off:
        lines += ["", "## Offload: recompute only vs offload allowed", "",
                  "Budget 10% below the auto plan's compiled peak, or (*below*) 20% below the "
                  "lowest peak save + recompute reaches at all. *device* is XLA's compiled peak, "
                  "or on CPU for an offload plan the predicted device peak (compiled minus the "
                  "host-resident bytes at the predicted peak). Extra ms = predicted recompute "
                  "time + exposed transfer on the profile.", "",
                  "| model | profile | plain | save+recompute | budget | recompute only | "
                  "offload allowed | offloaded | pred. extra ms (exposed transfer) / step ms |",
                  "|---|---|---:|---:|---:|---|---|---:|---|"]
        for r in off:
            def cell(k: str, r: dict[str, Any] = r) -> str:
                if not r.get(f"{k}_fits"):
                    return f"no (min {_mib(r.get(f'{k}_minimum'))})"
                return (f"{_mib(r[f'{k}_device_peak'])} device, "
                        f"{100 * r[f'{k}_flops_overhead']:+.1f}% FLOPs, "
                        f"{r[f'{k}_pred_extra_ms']} ms ({r[f'{k}_strategy']})")
            extra = "-"
            if r.get("offload_fits"):
                extra = (f"{r['offload_pred_extra_ms']} ({r['offload_pred_transfer_ms']}) / "
                         f"{r['offload_pred_step_ms']}")
            lines.append(
                f"| {r['model']}{' (*below*)' if r.get('below') else ''} | {r['profile']} | "
                f"{_mib(r['plain_peak'])} | {_mib(r['save_recompute_peak'])} | "
                f"{_mib(r['budget'])} | {cell('recompute_only')} | {cell('offload')} | "
                f"{_mib(r.get('offload_offload_bytes'))} MiB ({r.get('offload_n_offload', 0)}) | "
                f"{extra} |")
        lines += ["", "On CPU XLA strips host placement, so the compiled peak of an offload plan "
                  "still counts the offloaded values; the fit is checked against the predicted "
                  "device peak, see docs/offload.md."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="test-size models, a subset")
    ap.add_argument("--models", nargs="*", help=f"zoo models (default {' '.join(FULL)})")
    ap.add_argument("--out", default="results/budget", help="output folder")
    ap.add_argument("--no-extras", action="store_true",
                    help="skip the ResNet-50 planning-time check and the offload table")
    ns = ap.parse_args(argv)
    size = "test" if ns.quick else "bench"
    models = ns.models or (QUICK if ns.quick else FULL)
    cmd = "python benchmarks/budget.py" + (" --quick" if ns.quick else "") + (
        f" --models {' '.join(ns.models)}" if ns.models else "")
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for m in models:
        t = time.perf_counter()
        rows += bench_model(m, size, FRACTIONS, per_region=not ns.quick)
        print(f"[{m}] {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    plan_t: dict[str, Any] = {}
    off: list[dict[str, Any]] = []
    if not ns.no_extras:
        plan_t = planning_time()
        print(f"[resnet50 planning] {plan_t['planning_s']} s", file=sys.stderr, flush=True)
        off = offload_rows("mlp", size)
        off += offload_rows("mlp", size, OFFLOAD_DEEP[size], below=True)
        print(f"[offload] done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command=cmd, jax=jax.__version__, backend=jax.default_backend(),
                date=str(datetime.date.today()), seconds=round(time.perf_counter() - t0, 1))
    (out / "budget.json").write_text(json.dumps(
        dict(meta=meta, rows=rows, planning_time=plan_t, offload=off), indent=1))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "budget.csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    md = markdown(rows, plan_t, off, cmd)
    (out / "budget.md").write_text(md)
    print(md)
    print(f"total {meta['seconds']} s; wrote {out}/budget.{{json,csv,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
