"""Render a benchmark JSON file as markdown, for the README or docs, and keep their tables current.

Numbers only ever come from the JSON file a benchmark wrote; nothing is typed by hand. Three
kinds of file are read, told apart by their shape:

- ``results.json`` of :mod:`benchmarks.run` (the zoo): one table per model, or ``--summary``
  (one row per model: each variant's peak and FLOPs change against plain ``jax.jit``);
- ``maxbatch.json`` of :mod:`benchmarks.maxbatch`: the largest batch per variant;
- ``<target>-<size>.json`` of :mod:`benchmarks.external` (other people's models): its table,
  or ``--summary`` (the README's: the built-in policies beside jaxmem, FLOPs beside each peak).

``--provenance`` renders what the file's ``meta`` records about how it was measured (every
command, rerun and date), for a docs page's provenance note.

A table in a markdown file is kept current by fencing it with the command that renders it::

    <!-- generated: python -m benchmarks table benchmarks/results/bench/results.json --summary -->
    ...the command's output...
    <!-- end generated -->

``--docs`` rewrites every such block of README.md and docs/*.md from its JSON; ``--docs
--check`` names the stale ones and exits 1 (tests/test_docs.py runs the check). Usage::

    python -m benchmarks table                      # results/bench/results.json -> stdout
    python -m benchmarks table benchmarks/results/external/h100-bench.json --summary
    python -m benchmarks table --docs               # refresh README.md and docs/*.md
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.run import CALLABLE_MARK, COLUMNS, DEFAULT_OUT, table_rows

#: The repository root: commands in generated blocks name JSON files relative to it.
ROOT = Path(__file__).resolve().parents[1]
#: The command prefix a generated block must start with.
PROG = "python -m benchmarks table"
#: A generated block: the command in an HTML comment, its output, the end comment.
BLOCK = re.compile(r"(<!-- generated: (?P<cmd>.+?) -->\n)(?P<body>.*?)(<!-- end generated -->)",
                   re.S)
#: External variants in the order of the summary's columns, with their column names.
EXTERNAL_COLUMNS = {"plain": "plain", "dots": "dots_saveable", "nothing": "nothing_saveable",
                    "auto": "jaxmem"}


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


def summary(data: dict[str, Any], source: str | None = None) -> str:
    """One row per model: plain-jit peak, then each variant's peak and FLOPs change vs plain.

    ``source`` (the JSON's path) is named in the caption when given."""
    results = [r for r in data["results"] if not r.get("error")]
    variants = list(dict.fromkeys(r["variant"] for r in results if r["variant"] != "plain"))
    head = ["model", "plain peak"] + [f"{v}: peak / FLOPs" for v in variants]
    lines = [_caption(data, source), "", "| " + " | ".join(head) + " |",
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
    lines.append(_mean_row(saved.values(), blanks=1))
    return "\n".join(lines) + "\n"


def _caption(data: dict[str, Any], source: str | None = None) -> str:
    """Which compiler the figures are from, and whose FLOP count (the history is in ``meta``:
    ``--provenance``)."""
    meta = data["meta"]
    target = meta.get("target", "cpu")
    sources = {r.get("flops_source", "xla") for r in data["results"] if not r.get("error")}
    flops = ("jaxmem's count of the traced program (the target compiler reports none "
             "without the device)"
             if sources == {"jaxmem"} else "XLA's `cost_analysis()`")
    where = (f"compiled for {target} without the device (compile-only)"
             if not str(target).startswith("cpu") else
             f"compiled for a {meta.get('cpu_count', '?')}-core {meta.get('processor', '')} "
             "CPU (XLA:CPU)")
    lead = f"From `{source}`: figures " if source else "Figures "
    return f"{lead}{where}; jax {meta.get('jax')}. FLOPs: {flops}."


def _signed(x: float, base: float) -> str:
    return f"{100 * (x / base - 1):+.1f}%" if base else "n/a"


def _mean_row(saved: Iterable[list[float]], blanks: int) -> str:
    """The bold last row: each column's mean peak change against plain."""
    cells = ["**mean peak change**"] + [""] * blanks + [
        f"**{-100 * sum(x) / len(x):+.1f}%**" if x else "" for x in saved]
    return "| " + " | ".join(cells) + " |"


def _with_switch(vs: dict[str, Any]) -> dict[str, Any]:
    """``vs`` with ``block``: the lower-peak of the package's per-block switches measured
    (``block_dots`` / ``block_nothing``), or ``{"skipped": ...}`` where it has none."""
    have = [vs[b] for b in ("block_dots", "block_nothing") if "peak" in vs.get(b, {})]
    return dict(vs, block=min(have, key=lambda r: r["peak"]) if have else {"skipped": "n/a"})


def external_summary(records: list[dict[str, Any]], source: str | None = None) -> str:
    """One row per external model: plain jit's peak and FLOPs, then the whole-loss built-in
    policies, the package's own per-block switch where the records have one (corpus), and
    ``jaxmem.optimize``, each as its peak and FLOPs change against plain."""
    if not records:
        return "(no results)\n"
    target, size = records[0]["target"], records[0]["size"]
    switch = any(b in rec["variants"] for rec in records for b in ("block_dots",
                                                                  "block_nothing"))
    columns = dict(EXTERNAL_COLUMNS)
    if switch:
        columns = {"plain": "plain", "dots": "dots_saveable", "nothing": "nothing_saveable",
                   "block": "package's per-block switch", "auto": "jaxmem"}
    flops = ("XLA's `cost_analysis()`" if target == "cpu" else
             "jaxmem's count of each variant's traced program (XLA reports none without "
             "the device)")
    where = ("XLA:CPU" if target == "cpu"
             else f"compiled for `{target}` without the device (compile-only)")
    lines = [
        (f"From `{source}`: " if source else "") + f"{where}, size `{size}`. Peak: "
        "argument + output + temp − alias of XLA's `memory_analysis()`, train state donated; "
        f"FLOPs: {flops}. `dots_saveable` / `nothing_saveable`: the model's whole loss under "
        "`jax.checkpoint(policy=...)`; "
        + ("package's per-block switch: the lower of its remat switch per block with each "
           "policy (an edit of the model's config; n/a: the package has none); "
           if switch else "") + "`jaxmem`: `jaxmem.optimize(step)`, model unedited.",
        "",
        "| model | library | plain: peak / FLOPs | " + " | ".join(
            f"{c}: peak / FLOPs" for v, c in columns.items() if v != "plain") + " |",
        "|---|---|" + "---:|" * len(columns),
    ]
    saved: dict[str, list[float]] = {v: [] for v in columns if v != "plain"}
    for rec in records:
        vs = _with_switch(rec["variants"]) if switch else rec["variants"]
        base = vs.get("plain", {})
        if "peak" not in base:
            continue
        cells = [rec["model"], rec["library"],
                 f"{base['peak'] / 2**20:.1f} MiB / {base['flops'] / 1e9:.2f} GFLOP"]
        for v in saved:
            r = vs.get(v, {})
            if "peak" not in r:
                cells.append("not run" if v not in vs else "n/a" if "skipped" in r else
                             r.get("error", "").split(":")[0])
                continue
            if v != "block":  # the switch's mean would be over some rows only
                saved[v].append(1 - r["peak"] / base["peak"])
            cells.append(f"{_signed(r['peak'], base['peak'])} / "
                         f"{_signed(r['flops'], base['flops'])}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(_mean_row(saved.values(), blanks=2))
    return "\n".join(lines) + "\n"


def maxbatch_table(data: dict[str, Any], source: str | None = None) -> str:
    """:func:`benchmarks.maxbatch.markdown` of a ``maxbatch.json``, under a caption."""
    from benchmarks import maxbatch

    meta = data["meta"]
    target = meta.get("target", "cpu")
    where = ("XLA:CPU" if str(target).startswith("cpu")
             else f"compiled for {target} without the device (compile-only)")
    caption = ((f"From `{source}`: " if source else "") + f"{where}; jax {meta.get('jax')}. "
               f"Budget: plain `jax.jit`'s compiled peak at the zoo's `{meta.get('size')}` "
               "batch; each variant's largest batch within it, state donated.")
    return caption + "\n\n" + maxbatch.markdown(data["results"]) + "\n"


def provenance(data: Any, source: str | None = None) -> str:
    """What a JSON file records about how it was measured: commands, reruns, dates, commits."""
    head = f"`{source}`" if source else "This file"
    if isinstance(data, list):  # benchmarks.external: each variant names its commit
        commits: dict[str, set[str]] = {}
        for rec in data:
            for v, r in rec["variants"].items():
                commits.setdefault(v, set()).add(r.get("git") or "not recorded")
        return (f"{head}: the commit of each variant's records: " + "; ".join(
            f"`{v}` {', '.join(sorted(c))}" for v, c in commits.items()) + ".\n")
    meta = data["meta"]
    commands = meta.get("commands") or [meta.get("command", "?")]
    # maxbatch's --update keeps every command but only the last one's date
    dates = meta.get("dates") or [""] * (len(commands) - 1) + [meta.get("date", "")]
    lines = [f"{head} (jax {meta.get('jax')}, flax {meta.get('flax')}, "
             f"{meta.get('cpu_count', '?')}-core {meta.get('processor', '')} machine):", ""]
    for i, (cmd, date) in enumerate(zip(commands, dates, strict=False)):
        when = f"{date[:10]}: " if date else ""
        git = f" (git {meta['git']})" if meta.get("git") and len(commands) == 1 else ""
        merged = ", merged" if i and "merged" not in cmd else ""
        lines.append(f"- {when}`{cmd}`{git}{merged}")
    if meta.get("updated"):
        lines.append(f"- {meta['updated']}")
    for r in meta.get("reruns", ()):
        git = f" (git {r['git']})" if r.get("git") else ""
        lines.append(f"- rerun {r.get('date', '')[:10]}{git}: `{r['command']}`, merged")
    return "\n".join(lines) + "\n"


def table(path: Path, *, summary_only: bool = False, meta_only: bool = False,
          source: str | None = None) -> str:
    """The markdown for the JSON file at ``path``, by its kind (see the module docstring)."""
    data = json.loads(Path(path).read_text())
    if meta_only:
        return provenance(data, source)
    if isinstance(data, list):
        if summary_only:
            return external_summary(data, source)
        from benchmarks.external.__main__ import render as external_render

        return external_render(data)
    if data["results"] and "builtin" in data["results"][0]:
        return maxbatch_table(data, source)
    return summary(data, source) if summary_only else render(data)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", type=Path, default=DEFAULT_OUT / "results.json")
    p.add_argument("--out", type=Path, help="write the markdown here instead of stdout")
    p.add_argument("--summary", action="store_true",
                   help="one row per model (the README's kind of table) instead of one each")
    p.add_argument("--provenance", action="store_true",
                   help="the commands, reruns and dates the file's meta records")
    p.add_argument("--docs", action="store_true",
                   help="rewrite every generated table of README.md and docs/*.md")
    p.add_argument("--check", action="store_true",
                   help="with --docs: change nothing, name the stale tables, exit 1 if any")
    return p


def _text(args: argparse.Namespace) -> str:
    return table(args.results, summary_only=args.summary, meta_only=args.provenance,
                 source=str(args.results))


def generate(command: str) -> str:
    """The output of a generated block's ``command`` (``python -m benchmarks table ...``,
    JSON paths relative to the repository root)."""
    if not command.startswith(PROG + " "):
        raise ValueError(f"a generated block's command must start with {PROG!r}: {command!r}")
    args = _parser().parse_args(shlex.split(command[len(PROG):]))
    if args.docs or args.out:
        raise ValueError(f"--docs and --out have no place in a generated block: {command!r}")
    source = str(args.results)
    return table(ROOT / args.results, summary_only=args.summary, meta_only=args.provenance,
                 source=source)


def blocks(text: str) -> list[tuple[str, str]]:
    """Every generated block of a markdown text: ``(command, body)``."""
    return [(m["cmd"], m["body"]) for m in BLOCK.finditer(text)]


def refresh(text: str) -> str:
    """``text`` with every generated block's body rendered again from its JSON."""
    return BLOCK.sub(lambda m: m[1] + generate(m["cmd"]) + m[4], text)


def doc_files(root: Path = ROOT) -> list[Path]:
    """The markdown files whose generated blocks ``--docs`` keeps current."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def stale(files: Sequence[Path]) -> list[str]:
    """``file: command`` of every generated block whose body is not its command's output."""
    out = []
    for f in files:
        for cmd, body in blocks(f.read_text()):
            if body != generate(cmd):
                out.append(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}: {cmd}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print (or write with ``--out``) the markdown for a JSON file; or refresh the docs."""
    args = _parser().parse_args(argv)
    if args.docs:
        files = doc_files()
        if args.check:
            bad = stale(files)
            print("\n".join(f"stale: {b}" for b in bad) or "every generated table is current")
            return 1 if bad else 0
        for f in files:
            text = f.read_text()
            new = refresh(text)
            if new != text:
                f.write_text(new)
                print(f"rewrote {f.relative_to(ROOT)}")
        return 0
    text = _text(args)
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
