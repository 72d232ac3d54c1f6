"""Benchmark: chunked bottleneck layers (``jaxmem.chunked``, ``jaxmem.chunked_cross_entropy``).

Two bottleneck layers, each as forward + backward (``jax.grad`` under ``jit``):

- ``lm_head_ce``: LM head + softmax cross-entropy, x[4, 512, 256] @ W[256, 16384]: the logits
  are 2048 x 16384 float32 = 128 MiB. Baseline: ``optax.softmax_cross_entropy_with_integer_labels``
  on full logits. Chunked: ``chunked_cross_entropy(token_chunks=c)``.
- ``wide_mlp``: gelu(x @ W1) @ W2 with x[2048, 256], W1[256, 8192]: the hidden activation is
  2048 x 8192 float32 = 64 MiB. Baseline: plain JAX. Chunked: ``chunked(mlp, chunks=c,
  in_axes=(0, None, None))`` (rows).

For each chunk count in 1, 2, 4, 8, 16, 32 it reports the compiled peak
(argument + output + temp - alias, via ``jaxmem.measure``, every variant compiled the same
way), the FLOPs and the step time (median of several runs after one warm-up; variants are
timed round-robin so that background load hits them alike).

FLOPs: XLA's ``cost_analysis()`` counts a loop body once, whatever the trip count. The FLOP
column is therefore read from a second compile of the same variant with its scans fully
unrolled (``unroll=True``), i.e. trip-count corrected; the memory and time columns come from
the normal (rolled) compile.

Usage::

    python benchmarks/chunked.py [--quick] [--out DIR] [--repeats N]

Writes ``chunked.json``, ``chunked.csv`` and ``chunked.png`` into ``--out`` (default
``results/chunked/``). Runs unchanged on GPU (the time column is then GPU step time).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jaxmem import measure  # noqa: E402
from jaxmem.memory.chunked import chunked, chunked_cross_entropy  # noqa: E402

CHUNKS = (1, 2, 4, 8, 16, 32)
MiB = 1 << 20


def _lm_head_ce(quick: bool) -> dict[str, Any]:
    b, t, d, v = (2, 256, 256, 16384) if quick else (4, 512, 256, 16384)
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (b, t, d))
    w = jax.random.normal(k[1], (d, v)) * 0.05
    y = jax.random.randint(k[2], (b, t), 0, v)

    def base(x, w):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()

    def variant(c: int, unroll: bool) -> Callable[..., Any]:
        return lambda x, w: chunked_cross_entropy(x, w, y, token_chunks=c, unroll=unroll)

    return {
        "name": "lm_head_ce",
        "what": f"x[{b},{t},{d}] @ W[{d},{v}] + softmax CE; logits {b * t * v * 4 / MiB:.0f} MiB",
        "args": (x, w),
        "base": base,
        "variant": variant,
    }


def _wide_mlp(quick: bool) -> dict[str, Any]:
    n, d, f = (1024, 256, 8192) if quick else (2048, 256, 8192)
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (n, d))
    w1 = jax.random.normal(k[1], (d, f)) / d**0.5
    w2 = jax.random.normal(k[2], (f, d)) / f**0.5

    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1) @ w2

    def base(x, w1, w2):
        return jnp.mean(mlp(x, w1, w2) ** 2)

    def variant(c: int, unroll: bool) -> Callable[..., Any]:
        f = chunked(mlp, chunks=c, in_axes=(0, None, None), unroll=unroll)
        return lambda x, w1, w2: jnp.mean(f(x, w1, w2) ** 2)

    return {
        "name": "wide_mlp",
        "what": f"gelu(x[{n},{d}] @ W1[{d},{f}]) @ W2; hidden {n * f * 4 / MiB:.0f} MiB",
        "args": (x, w1, w2),
        "base": base,
        "variant": variant,
    }


def _grad(loss: Callable[..., Any], nargs: int) -> Any:
    return jax.jit(jax.grad(loss, argnums=tuple(range(nargs))))


def _run_case(case: dict[str, Any], repeats: int) -> list[dict[str, Any]]:
    args = case["args"]
    rows: list[tuple[str, int | None, Callable[..., Any], Callable[..., Any] | None]] = [
        ("unchunked", None, case["base"], None)
    ]
    rows += [(f"chunks={c}", c, case["variant"](c, False), case["variant"](c, True))
             for c in CHUNKS]
    compiled, out = [], []
    for label, c, fn, unrolled in rows:
        g = _grad(fn, len(args))
        exe = measure.compile(g.lower(*args))
        fig = measure.figures(exe)
        flops = fig.flops if unrolled is None else measure.measure(_grad(unrolled, len(args)),
                                                                   *args).flops
        jax.block_until_ready(exe(*args))  # warm-up
        compiled.append(exe)
        out.append({"case": case["name"], "variant": label, "chunks": c, "peak": fig.peak,
                    "temp": fig.temp, "flops": flops, "flops_rolled": fig.flops, "times": []})
    for _ in range(repeats):  # round-robin, so that background load is shared
        for exe, row in zip(compiled, out, strict=True):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*args))
            row["times"].append(time.perf_counter() - t0)
    base = out[0]
    base_t = statistics.median(base["times"])
    for row in out:
        row["time_s"] = statistics.median(row["times"])
        row["peak_vs_base"] = row["peak"] / base["peak"]
        row["flops_vs_base"] = row["flops"] / base["flops"]
        row["time_vs_base"] = row["time_s"] / base_t
    return out


def _table(case: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{case['name']}: {case['what']}  [{jax.default_backend()}]",
        f"{'variant':>11} | {'peak MiB':>9} | {'vs base':>7} | {'GFLOP':>7} | {'vs base':>7} | "
        f"{'step ms':>8} | {'vs base':>7}",
        "-" * 78,
    ]
    for r in rows:
        lines.append(
            f"{r['variant']:>11} | {r['peak'] / MiB:9.2f} | {r['peak_vs_base']:7.2f} | "
            f"{r['flops'] / 1e9:7.2f} | {r['flops_vs_base']:7.2f} | {r['time_s'] * 1e3:8.1f} | "
            f"{r['time_vs_base']:7.2f}"
        )
    return "\n".join(lines)


def _plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        base, chunk_rows = rows[0], rows[1:]
        cs = [r["chunks"] for r in chunk_rows]
        (line,) = axes[0].plot(cs, [r["peak"] / MiB for r in chunk_rows], "o-", label=name)
        axes[0].axhline(base["peak"] / MiB, ls="--", color=line.get_color(), lw=1)
        axes[1].plot(cs, [r["time_vs_base"] for r in chunk_rows], "o-", label=name,
                     color=line.get_color())
    axes[0].set(xscale="log", xlabel="chunks", ylabel="compiled peak, fwd+bwd (MiB)",
                title="peak (dashed: unchunked)")
    axes[1].axhline(1.0, ls="--", color="grey", lw=1)
    axes[1].axhline(1.15, ls=":", color="red", lw=1)
    axes[1].set(xscale="log", xlabel="chunks", ylabel="step time / unchunked",
                title=f"step time ({jax.default_backend()})")
    for ax in axes:
        ax.set_xticks(CHUNKS, [str(c) for c in CHUNKS])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    p.add_argument("--out", default="results/chunked", help="output folder")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    a = p.parse_args(argv)
    repeats = a.repeats or (3 if a.quick else 5)
    out = Path(a.out)
    os.makedirs(out, exist_ok=True)
    results, tables = {}, []
    for make in (_lm_head_ce, _wide_mlp):
        case = make(a.quick)
        rows = _run_case(case, repeats)
        results[case["name"]] = rows
        tables.append(_table(case, rows))
        print(tables[-1], flush=True)
        print(flush=True)
    meta = {"backend": jax.default_backend(), "device": str(jax.devices()[0]),
            "jax": jax.__version__, "quick": a.quick, "repeats": repeats,
            "command": "python benchmarks/chunked.py" + (" --quick" if a.quick else "")}
    (out / "chunked.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    with open(out / "chunked.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["case", "variant", "chunks", "peak_bytes", "peak_vs_base", "flops",
                    "flops_vs_base", "time_s", "time_vs_base"])
        for rows in results.values():
            for r in rows:
                w.writerow([r["case"], r["variant"], r["chunks"], r["peak"],
                            f"{r['peak_vs_base']:.4f}", f"{r['flops']:.6g}",
                            f"{r['flops_vs_base']:.4f}", f"{r['time_s']:.6f}",
                            f"{r['time_vs_base']:.4f}"])
    try:
        _plot(results, out / "chunked.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print(f"wrote {out}/chunked.json, chunked.csv, chunked.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
