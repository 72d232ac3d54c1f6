"""The largest batch of a scanned Llama decoder that fits a device: plain jit, a MaxText
preset, jaxmem.

``python -m benchmarks.llm_maxbatch [--size 1b] [--target h100] [--presets full,save_qkv_proj]
[--layers N] [--chunk-loss 8] [--max-batch 64] [--out results/llm_maxbatch]``

Compile-only (abstract arguments, ``jaxmem.targets``): the budget is the target's device
memory (``device_memory_size`` of its config: 79.1 GiB on the H100 target), the step is the zoo's
``llama_scan`` (sequence 4096 at ``1b``; adamw, state donated). For ``plain`` and each preset
(``nn.remat(policy=preset)`` around each scanned layer, as MaxText applies it) the peak is
compiled at batches 1 and 2; peaks are affine in the batch, so the largest batch that fits
is predicted from those two and then checked by compiling it and the next one. ``jaxmem`` is
``jaxmem.optimize(step, budget=<device memory>)`` searched upwards from the best preset's
batch (a batch fits when planning does not raise ``BudgetError``). Compiles at this size
take minutes on a small CPU: every compile is appended to ``<out>/points.jsonl`` as it
finishes, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax

import jaxmem
from benchmarks import zoo
from benchmarks.maxbatch import DONATE, plan_under
from benchmarks.zoo.maxtext_presets import PRESETS
from jaxmem import measure

CHUNK_LOSS = 0  # --chunk-loss: the zoo Llama's loss by jaxmem.chunked_cross_entropy


def _args(size: str, batch: int, policy: Any, target: str, layers: int | None) -> Any:
    over = {"layers": layers} if layers else {}
    if CHUNK_LOSS:
        over["chunk_loss"] = CHUNK_LOSS
    w = zoo._make("llama_scan", size, batch, policy, 0, abstract=True,  # noqa: SLF001
                  overrides=over)
    return w, jaxmem.targets.place(w.args, target)


def peak_of(variant: str, size: str, batch: int, target: str, budget: int,
            layers: int | None) -> tuple[int | None, str]:
    """Compiled peak (None: jaxmem raised BudgetError) and a note."""
    if variant == "jaxmem":
        w, args = _args(size, batch, None, target, layers)
        _, plan, error = plan_under(w.step, args, budget)
        if error is not None:
            return None, f"BudgetError (minimum {measure.fmt_bytes(error.minimum_bytes)})"
        return plan.compiled.peak, "; ".join(n for n in plan.notes if "scan bodies" in n)
    w, args = _args(size, batch, None if variant == "plain" else PRESETS[variant], target,
                    layers)
    jitted = jax.jit(w.step, donate_argnums=DONATE)
    return measure.figures(measure.compile(jitted.lower(*args))).peak, ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_maxbatch",
                                description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1b")
    p.add_argument("--target", default="h100")
    p.add_argument("--presets", default="full")
    p.add_argument("--layers", type=int, help="override the size's layer count")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--no-jaxmem", action="store_true")
    p.add_argument("--chunk-loss", type=int, default=0, help="token chunks of the loss "
                   "(jaxmem.chunked_cross_entropy in place of the logits' cross-entropy)")
    p.add_argument("--out", type=Path, default=Path("results/llm_maxbatch"))
    a = p.parse_args(argv)
    global CHUNK_LOSS
    CHUNK_LOSS = a.chunk_loss
    a.out.mkdir(parents=True, exist_ok=True)
    budget = int(jaxmem.targets.get(a.target).memory_bytes)
    points = a.out / "points.jsonl"
    best: dict[str, int] = {}

    def point(variant: str, batch: int) -> bool:
        t = time.perf_counter()
        peak, note = peak_of(variant, a.size, batch, a.target, budget, a.layers)
        fits = peak is not None and peak <= budget
        row = {"variant": variant, "size": a.size, "layers": a.layers, "target": a.target,
               "chunk_loss": a.chunk_loss,
               "batch": batch, "peak": peak, "budget": budget, "fits": fits, "note": note,
               "seconds": round(time.perf_counter() - t, 1)}
        with points.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), file=sys.stderr, flush=True)
        if fits:
            best[variant] = max(best.get(variant, 0), batch)
        return fits

    for variant in ["plain", *[s for s in a.presets.split(",") if s]]:
        p1, _ = peak_of(variant, a.size, 1, a.target, budget, a.layers)
        p2, _ = peak_of(variant, a.size, 2, a.target, budget, a.layers)
        for b, pk in ((1, p1), (2, p2)):
            with points.open("a") as f:
                f.write(json.dumps({"variant": variant, "chunk_loss": a.chunk_loss,
                                    "batch": b, "peak": pk,
                                    "budget": budget, "fits": pk <= budget}) + "\n")
            if pk <= budget:
                best[variant] = max(best.get(variant, 0), b)
        slope = max(p2 - p1, 1)
        guess = min(max(int((budget - p1) // slope) + 1, 0), a.max_batch)
        if guess > 2:
            if point(variant, guess) and guess < a.max_batch:
                point(variant, guess + 1)
            else:
                point(variant, guess - 1)
    if not a.no_jaxmem:
        start = max(best.values(), default=1)
        b = start
        while b <= a.max_batch and point("jaxmem", b):
            b += 1
    (a.out / "summary.json").write_text(json.dumps(
        {"size": a.size, "target": a.target, "budget": budget, "layers": a.layers,
         "chunk_loss": a.chunk_loss,
         "max_batch": best}, indent=2))
    print(json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
