"""FLOPs of equations no output depends on, in a corpus step, its package switch and a block plan.

jaxmem's FLOP count (:func:`jaxmem.xla.measure.count_flops`, the figure for a GPU target
compiled without the device) counts only what the outputs depend on, as XLA runs it. This
shows what counting every traced equation would add: for the plain step, the package's
per-block remat switch (``block_nothing``, where the package has one) and the block plan
the budget's fallback builds at ``--depth`` (light layers unjoined, first-replayed block
kept), each traced for ``--target`` with nothing compiled.

Run::

    python -m benchmarks.dead_flops --model tx_bert_ts --size bench --target h100 --depth 5
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import jax

import jaxmem
from jaxmem import _jax
from jaxmem.compiling import signature
from jaxmem.planning.block_plans import plan_blocks
from jaxmem.planning.budget.fallbacks import first_block_kept
from jaxmem.rewriting.rewrite import apply
from jaxmem.tracing.program import from_jaxpr


def counts(fn: Any, args: Any) -> tuple[float, float]:
    """FLOPs of ``fn(*args)`` over every traced equation, and over the live ones."""
    closed = jax.make_jaxpr(fn)(*args)
    return from_jaxpr(closed).flops, from_jaxpr(_jax.live_only(closed)).flops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tx_bert_ts", help="a corpus entry")
    ap.add_argument("--size", default="test", choices=["test", "bench"])
    ap.add_argument("--target", default="h100", help="cpu, or a jaxmem.targets name")
    ap.add_argument("--depth", type=int, default=None,
                    help="block depth of the plan (default: the shallowest)")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from benchmarks.external import corpus

    devices = None if a.target == "cpu" else jaxmem.targets.get(a.target).devices()
    e = corpus.make(a.model, a.size, devices)

    def place(args: Any) -> Any:
        return args if a.target == "cpu" else jaxmem.targets.place(args, a.target,
                                                                   sharding=e.sharding)

    args = place((e.state, e.batch))
    opt = jaxmem.optimize(e.make_step(), donate_argnums=(0,), verify=False)
    analysis = opt.analysis(*args)
    flat = signature.of(opt.fn, opt.static_argnums, opt.static_argnames, opt.offload_state,
                        args, {}).flat
    from jaxmem.planning.block_plans import block_depths

    depth = a.depth if a.depth is not None else block_depths(analysis.program)[0]
    plan = first_block_kept(analysis, plan_blocks(analysis, depth, join_light=False))
    accelerator = analysis.platform != "cpu"
    rows = [("plain step", counts(e.make_step(), args))]
    if "nothing" in e.blocks:
        state, step = e.blocks["nothing"]()
        rows.append(("package switch (block_nothing)", counts(step, place((state, e.batch)))))
    rows.append((plan.strategy, counts(apply(analysis.program, plan, settle_host=accelerator,
                                             fence_gradients=accelerator), flat)))
    print(f"{a.model}, {a.size}, target {a.target} ({analysis.platform}); GFLOP, jaxmem's count")
    print("| program | every equation | live equations | dead |")
    print("|---|---:|---:|---:|")
    for name, (raw, live) in rows:
        print(f"| {name} | {raw / 1e9:.3f} | {live / 1e9:.3f} | {(raw - live) / 1e6:.1f} M |")
    plain_live = rows[0][1][1]
    for name, (raw, live) in rows[1:]:
        print(f"{name}: recompute {(raw - rows[0][1][0]) / 1e6:.1f} MFLOP counting every "
              f"equation, {(live - plain_live) / 1e6:.1f} MFLOP counting live ones")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
