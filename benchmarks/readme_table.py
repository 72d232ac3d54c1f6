"""Render a benchmark ``results.json`` as markdown, for the README or docs.

Numbers only ever come from the JSON file that :mod:`benchmarks.run` wrote; nothing is typed
by hand. Usage::

    python -m benchmarks table                      # results/bench/results.json -> stdout
    python -m benchmarks.readme_table PATH --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.run import CALLABLE_MARK, COLUMNS, DEFAULT_OUT, table_rows


def render(data: dict[str, Any]) -> str:
    """Markdown for a parsed ``results.json``: a header naming the setup, one table per model."""
    meta, results = data["meta"], data["results"]
    donate = tuple(meta.get("donate_argnums", ()))
    lines = [
        f"Measured with `{meta.get('command', 'python -m benchmarks')}` on {meta['date']}: "
        f"{meta['platform']} ({meta['processor']}, {meta['cpu_count']} CPUs), "
        f"jax {meta['jax']}, flax {meta['flax']}, optax {meta['optax']}, "
        f"jaxmem {meta['jaxmem']}.",
        "",
        "Peak = argument + output + temp − alias of XLA's `memory_analysis()` "
        "(`jaxmem.measure`), per device. "
        f"Every variant is `jit`ted with `donate_argnums={donate}` (the train state is donated) "
        f"and compiled with `{meta.get('compiler_options', {})}`. "
        f"Step time: median of {meta['runs']} run(s) after {meta['warmup']} warm-up. "
        "FLOPs: `cost_analysis()`, which counts a scan body once. "
        f"{CALLABLE_MARK}: timed through the variant's own callable (its `Compiled` does not "
        "take the step's pytrees), which runs the plan it compiled the same way.",
        "",
        "Variants: " + "; ".join(f"`{k}`: {v}" for k, v in meta.get("variants", {}).items()) + ".",
    ]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_model.setdefault(r["model"], []).append(r)
    for model, rs in by_model.items():
        desc = meta.get("models", {}).get(model, "")
        lines += [
            "",
            f"**{model}** ({rs[0]['size']}, batch {rs[0]['batch']}, "
            f"{rs[0]['n_blocks']} blocks){': ' + desc if desc else ''}",
            "",
            "| " + " | ".join(COLUMNS) + " |",
            "|" + "|".join("---" if c == "variant" else "---:" for c in COLUMNS) + "|",
        ]
        for row in table_rows(rs):
            lines.append("| " + " | ".join(row.get(c, "") for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def summary(data: dict[str, Any]) -> str:
    """One row per model: plain-jit peak, then each variant's peak and FLOPs change vs plain."""
    results = [r for r in data["results"] if not r.get("error")]
    variants = list(dict.fromkeys(r["variant"] for r in results if r["variant"] != "plain"))
    head = ["model", "plain peak"] + [f"{v}: peak / FLOPs" for v in variants]
    lines = [_caption(data), "", "| " + " | ".join(head) + " |",
             "|---|" + "---:|" * (len(head) - 1)]
    saved: dict[str, list[float]] = {v: [] for v in variants}
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_model.setdefault(r["model"], {})[r["variant"]] = r
    for model, rs in by_model.items():
        base = rs.get("plain")
        if base is None:
            continue
        cells = [f"{model} (batch {base['batch']})", f"{base['peak'] / 2**20:.1f} MiB"]
        for v in variants:
            r = rs.get(v)
            if r is None:
                cells.append("")
                continue
            saved[v].append(1 - r["peak"] / base["peak"])
            cells.append(f"{_signed(r['peak'], base['peak'])} / "
                         f"{_signed(r['flops'], base['flops'])}")
        lines.append("| " + " | ".join(cells) + " |")
    mean = ["**mean peak change**", ""] + [
        f"**{-100 * sum(x) / len(x):+.1f}%**" if x else "" for x in saved.values()]
    lines.append("| " + " | ".join(mean) + " |")
    return "\n".join(lines) + "\n"


def _caption(data: dict[str, Any]) -> str:
    """Which compiler the figures are from, and whose FLOP count."""
    meta = data["meta"]
    target = meta.get("target", "cpu")
    sources = {r.get("flops_source", "xla") for r in data["results"] if not r.get("error")}
    flops = ("jaxmem's count of the traced program (the target compiler reports none "
             "without the device)"
             if sources == {"jaxmem"} else "XLA's `cost_analysis()`")
    where = (f"compiled for {target} without the device (compile-only)"
             if not str(target).startswith("cpu") else
             f"compiled for this machine's CPU ({meta.get('processor', '')})")
    reruns = "".join(f"; rerun {r.get('date', '')[:10]}: `{r['command']}`, merged"
                     for r in meta.get("reruns", ()))
    return (f"Figures {where}; jax {meta.get('jax')}, {meta.get('date', '')[:10]}; "
            f"`{meta.get('command', 'python -m benchmarks')}`{reruns}. FLOPs: {flops}.")


def _signed(x: float, base: float) -> str:
    return f"{100 * (x / base - 1):+.1f}%" if base else "n/a"


def main(argv: Sequence[str] | None = None) -> int:
    """Print (or write with ``--out``) the markdown for a ``results.json``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks table", description=__doc__)
    p.add_argument("results", nargs="?", type=Path, default=DEFAULT_OUT / "results.json")
    p.add_argument("--out", type=Path, help="write the markdown here instead of stdout")
    p.add_argument("--summary", action="store_true",
                   help="one row per model (the README's table) instead of one table each")
    args = p.parse_args(argv)
    data = json.loads(args.results.read_text())
    text = summary(data) if args.summary else render(data)
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
