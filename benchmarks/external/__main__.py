"""``python -m benchmarks.external``: the second benchmark table, on other people's models.

Each model of :mod:`benchmarks.external.models` is compiled under five variants, each in the
same subprocess per model (so that one crash or time-out costs one row, not the table):

- ``plain``: ``jax.jit(step, donate_argnums=(0,))``;
- ``dots``/``nothing``: the model's whole loss function under ``jax.checkpoint(policy=
  jax.checkpoint_policies.dots_saveable / nothing_saveable)``, then jitted the same way;
- ``auto``: ``jaxmem.optimize(step, donate_argnums=(0,))``;
- ``budget50``: ``jaxmem.optimize(step, budget=0.5, donate_argnums=(0,))`` (a
  ``BudgetError`` is recorded as such, with the smallest peak jaxmem found).

The figure is the compiled peak of :mod:`jaxmem.measure` (argument + output + temp - alias
of XLA's ``memory_analysis()``, per device; the CPU barrier flag for every variant alike).
``--target h100`` compiles for an H100 without the device (:mod:`jaxmem.targets`).

With ``--set corpus`` the rows are :mod:`benchmarks.external.corpus`: other people's train
steps in their own idioms (flax ``TrainState``, haiku ``transform_with_state``, a
``jax.shard_map`` step, ``eqx.nn.State``, Keras ``stateless_call``, penzai's trainer,
jraph), written to ``OUT/corpus-<target>-<size>.json``; two more variants there:

- ``block_dots``/``block_nothing``: the package's own per-block remat switch with that
  policy (transformers' ``enable_gradient_checkpointing``, which saves nothing per block;
  penzai's ``Checkpointed``); ``n/a`` where the package has none;
- ``budget_block`` (only when asked for): ``jaxmem.optimize(step, budget=<the lower
  block_* peak of the same record>)``: does a budget reach the package's switch, at what
  FLOPs (listed under the table).

On ``--target cpu`` the ``auto`` variant also runs both steps and compares
``jaxmem.optimize``'s outputs with ``jax.jit``'s (``matches_jit``, ``max_rel_diff``).

Usage::

    python -m benchmarks.external --target h100 --size bench --out benchmarks/results/external
    python -m benchmarks.external --set corpus --target h100 --size test
    python -m benchmarks.external table benchmarks/results/external/h100-bench.json

Per-model results land in ``OUT/<target>-<size>/<model>.json`` as they finish; the combined
``OUT/<target>-<size>.json`` and its markdown table are written at the end (and by
``table``). ``--variants auto`` reruns one variant: the model's record keeps the others,
and each variant names the commit it was measured at (``git``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "dots", "nothing", "auto", "budget50")
CORPUS_VARIANTS = ("plain", "dots", "nothing", "block_dots", "block_nothing", "auto",
                   "budget50")
DESCRIPTIONS = {
    "plain": "jax.jit(step), state donated",
    "dots": "jax.checkpoint(loss, policy=dots_saveable), whole loss",
    "nothing": "jax.checkpoint(loss, policy=nothing_saveable), whole loss",
    "auto": "jaxmem.optimize(step) (strategy auto)",
    "budget50": "jaxmem.optimize(step, budget=0.5)",
}
BLOCK_DESCRIPTIONS = {
    "block_dots": "the package's per-block remat switch, dots_saveable (penzai Checkpointed)",
    "block_nothing": "the package's per-block remat switch, nothing_saveable (transformers "
                     "enable_gradient_checkpointing, penzai Checkpointed)",
}


def _compare(a: Any, b: Any) -> tuple[bool, float]:
    """docs/testing.md's compiled check: per float leaf ``max|a-b| <= 2e-5 * max|b|``
    (leaves whose jit value is all zero: ``<= 1e-6``), other leaves identical."""
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if jax.tree.structure(a) != jax.tree.structure(b) or len(la) != len(lb):
        return False, float("inf")
    ok, worst = True, 0.0
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, float("inf")
        if not np.issubdtype(y.dtype, np.floating):
            ok &= bool(np.array_equal(x, y))
            continue
        d = float(np.max(np.abs(x.astype(np.float64) - y))) if y.size else 0.0
        scale = float(np.max(np.abs(y))) if y.size else 0.0
        rel = d / scale if scale else d
        worst = max(worst, rel)
        ok &= d <= (2e-5 * scale if scale else 1e-6)
    return ok, worst


def _commit() -> str | None:
    """The checkout's short commit, ``+`` if its code has uncommitted changes (results under
    benchmarks/results, which a run writes, and docs do not count); None outside git."""
    try:
        def git(*a: str) -> str:
            return subprocess.run(["git", *a], capture_output=True, text=True, check=True,
                                  cwd=Path(__file__).parent).stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ":/",
                    ":(exclude,top)benchmarks/results", ":(exclude,top)docs",
                    ":(exclude,top)*.md")
        return git("rev-parse", "--short", "HEAD") + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def _measure_one(model: str, size: str, target: str, variants: list[str],
                 path: Path, corpus: bool = False) -> dict[str, Any]:
    """Compile ``model`` under each variant; write the JSON record to ``path`` after each."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import jaxmem
    from benchmarks.external import models
    from jaxmem import measure

    t0 = time.perf_counter()
    if corpus:
        from benchmarks.external import corpus as corpus_mod

        devices = None if target == "cpu" else jaxmem.targets.get(target).devices()
        w = corpus_mod.make(model, size, devices)
    else:
        w = models.make(model, size)
    rec: dict[str, Any] = {"model": model, "library": w.library, "size": size,
                           "target": target, "description": w.description,
                           "build_s": round(time.perf_counter() - t0, 1), "variants": {}}
    if path.exists():  # a rerun of some variants keeps the others (each names its commit)
        old = json.loads(path.read_text())
        if (old.get("target"), old.get("size")) == (target, size):
            rec["variants"] = {k: v for k, v in old.get("variants", {}).items()
                               if k not in variants}
    commit = _commit()
    args = (w.state, w.batch)
    host_args = args
    if target != "cpu":
        args = jaxmem.targets.place(args, target, sharding=getattr(w, "sharding", None))
    platform = jaxmem.targets.platform_of(args) or "cpu"
    policies = {"dots": jax.checkpoint_policies.dots_saveable,
                "nothing": jax.checkpoint_policies.nothing_saveable}
    for v in variants:
        r: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            if v.startswith("block_") and v[6:] not in getattr(w, "blocks", {}):
                r["skipped"] = "no per-block remat switch with this policy in the package"
                rec["variants"][v] = r
                path.write_text(json.dumps(rec, indent=1))
                continue
            if v == "budget_block":
                peaks = [rec["variants"][b]["peak"] for b in ("block_dots", "block_nothing")
                         if "peak" in rec["variants"].get(b, {})]
                if not peaks:
                    r["skipped"] = "no block_dots / block_nothing peak in this record"
                    rec["variants"][v] = r
                    path.write_text(json.dumps(rec, indent=1))
                    continue
                r["budget"] = min(peaks)
            if v in ("auto", "budget50", "budget_block"):
                kw = ({"budget": 0.5} if v == "budget50" else
                      {"budget": r["budget"]} if v == "budget_block" else {})
                opt = jaxmem.optimize(w.make_step(), donate_argnums=(0,), **kw)
                plan = opt.plan(*args)
                f = plan.compiled
                r["strategy"] = str(getattr(plan, "strategy", ""))
                if target == "cpu" and v == "auto":  # outputs against jax.jit's
                    copy = lambda t: jax.tree.map(  # noqa: E731
                        lambda x: x.copy() if hasattr(x, "copy") else x, t)
                    ref = jax.jit(w.make_step(), donate_argnums=(0,))(copy(host_args[0]),
                                                                     host_args[1])
                    out = opt(copy(host_args[0]), host_args[1])
                    r["matches_jit"], r["max_rel_diff"] = _compare(out, ref)
            elif v.startswith("block_"):
                state, step = w.blocks[v[6:]]()
                bargs = (state, w.batch)
                if target != "cpu":
                    bargs = jaxmem.targets.place(bargs, target,
                                                 sharding=getattr(w, "sharding", None))
                jitted = jax.jit(step, donate_argnums=(0,))
                compiled = measure.compile(jitted.lower(*bargs))
                f = measure.compiled_figures(compiled, jitted, bargs, platform=platform)
            else:
                wrap = (lambda fn: fn) if v == "plain" else (
                    lambda fn, p=policies[v]: jax.checkpoint(fn, policy=p))
                jitted = jax.jit(w.make_step(wrap), donate_argnums=(0,))
                compiled = measure.compile(jitted.lower(*args))
                f = measure.compiled_figures(compiled, jitted, args, platform=platform)
            r.update(peak=f.peak, argument=f.argument, output=f.output, temp=f.temp,
                     alias=f.alias, flops=f.flops)
        except jaxmem.BudgetError as e:
            r.update(error="BudgetError", minimum=getattr(e, "minimum_bytes", None),
                     requested=getattr(e, "requested_bytes", None))
        except Exception as e:  # noqa: BLE001 - recorded; the table goes on
            r["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            r["traceback"] = traceback.format_exc()[-2000:]
        r["seconds"] = round(time.perf_counter() - t0, 1)
        if commit:
            r["git"] = commit
        rec["variants"][v] = r
        path.write_text(json.dumps(rec, indent=1))
        print(f"  {model} {v}: {r.get('peak', r.get('error'))} ({r['seconds']} s)",
              file=sys.stderr, flush=True)
    return rec


def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f}"


def render(records: list[dict[str, Any]]) -> str:
    """The markdown table of ``records``: peaks in MiB and savings against plain jit."""
    if not records:
        return "(no results)\n"
    target, size = records[0]["target"], records[0]["size"]
    blocks = any(v in rec["variants"] for rec in records for v in BLOCK_DESCRIPTIONS)
    checked = any("matches_jit" in rec["variants"].get("auto", {}) for rec in records)
    head = ("| model | library | plain MiB | dots_saveable | nothing_saveable | "
            + ("block dots | block nothing | " if blocks else "")
            + "jaxmem auto | jaxmem 50% budget | auto ≥ best policy |"
            + (" outputs = jit |" if checked else ""))
    lines = [f"Target `{target}`, size `{size}`. Compiled peak in MiB (change vs plain jit; "
             "negative = saved).", "",
             head, "|" + "---|" * (8 + 2 * blocks + checked)]
    savings = []
    for rec in records:
        vs = rec["variants"]
        plain = vs.get("plain", {}).get("peak")

        def cell(v: str, vs=vs, plain=plain) -> str:
            r = vs.get(v)
            if r is None:
                return "not run"
            if "skipped" in r:
                return "n/a"
            if r.get("error") == "BudgetError":
                return f"BudgetError (min {_mib(r.get('minimum'))})"
            if r.get("error", "").startswith("subprocess"):
                return "killed (" + r["error"].split(": ", 1)[-1] + ")"
            if "error" in r:
                return "error: " + r["error"].split(":")[0]
            if plain:
                s = 100 * (1 - r["peak"] / plain)
                return f"{_mib(r['peak'])} ({'-' if s >= 0 else '+'}{abs(s):.1f}%)"
            return _mib(r["peak"])

        best = [vs[v]["peak"] for v in ("dots", "nothing", "block_dots", "block_nothing")
                if "peak" in vs.get(v, {})]
        auto = vs.get("auto", {}).get("peak")
        ok = "–"
        if auto is not None and best and plain:
            ok = "yes" if auto <= min(best) * 1.005 else "no"
            savings.append(1 - auto / plain)
        mid = f"{cell('block_dots')} | {cell('block_nothing')} | " if blocks else ""
        same = ""
        if checked:
            a = vs.get("auto", {})
            same = (" – |" if "matches_jit" not in a else
                    f" {'yes' if a['matches_jit'] else 'NO'} ({a['max_rel_diff']:.1e}) |")
        lines.append(f"| {rec['model']} | {rec['library']} | {_mib(plain)} | {cell('dots')} "
                     f"| {cell('nothing')} | {mid}{cell('auto')} | {cell('budget50')} | {ok} |"
                     + same)
    lines += _budget_block_lines(records)
    if savings:
        lines += ["", f"Mean saving of jaxmem auto: {100 * sum(savings) / len(savings):.1f}% "
                  f"over {len(savings)} models."]
    desc = dict(DESCRIPTIONS, **(BLOCK_DESCRIPTIONS if blocks else {}))
    best_of = ("lowest of the built-in policies measured (whole loss, and per block where "
               "the package has a switch; n/a: it has none)" if blocks else
               "lower of the two whole-loss policies")
    lines += ["", "auto ≥ best policy: jaxmem auto's peak is below, or within 0.5% of, the "
              + best_of + ". killed (timeout): the model's subprocess ran past --timeout."
              + (" outputs = jit: jaxmem.optimize's outputs against jax.jit's on CPU "
                 "(docs/testing.md's compiled check; the largest relative difference)."
                 if checked else ""), "",
              "Variants: " + "; ".join(f"`{k}`: {v}" for k, v in desc.items()) + "."]
    return "\n".join(lines) + "\n"


def _budget_block_lines(records: list[dict[str, Any]]) -> list[str]:
    """Under the table: ``budget_block`` (a budget at the package switch's peak), per row
    that ran it: met or not, peak and FLOPs against the switch's."""
    out = []
    for rec in records:
        vs = rec["variants"]
        r = vs.get("budget_block")
        if not r or "skipped" in r:
            continue
        switch = min((vs[b] for b in ("block_dots", "block_nothing") if "peak" in vs.get(b, {})),
                     key=lambda x: x["peak"])
        plain = vs.get("plain", {}).get("flops")
        if "peak" in r:
            what = (f"met by `{r.get('strategy', '?')}`: {r['peak']:,} B against the "
                    f"switch's {switch['peak']:,} B, {r['flops']:.4g} FLOPs against "
                    f"{switch['flops']:.4g}")
            if plain:  # what each re-creates, over the plain step's count
                extra = r["flops"] - switch["flops"]
                what += (f" (recompute {r['flops'] - plain:.4g} against "
                         f"{switch['flops'] - plain:.4g}: "
                         + ("no more" if extra <= 0 else f"{extra:.3g} more") + ")")
        else:
            what = (f"{r.get('error', '?')}" + (f", lowest {r['minimum']:,} B against the "
                                                f"switch's {switch['peak']:,} B"
                                                if r.get("minimum") else ""))
        out.append(f"- `{rec['model']}`, `budget=` the package switch's peak: {what}")
    return ["", "Budget at the package's per-block switch (`budget_block`):", ""] + out \
        if out else []


def _write(out: Path, stem: str, records: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(records, indent=1))
    (out / f"{stem}.md").write_text(render(records))


def _collect(out: Path, stem: str, order: list[str]) -> list[dict[str, Any]]:
    d = out / stem
    recs = {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")} if d.exists() else {}
    return [recs[m] for m in order if m in recs] + [r for m, r in recs.items() if m not in order]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:
        for path in argv[1:]:
            recs = json.loads(Path(path).read_text())
            Path(path).with_suffix(".md").write_text(render(recs))
            print(render(recs))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.external", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cpu", help="cpu, or a jaxmem.targets name (h100)")
    p.add_argument("--size", default="bench", choices=("test", "bench"))
    p.add_argument("--set", default="models", choices=("models", "corpus"),
                   help="models: benchmarks.external.models (the README table); corpus: "
                        "benchmarks.external.corpus, users' own train steps")
    p.add_argument("--models", default=None, help="comma-separated names (default: all)")
    p.add_argument("--variants", default=None, help="comma-separated (default: all)")
    p.add_argument("--out", default="benchmarks/results/external", type=Path)
    p.add_argument("--timeout", default=3600, type=int, help="seconds per model")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one model in this process
    a = p.parse_args(argv)
    corpus = a.set == "corpus"
    if corpus:
        from benchmarks.external.corpus import CORPUS as MODELS
    else:
        from benchmarks.external.models import MODELS
    a.models = a.models or ",".join(MODELS)
    a.variants = a.variants or ",".join(CORPUS_VARIANTS if corpus else VARIANTS)
    stem = ("corpus-" if corpus else "") + f"{a.target}-{a.size}"
    variants = a.variants.split(",")
    if a.one:
        (a.out / stem).mkdir(parents=True, exist_ok=True)
        _measure_one(a.one, a.size, a.target, variants, a.out / stem / f"{a.one}.json",
                     corpus=corpus)
        return 0
    order = a.models.split(",")
    for m in order:
        print(f"{m} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "benchmarks.external", "--one", m, "--size", a.size,
               "--target", a.target, "--variants", a.variants, "--out", str(a.out),
               "--set", a.set]
        try:
            rc = subprocess.run(cmd, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:  # keep the variants it finished; mark the rest
            path = a.out / stem / f"{m}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            rec = json.loads(path.read_text()) if path.exists() else {
                "model": m, "library": "?", "size": a.size, "target": a.target, "variants": {}}
            for v in variants:
                rec["variants"].setdefault(v, {"error": f"subprocess: {rc}"})
            path.write_text(json.dumps(rec, indent=1))
        _write(a.out, stem, _collect(a.out, stem, list(MODELS)))
    print(render(_collect(a.out, stem, list(MODELS))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
