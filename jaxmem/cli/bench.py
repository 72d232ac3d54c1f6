"""``python -m jaxmem bench STEP`` (command line, :mod:`jaxmem.cli`): plain ``jax.jit``
against ``jaxmem.optimize``: compiled peak, FLOPs and (with ``--runs``) the median step time
of each on this machine, after one warm-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxmem.cli.common import (
    Subparsers,
    _add_budget,
    _add_target,
    _load,
    _optimized,
    _plan_or_error,
)


def _register_bench(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="plain jax.jit against jaxmem.optimize: compiled peak, FLOPs, step time",
        description="Compile TARGET as plain jax.jit and as jaxmem.optimize (same donation, "
        "compiled the jaxmem way: the CPU barrier flag) and print both figures; with --runs, "
        "also time that many steps of each after one warm-up. For the whole zoo against "
        "JAX's checkpoint policies, see `python -m benchmarks`.",
        epilog="examples:\n  python -m jaxmem bench zoo:cnn_bn\n"
        "  python -m jaxmem bench zoo:mlp:bench --runs 3 --budget 0.5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target(p)
    _add_budget(p)
    p.add_argument("--runs", type=int, default=0,
                   help="timed steps per variant after one warm-up (default 0: no timing)")
    p.set_defaults(func=_cmd_bench)


def _time_steps(fn: Callable[..., Any], step_args: tuple, runs: int) -> float:
    """Median seconds of ``runs`` calls after one warm-up, on fresh copies of the arguments."""
    import statistics

    import jax
    import jax.numpy as jnp

    def fresh() -> tuple:
        return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array)
                            else x, step_args)

    times = []
    for i in range(runs + 1):
        call_args = fresh()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*call_args))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cmd_bench(args: argparse.Namespace) -> int:
    loaded = _load(args, "bench")
    if loaded is None:
        return 2
    step, step_args, label = loaded
    from jaxmem.xla.measure import fmt_bytes

    opt = _optimized(step, args)
    plan = _plan_or_error(opt, step_args, "bench")
    if plan is None:
        return 1
    base, mine = plan.baseline, plan.compiled
    rows = [("plain jit", base), ("jaxmem", mine)]
    ms: dict[str, str] = {}
    if args.runs > 0 and getattr(args, "target", None):
        print("jaxmem bench: --runs times steps on this machine; a --target is compile "
              "only (drop one of them)", file=sys.stderr)
        return 2
    if args.runs > 0:
        import jax

        plain = jax.jit(step, donate_argnums=plan.donated)
        ms = {"plain jit": f"{1e3 * _time_steps(plain, step_args, args.runs):.1f}",
              "jaxmem": f"{1e3 * _time_steps(opt, step_args, args.runs):.1f}"}
    print(f"# {label}" + (f", budget {args.budget}" if args.budget else ""))
    head = f"{'variant':<10} {'peak':>12} {'vs plain':>9} {'GFLOP':>10} {'vs plain':>9}"
    print(head + (f" {'step ms':>9}" if ms else ""))
    print("-" * (len(head) + (10 if ms else 0)))
    for name, fig in rows:
        dp = f"{100 * (fig.peak / base.peak - 1):+.1f}%" if base.peak else ""
        df = f"{100 * (fig.flops / base.flops - 1):+.1f}%" if base.flops else ""
        line = (f"{name:<10} {fmt_bytes(fig.peak):>12} {dp:>9} {fig.flops / 1e9:>10.4f} "
                f"{df:>9}")
        print(line + (f" {ms[name]:>9}" if ms else ""))
    print(f"\npeak = argument + output + temp - alias of XLA's memory_analysis(); donated "
          f"arguments: {plan.donated}; strategy {plan.strategy!r}.")
    for note in plan.notes:
        print(f"note: {note}")
    return 0
