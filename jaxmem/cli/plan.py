"""``python -m jaxmem plan STEP`` (command line, :mod:`jaxmem.cli`): print the
:class:`jaxmem.Plan` of ``jaxmem.optimize(step)``, optionally under ``--budget``, with XLA's
compiled figures, plain jit against jaxmem.
"""

from __future__ import annotations

import argparse

from jaxmem.cli.common import (
    Subparsers,
    _add_budget,
    _add_target,
    _load,
    _optimized,
    _plan_or_error,
)


def _register_plan(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="the jaxmem.optimize plan of a train step, with XLA's compiled figures",
        description="Plan TARGET with jaxmem.optimize (optionally under --budget), compile "
        "the plain and the optimised step and print the Plan: what is recomputed or "
        "offloaded, by layer, and XLA's peak and FLOPs before and after.",
        epilog="examples:\n  python -m jaxmem plan zoo:mlp\n"
        "  python -m jaxmem plan zoo:transformer:bench --budget 0.6 --explain",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target(p)
    _add_budget(p)
    p.add_argument("--explain", action="store_true",
                   help="also print one line per residual: decision, size, reason")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    loaded = _load(args, "plan")
    if loaded is None:
        return 2
    step, step_args, label = loaded
    plan = _plan_or_error(_optimized(step, args), step_args, "plan")
    if plan is None:
        return 1
    print(f"# {label}")
    print(plan)
    if args.explain:
        print()
        print(plan.explain())
    return 0
