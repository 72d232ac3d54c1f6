"""Figures from a benchmark ``results.json``: memory vs FLOPs overhead, and memory timelines.

Usage::

    python -m benchmarks.plots [results.json] [--out DIR] [--timelines]

``pareto.png``: one panel per model, compiled peak (% of plain jit) against FLOPs overhead
(% of plain jit) for every variant; lower-left is better. ``--timelines`` adds
``timeline_<model>.png``: jaxmem's predicted memory over program order for the plain step
(``Analysis.plot``), at the size recorded in the results. Needs matplotlib
(``pip install 'jaxmem[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.run import DEFAULT_OUT

_MARKERS = {"plain": "s", "dots_saveable": "^", "nothing_saveable": "v", "jaxmem": "o"}


def pareto(data: dict[str, Any], path: Path) -> Path:
    """Write the per-model peak-vs-overhead scatter to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for r in data["results"]:
        if not r.get("error"):
            by_model.setdefault(r["model"], {})[r["variant"]] = r
    n = len(by_model)
    cols = min(4, n) or 1
    rows = math.ceil(n / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (model, rs) in zip(axes.flat, by_model.items(), strict=False):
        base = rs.get("plain")
        if base is None:
            continue
        for variant, r in rs.items():
            x = 100 * (r["flops"] / base["flops"] - 1) if base["flops"] else 0.0
            y = 100 * r["peak"] / base["peak"]
            ax.scatter([x], [y], marker=_MARKERS.get(variant, "x"), label=variant, s=40)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("FLOPs overhead (%)", fontsize=8)
        ax.set_ylabel("peak (% of plain)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"compiled peak vs FLOPs, {data['meta'].get('platform', '')}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timelines(data: dict[str, Any], out: Path) -> list[Path]:
    """One predicted-memory timeline per model (plain step), via ``jaxmem.analyze``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import jaxmem
    from benchmarks import zoo

    paths = []
    seen: dict[str, dict[str, Any]] = {}
    for r in data["results"]:
        seen.setdefault(r["model"], r)
    for model, r in seen.items():
        w = zoo.make(model, size=r["size"], batch=r["batch"])
        ax = jaxmem.analyze(w.step, *w.args).plot(title=f"{model}: predicted live memory")
        path = out / f"timeline_{model}.png"
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=110)
        plt.close(ax.figure)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__)
    p.add_argument("results", nargs="?", type=Path, default=DEFAULT_OUT / "results.json")
    p.add_argument("--out", type=Path, help="folder for the PNGs (default: beside the JSON)")
    p.add_argument("--timelines", action="store_true", help="also plot memory timelines")
    args = p.parse_args(argv)
    data = json.loads(args.results.read_text())
    out = args.out or args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    written = [pareto(data, out / "pareto.png")]
    if args.timelines:
        written += timelines(data, out)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
