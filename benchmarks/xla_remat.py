"""jaxmem's budgets beside XLA:GPU's own rematerialisation, on a compile-only GPU target.

XLA:GPU rematerialises by itself when a program does not fit the device
(``HloRematerialization``): what a user gets for free when a step barely fits. For each
zoo model and each budget ``B`` (a fraction of plain ``jax.jit``'s peak on the target), this
compiles

- **XLA**: plain ``jax.jit`` on the same GPU with ``device_memory_size = B``
  (``jaxmem.targets.Target.with_memory``): the compiler alone;
- **jaxmem**: ``jaxmem.optimize(step, budget=B)`` on the full-size GPU (XLA's remat has
  nothing to do there): jaxmem alone, or its ``BudgetError`` with the lowest peak it found;

and records each compiled peak (``argument + output + temp - alias``) and the matmul and
convolution FLOPs in the optimised HLO (:func:`jaxmem.measure.hlo_dot_flops`,
:func:`jaxmem.measure.hlo_conv_flops`: XLA's rematerialised copies are counted there, which
no pre-compile count can see). Compile only: nothing runs.

    python -m benchmarks.xla_remat --target h100 --models transformer,mlp,resnet \\
        --budgets 0.9,0.8,0.7,0.6,0.5 --out benchmarks/results/xla_remat
    python -m benchmarks.xla_remat --models resnet --merge   # redo one model, keep the rest
    python -m benchmarks.xla_remat --table benchmarks/results/xla_remat/results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax

import jaxmem
from benchmarks import zoo
from jaxmem import measure


def _flops(compiled: Any) -> float:
    """Matmul + convolution FLOPs of the optimised HLO."""
    return measure.hlo_dot_flops(compiled) + measure.hlo_conv_flops(compiled)


def _compile(fn: Any, args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    compiled = measure.compile(fn.lower(*args))
    return compiled, time.perf_counter() - t0


def measure_model(name: str, target: str, budgets: list[float], size: str = "bench") -> dict:
    """One model's rows: plain, then XLA and jaxmem at each budget fraction."""
    t = jaxmem.targets.require(target)
    w = zoo.make(name, size=size)
    args = t.place(w.args)
    plain_fn = jax.jit(w.step, donate_argnums=0)
    compiled, secs = _compile(plain_fn, args)
    plain = measure.figures(compiled)
    plain_flops = _flops(compiled)
    rows = [dict(variant="plain", budget=None, peak=plain.peak, hlo_flops=plain_flops,
                 fits=True, compile_s=secs)]
    for frac in budgets:
        b = int(frac * plain.peak)
        small = t.with_memory(b)
        c, secs = _compile(plain_fn, small.place(w.args))
        f = measure.figures(c)
        rows.append(dict(variant="xla", budget=frac, budget_bytes=b, peak=f.peak,
                         hlo_flops=_flops(c), fits=f.peak <= b, compile_s=secs))
        t0 = time.perf_counter()
        opt = jaxmem.optimize(w.step, budget=b, donate_argnums=(0,))
        try:
            plan = opt.plan(*args)
        except jaxmem.BudgetError as e:
            rows.append(dict(variant="jaxmem", budget=frac, budget_bytes=b,
                             peak=e.minimum_bytes, hlo_flops=None, fits=False,
                             compile_s=time.perf_counter() - t0, strategy="BudgetError"))
            continue
        c = opt.lower(*args).compile()
        rows.append(dict(variant="jaxmem", budget=frac, budget_bytes=b,
                         peak=plan.compiled.peak, hlo_flops=_flops(c),
                         fits=plan.compiled.peak <= b, compile_s=time.perf_counter() - t0,
                         strategy=plan.strategy))
    return dict(model=name, size=size, batch=w.batch_size, target=str(t), rows=rows)


def render(data: dict) -> str:
    """Markdown: per model, one row per budget with XLA's and jaxmem's peak and matmul +
    convolution FLOPs."""
    out = [f"Compiled for {data['meta']['target']} without the device (`{data['meta']['command']}`,"
           f" {data['meta']['date']}, jax {data['meta']['jax']}). Peak = argument + output + "
           "temp − alias; FLOPs = matmul and convolution FLOPs in the optimised HLO (XLA's "
           "rematerialised copies included), relative to plain jit's; "
           "✓ = within the budget."]
    for m in data["meta"].get("merged", []):
        out.append(f"Re-measured with `{m['command']}` ({m['date']}).")
    out.append("")
    for m in data["models"]:
        plain = m["rows"][0]
        out += [f"**{m['model']}** ({m['size']}, batch {m['batch']}), plain jit "
                f"{measure.fmt_bytes(plain['peak'])}", "",
                "| budget | XLA remat: peak | FLOPs | jaxmem: peak | FLOPs | jaxmem plan |",
                "|---:|---:|---:|---:|---:|---|"]
        by = {}
        for r in m["rows"][1:]:
            by.setdefault(r["budget"], {})[r["variant"]] = r
        for frac, pair in by.items():
            def cell(r: dict | None, plain: dict = plain) -> tuple[str, str]:
                if r is None:
                    return "", ""
                mark = "✓" if r["fits"] else "✗"
                peak = f"{measure.fmt_bytes(r['peak'])} {mark}"
                if r.get("hlo_flops") is None:
                    return (f"≥ {measure.fmt_bytes(r['peak'])} ✗", "")
                return peak, f"{100 * (r['hlo_flops'] / plain['hlo_flops'] - 1):+.1f}%"
            xp, xf = cell(pair.get("xla"))
            jp, jf = cell(pair.get("jaxmem"))
            strat = (pair.get("jaxmem") or {}).get("strategy", "")
            out.append(f"| {frac:.2f} × plain = {measure.fmt_bytes(frac * plain['peak'])} "
                       f"| {xp} | {xf} | {jp} | {jf} | {strat} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.xla_remat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="h100")
    p.add_argument("--models", default="transformer,mlp,resnet")
    p.add_argument("--budgets", default="0.9,0.8,0.7,0.6,0.5")
    p.add_argument("--size", default="bench")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/xla_remat"))
    p.add_argument("--table", type=Path, help="render this results.json and exit")
    p.add_argument("--merge", action="store_true",
                   help="replace these models in an existing results.json, keep the others")
    args = p.parse_args(argv)
    if args.table:
        print(render(json.loads(args.table.read_text())))
        return 0
    budgets = [float(x) for x in args.budgets.split(",")]
    meta = dict(command="python -m benchmarks.xla_remat " + " ".join(argv or sys.argv[1:]),
                target=str(jaxmem.targets.get(args.target)), jax=jax.__version__,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    data = dict(meta=meta, models=[])
    args.out.mkdir(parents=True, exist_ok=True)
    old = args.out / "results.json"
    if args.merge and old.exists():
        data = json.loads(old.read_text())
        data["meta"].setdefault("merged", []).append(meta)
    for name in args.models.split(","):
        row = measure_model(name, args.target, budgets, args.size)
        data["models"] = [m for m in data["models"] if m["model"] != name] + [row]
        (args.out / "results.json").write_text(json.dumps(data, indent=2))  # keep partials
        print(render(dict(meta=meta, models=data["models"][-1:])), flush=True)
    (args.out / "table.md").write_text(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
