"""jaxmem at a built-in policy's memory, on one compile target.

``python -m benchmarks.match_builtin --target v5e --models unet,llama [--out DIR]``

jaxmem's automatic mode caps recompute at ``max_recompute_fraction`` (5%) of the step's FLOPs.
Where a built-in per-block policy compiles lower by spending more (``nothing_saveable``
recomputes every layer: +17% to +35% FLOPs on the zoo), the auto plan and the policy sit at
different points of the memory/FLOPs trade, and the comparison that means something is at
equal memory: ``jaxmem.optimize(step, budget=<the policy's compiled peak>)`` on the same
target, and the FLOPs each one needs to get there.

For each model this compiles, as ``python -m benchmarks`` does (state donated, the jaxmem
compile options, compile only on a deviceless target): plain ``jax.jit``, ``nn.remat`` per
block with ``dots_saveable`` and with ``nothing_saveable``, and ``jaxmem.optimize(step)``;
then, when the lowest built-in peak is below jaxmem's, ``jaxmem.optimize(step, budget=that
peak)``. A budget jaxmem cannot meet is a row with the ``BudgetError`` (lowest peak found).
Writes ``match.json`` and ``match.md`` under ``--out`` (default
``results/match_<target>``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jaxmem
from benchmarks import run, zoo
from jaxmem import measure

BUILTINS = ("dots_saveable", "nothing_saveable")


def _budget_variant(peak: int) -> str:
    """Register ``jaxmem.optimize(step, budget=peak)`` as a run variant; returns its name."""
    name = f"jaxmem(budget={peak})"

    @run.register(name, f"jaxmem.optimize(step, budget={peak} bytes)")
    def _build(w: zoo.Workload) -> Any:
        return jaxmem.optimize(w.step, budget=peak, donate_argnums=run.DONATE_ARGNUMS)

    return name


def _log(name: str, r: dict[str, Any]) -> None:
    print(f"{name:18s} {r['variant']:18s} peak {r['peak']} flops {r['flops']} "
          f"({r['compile_s'] or 0:.0f} s){' ' + r['error'] if r['error'] else ''}",
          file=sys.stderr, flush=True)


def match_model(name: str, target: str, size: str = "bench") -> list[dict[str, Any]]:
    """The rows of one model (see the module docstring)."""
    w = zoo.make(name, size=size)
    rows = []
    for variant in ("plain", *BUILTINS, "jaxmem"):
        r = dataclasses.asdict(run.measure_variant(w, variant, runs=0, target=target))
        rows.append(r)
        _log(name, r)
    by = {r["variant"]: r for r in rows}
    builtins = [by[b] for b in BUILTINS if by[b]["peak"] is not None]
    best = min(builtins, key=lambda r: r["peak"], default=None)
    auto = by["jaxmem"]
    if best is None or auto["peak"] is None or best["peak"] >= auto["peak"]:
        return rows
    r = dataclasses.asdict(run.measure_variant(w, _budget_variant(best["peak"]), runs=0,
                                               target=target))
    r["matches"], r["budget"] = best["variant"], best["peak"]
    _log(name, r)
    rows.append(r)
    return rows


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """One line per (model, variant); the budget row says whether jaxmem met the built-in's
    peak and at how many FLOPs against it."""
    out = [
        f"# jaxmem at a built-in policy's memory: `{meta['command']}`",
        "",
        f"Compiled for {meta['target']} ({meta['jax']} jax, {meta['date'][:10]}); peak = "
        "`argument + output + temp - alias`, state donated; FLOPs: "
        f"{meta['flops_note']}. The budget row is `jaxmem.optimize(step, budget=<lowest "
        "built-in peak>)`.",
        "",
        "| model | variant | peak | vs plain | FLOPs vs plain | vs the built-in | strategy |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    models = dict.fromkeys(r["model"] for r in rows)
    for m in models:
        mine = [r for r in rows if r["model"] == m]
        plain = next(r for r in mine if r["variant"] == "plain")
        by = {r["variant"]: r for r in mine}
        for r in mine:
            if r.get("error") and not r.get("matches"):
                out.append(f"| {m} | {r['variant']} | error: {r['error'][:80]} | | | | |")
                continue
            versus = ""
            if r.get("matches"):
                b = by[r["matches"]]
                if r.get("error"):
                    versus = f"budget not met: {r['error'][:120]}"
                else:
                    ok = "at or below" if r["peak"] <= b["peak"] else "above"
                    versus = (f"{ok} {r['matches']}'s peak, FLOPs "
                              f"{run._pct(r['flops'], b['flops'])} vs it")
                if r.get("error"):
                    out.append(f"| {m} | budget={r['budget']} | - | | | {versus} | |")
                    continue
            variant = f"budget={r['budget']}" if r.get("matches") else r["variant"]
            out.append(
                f"| {m} | {variant} | {measure.fmt_bytes(r['peak'])} | "
                f"{run._pct(r['peak'], plain['peak'])} | {run._pct(r['flops'], plain['flops'])} | "
                f"{versus} | {r.get('strategy') or ''} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.match_builtin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cpu", help="cpu or a jaxmem.targets name (v5e, h100...)")
    p.add_argument("--models", required=True, help="comma list of zoo models")
    p.add_argument("--size", default="bench", choices=zoo.SIZES)
    p.add_argument("--out", type=Path, help="default results/match_<target>")
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in zoo.names():
            p.error(f"unknown model {m!r}; choose from {zoo.names()}")
    out = args.out or Path(f"results/match_{args.target}")
    meta = run.machine_info()
    meta.update(
        command=" ".join(["python -m benchmarks.match_builtin",
                          *(sys.argv[1:] if argv is None else argv)]),
        size=args.size, target=str(jaxmem.targets.get(args.target)),
        flops_note=("XLA's cost_analysis" if args.target == "cpu" else
                    "as `python -m benchmarks` counts them on this target (each row's "
                    "`flops_source`)"))
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for m in models:
        rows.extend(match_model(m, args.target, args.size))
        out.mkdir(parents=True, exist_ok=True)  # after every model: a stopped run keeps it
        (out / "match.json").write_text(json.dumps(
            {"meta": dict(meta, seconds=round(time.perf_counter() - t0, 1)), "results": rows},
            indent=2))
    text = markdown(rows, meta)
    (out / "match.md").write_text(text)
    print(text)
    return 1 if any(r.get("error") and not r.get("matches") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
