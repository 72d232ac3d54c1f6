"""Plans inside scan bodies against per-layer built-in policies and MaxText's presets.

``python -m benchmarks.scan_plans [--models transformer_scan,llama_scan] [--size bench]
[--target cpu] [--out results/scan_plans] [--no-maxbatch] [--no-presets] [--check]``

Two tables, compiled figures only (``jaxmem.measure``; the barrier flag on CPU; state donated):

1. **Max batch in plain jit's memory.** Budget = the compiled peak of plain ``jax.jit`` at the
   size's batch. For ``plain``, per-layer ``nothing_saveable`` (``nn.remat`` around each
   scanned layer) and ``jaxmem.optimize(step, budget=<budget>)``, the largest batch whose
   peak fits (``benchmarks.maxbatch.search``: secant steps, resolution ``--tol``). With
   ``--check``, jaxmem is planned once, at per-layer ``nothing_saveable``'s largest batch
   (does it fit there too?), instead of searched.
2. **MaxText presets at one budget** (models whose layers carry MaxText's names): each
   preset as MaxText applies it (``nn.remat(policy=preset)`` per layer), its peak, its FLOPs
   (jaxmem's count: loop bodies times their trip count, recompute included; XLA's
   ``cost_analysis`` counts a scan body once) and whether it fits; the budget lies between
   the median preset peak and the next larger one, so about half fit. Then
   ``jaxmem.optimize(step, budget=<that>)``: its peak, FLOPs and chosen body policy.
3. With ``--loss`` (``--no-maxbatch --no-presets --loss`` for it alone): the Llama step with
   the logits' cross-entropy and with ``chunk_loss=8`` (``chunked_cross_entropy``): plain
   jit's peak, and whether jaxmem's plan notes the logits as the largest buffer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

import jaxmem
from benchmarks import zoo
from benchmarks.maxbatch import DONATE, Search, plan_under, search
from benchmarks.zoo.maxtext_presets import PRESETS
from jaxmem import measure
from jaxmem.analyzing.losses import logits_notes

DEFAULT_OUT = Path("results/scan_plans")


def _args(name: str, size: str, batch: int, policy: Any, target: str) -> tuple[Any, Any]:
    w = zoo._make(name, size, batch, policy, 0, abstract=True)  # noqa: SLF001
    args = w.args if target == "cpu" else jaxmem.targets.place(w.args, target)
    return w, args


def plain(name: str, size: str, batch: int, policy: Any = None, target: str = "cpu"
          ) -> tuple[int, float]:
    """Compiled peak and jaxmem's FLOP count of ``jax.jit(step)`` (per-layer ``policy``)."""
    w, args = _args(name, size, batch, policy, target)
    jitted = jax.jit(w.step, donate_argnums=DONATE)
    return (measure.figures(measure.compile(jitted.lower(*args))).peak,
            measure.count_flops(w.step, *args))


def with_jaxmem(name: str, size: str, batch: int, budget: int, target: str = "cpu"
                ) -> tuple[int, float, str]:
    """Peak, FLOPs and scan-body notes of ``jaxmem.optimize(step, budget=budget)``; the
    lowest peak found (above the budget) when planning raises BudgetError."""
    w, args = _args(name, size, batch, None, target)
    step, plan, error = plan_under(w.step, args, budget)
    if error is not None:
        return max(error.minimum_bytes, budget + 1), float("nan"), "BudgetError"
    entry = step._prepare(args, {})[0]  # noqa: SLF001
    flops = measure.count_flops(entry.jitted, *jax.tree_util.tree_leaves(args))
    notes = "; ".join(n for n in plan.notes if n.startswith("scan bodies"))
    return plan.compiled.peak, flops, notes


def run_maxbatch(name: str, size: str, tol: float, target: str, log: Any,
                 check: bool = False) -> dict:
    start = zoo.config(name, size)["batch"]
    budget, _ = plain(name, size, start, target=target)
    log(f"{name}: budget {measure.fmt_bytes(budget)} (plain jit at batch {start})")
    out: dict[str, Any] = {"model": name, "budget": budget, "start_batch": start}
    variants = {
        "plain": lambda b: plain(name, size, b, target=target)[0],
        "nothing_saveable": lambda b: plain(name, size, b, jax.checkpoint_policies
                                            .nothing_saveable, target=target)[0],
        "jaxmem": lambda b: with_jaxmem(name, size, b, budget, target)[0],
    }
    for variant, peak_of in variants.items():
        if variant == "jaxmem" and check:
            # Is jaxmem's batch at or above nothing_saveable's? One plan at that batch.
            b = out["nothing_saveable"]["batch"]
            t = time.perf_counter()
            peak = peak_of(b)
            fits = peak <= budget
            s = Search(variant, b if fits else 0, peak, None if fits else b, 1,
                       time.perf_counter() - t, trail=[(b, peak, fits)])
        else:
            s = search(peak_of, budget, start, tol=tol, variant=variant,
                       known={start: budget} if variant == "plain" else None)
        out[variant] = dataclasses.asdict(s)
        log(f"  {variant:<17} -> batch {s.batch} ({s.compiles} compiles, {s.seconds:.0f}s)")
    return out


def run_presets(name: str, size: str, target: str, log: Any, batch: int | None = None
                ) -> dict:
    batch = batch or zoo.config(name, size)["batch"]
    base_peak, base_flops = plain(name, size, batch, target=target)
    rows = []
    for pname, preset in PRESETS.items():
        if preset.offload and target == "cpu":
            continue  # XLA:CPU drops host placement: an offload preset is a save one there
        peak, flops = plain(name, size, batch, preset, target)
        rows.append({"preset": pname, "peak": peak, "flops": flops})
        log(f"  {pname:<34} peak {measure.fmt_bytes(peak):>11}  {flops / 1e9:8.3f} GFLOP")
    # Between the median preset peak and the next larger one: about half fit, and the budget
    # is not one preset's compiled peak to the byte.
    median = statistics.median(r["peak"] for r in rows)
    above = sorted(r["peak"] for r in rows if r["peak"] > median)
    budget = int((median + above[0]) / 2) if above else int(median)
    for r in rows:
        r["fits"] = r["peak"] <= budget
    peak, flops, notes = with_jaxmem(name, size, batch, budget, target)
    log(f"  jaxmem at {measure.fmt_bytes(budget)}: peak {measure.fmt_bytes(peak)}, "
        f"{flops / 1e9:.3f} GFLOP; {notes}")
    best = min((r for r in rows if r["fits"]), key=lambda r: r["flops"])
    return {"model": name, "batch": batch, "budget": budget, "plain_peak": base_peak,
            "plain_flops": base_flops, "presets": rows, "best_preset": best["preset"],
            "jaxmem": {"peak": peak, "flops": flops, "fits": peak <= budget, "notes": notes}}


def run_loss(name: str, size: str, target: str, log: Any, chunks: int = 8,
             batch: int | None = None, vocab: int | None = None) -> list[dict]:
    """Plain jit's peak with the logits' loss and with the chunked one, and whether jaxmem's
    plan notes the logits as the largest buffer (``vocab`` overrides the size's)."""
    rows = []
    for chunk in (0, chunks):
        over = {"chunk_loss": chunk, **({"vocab": vocab} if vocab else {})}
        w = zoo._make(name, size, batch, None, 0, abstract=True,  # noqa: SLF001
                      overrides=over)
        args = w.args if target == "cpu" else jaxmem.targets.place(w.args, target)
        jitted = jax.jit(w.step, donate_argnums=DONATE)
        peak = measure.figures(measure.compile(jitted.lower(*args))).peak
        notes = logits_notes(jaxmem.analyze(w.step, *args))
        v = vocab or zoo.config(name, size)["vocab"]
        rows.append({"model": name, "vocab": v, "chunk_loss": chunk,
                     "plain_peak": peak, "note": notes[0] if notes else ""})
        log(f"  vocab {v} chunk_loss={chunk}: plain {measure.fmt_bytes(peak)}"
            f"; note: {bool(notes)}")
    return rows


def markdown(maxb: Sequence[dict], presets: Sequence[dict],
             loss: Sequence[dict] = ()) -> str:
    lines = []
    if maxb:
        lines += ["| model | budget | plain | per-layer nothing_saveable | jaxmem |",
                  "|---|---|---|---|---|"]
        for r in maxb:
            lines.append(f"| {r['model']} | {measure.fmt_bytes(r['budget'])} | "
                         f"{r['plain']['batch']} | {r['nothing_saveable']['batch']} | "
                         f"{r['jaxmem']['batch']} |")
    for p in presets:
        lines += ["", f"{p['model']} at batch {p['batch']}, budget "
                  f"{measure.fmt_bytes(p['budget'])} (plain jit: "
                  f"{measure.fmt_bytes(p['plain_peak'])}, {p['plain_flops'] / 1e9:.3f} GFLOP)",
                  "", "| preset | peak | GFLOP | recompute GFLOP | fits |", "|---|---|---|---|---|"]
        rows = [*p["presets"], {"preset": "**jaxmem**", **p["jaxmem"]}]
        for r in rows:
            lines.append(f"| {r['preset']} | {measure.fmt_bytes(r['peak'])} | "
                         f"{r['flops'] / 1e9:.3f} | {(r['flops'] - p['plain_flops']) / 1e9:.3f}"
                         f" | {'yes' if r['fits'] else 'no'} |")
        lines.append(f"\njaxmem: {p['jaxmem']['notes']}")
    if loss:
        lines += ["", "| model | vocab | loss | plain jit peak | plan notes the logits |",
                  "|---|---|---|---|---|"]
        for r in loss:
            what = f"chunked ({r['chunk_loss']} token chunks)" if r["chunk_loss"] else "logits"
            lines.append(f"| {r['model']} | {r['vocab']} | {what} | "
                         f"{measure.fmt_bytes(r['plain_peak'])} | "
                         f"{'yes' if r['note'] else 'no'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scan_plans",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", default="transformer_scan,llama_scan")
    p.add_argument("--size", default="bench")
    p.add_argument("--target", default="cpu")
    p.add_argument("--tol", type=float, default=1 / 8)
    p.add_argument("--batch", type=int, help="batch of the preset table (default the size's)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-maxbatch", action="store_true")
    p.add_argument("--no-presets", action="store_true")
    p.add_argument("--loss", action="store_true", help="also the loss table: logits vs "
                   "chunk_loss=8, plain jit and jaxmem's default plan")
    p.add_argument("--vocab", type=int, help="vocabulary of the loss table (default the size's)")
    p.add_argument("--check", action="store_true", help="jaxmem only at nothing_saveable's "
                   "largest batch (one plan) instead of its own search")
    a = p.parse_args(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    models = [m.strip() for m in a.models.split(",")]
    maxb = [] if a.no_maxbatch else [run_maxbatch(m, a.size, a.tol, a.target, log, a.check)
                                     for m in models]
    presets = [] if a.no_presets else [run_presets(m, a.size, a.target, log, a.batch)
                                       for m in models if m.startswith("llama")]
    loss = [r for m in models if a.loss and m.startswith("llama")
            for r in run_loss(m, a.size, a.target, log, batch=a.batch, vocab=a.vocab)]
    table = markdown(maxb, presets, loss)
    print(table)
    from benchmarks.run import machine_info

    meta = machine_info()
    meta.update(command="python -m benchmarks.scan_plans " + " ".join(
        sys.argv[1:] if argv is None else argv), seconds=round(time.perf_counter() - t0, 1))
    stem = f"scan_plans_{a.target}" + ("_presets" if a.no_maxbatch else "") + (
        "_maxbatch" if a.no_presets else "") + ("_loss" if a.loss else "")
    (a.out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "maxbatch": maxb, "presets": presets, "loss": loss}, indent=2,
        default=str))
    (a.out / f"{stem}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
