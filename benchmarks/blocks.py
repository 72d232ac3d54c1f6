"""Block plans against per-block ``nothing_saveable``: ``python benchmarks/blocks.py``.

For each zoo model (bench size): the compiled peak and FLOPs of plain ``jax.jit``, of
``nothing_saveable`` around every block (``zoo.make(..., remat_policy=...)``, a model edit),
and of jaxmem's block plan at every block depth (``jaxmem.planning.plan.plan_blocks`` through the
joint rewrite, no model edit). Compiled figures only (``jaxmem.measure``: ``argument + output
+ temp - alias``, barrier flag on CPU), train state donated in every variant. This is the
check behind the "block plan vs nothing_saveable" figures in CHANGELOG.md and the closing
notes; ``--quick`` runs the test sizes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxmem.program import trace  # noqa: E402

from benchmarks import zoo  # noqa: E402
from jaxmem import measure  # noqa: E402
from jaxmem.analyzing.analysis import from_program  # noqa: E402
from jaxmem.planning.strategies import block_depths, plan_blocks  # noqa: E402
from jaxmem.rewriting.rewrite import rewrite  # noqa: E402

MiB = 2**20


def rows(name: str, size: str) -> list[dict[str, Any]]:
    """Plain, nothing_saveable per block and block plans at every depth, for one model."""
    w = zoo.make(name, size=size)
    flat = jax.tree.leaves(w.args)
    donate = tuple(range(len(jax.tree.leaves(w.state))))

    def compiled(fn: Any, args: Any, donate_argnums: Any) -> measure.Figures:
        return measure.figures(measure.compile(
            jax.jit(fn, donate_argnums=donate_argnums).lower(*args)))

    base = compiled(w.step, w.args, (0,))
    ns = zoo.make(name, size=size, remat_policy=jax.checkpoint_policies.nothing_saveable)
    out = [dict(model=name, variant="plain", fig=base),
           dict(model=name, variant="nothing_saveable/block", fig=compiled(ns.step, w.args, (0,)))]
    prog = trace(w.step, *w.args)
    a = from_program(prog)
    residuals = frozenset(r.value for r in a.residuals)
    for depth in block_depths(prog):
        p = plan_blocks(a, depth)
        fn = rewrite(prog, p.recompute, residuals=residuals | p.keep, region_depth=depth)
        out.append(dict(model=name, variant=f"blocks(depth={depth})",
                        fig=compiled(fn, flat, donate)))
    for r in out:
        r["peak_mib"] = round(r["fig"].peak / MiB, 2)
        r["flops"] = round(r["fig"].flops / base.flops - 1, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["cnn_bn", "densenet"],
                    help="zoo models (default: cnn_bn densenet)")
    ap.add_argument("--quick", action="store_true", help="test sizes")
    ns = ap.parse_args(argv)
    size = "test" if ns.quick else "bench"
    print("| model | variant | peak MiB | FLOPs vs plain |\n|---|---|---:|---:|")
    for m in ns.models:
        for r in rows(m, size):
            print(f"| {m} | {r['variant']} | {r['peak_mib']} | {100 * r['flops']:+.1f}% |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
