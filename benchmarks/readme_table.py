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


def main(argv: Sequence[str] | None = None) -> int:
    """Print (or write with ``--out``) the markdown for a ``results.json``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks table", description=__doc__)
    p.add_argument("results", nargs="?", type=Path, default=DEFAULT_OUT / "results.json")
    p.add_argument("--out", type=Path, help="write the markdown here instead of stdout")
    args = p.parse_args(argv)
    text = render(json.loads(args.results.read_text()))
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
