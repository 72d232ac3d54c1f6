"""``python -m jaxmem analyze STEP`` (command line, :mod:`jaxmem.cli`): print
:func:`jaxmem.analyze` of a train step (which forward values the backward keeps, by layer,
and the predicted peak).
"""

from __future__ import annotations

import argparse

from jaxmem.cli.common import Subparsers, _add_target, _load


def _register_analyze(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="what a train step's backward pass keeps, by layer (jaxmem.analyze)",
        description="Trace TARGET and print jaxmem.analyze(step, *args): residuals by layer, "
        "what MEDL's rule could recompute, the predicted peak and bottleneck layers.",
        epilog="examples:\n  python -m jaxmem analyze zoo:resnet\n"
        "  python -m jaxmem analyze mypkg.train:make_step --residuals",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target(p)
    p.add_argument("--residuals", action="store_true",
                   help="also list every residual (name, shape, kind, layer)")
    p.set_defaults(func=_cmd_analyze)


def _cmd_analyze(args: argparse.Namespace) -> int:
    import jaxmem

    loaded = _load(args, "analyze")
    if loaded is None:
        return 2
    step, step_args, label = loaded
    analysis = jaxmem.analyze(step, *step_args)
    print(f"# {label}")
    print(analysis)
    if args.residuals:
        print()
        for r in analysis.residuals:
            print(f"  {jaxmem.measure.fmt_bytes(r.nbytes):>11}  {r.kind:<9} "
                  f"{str(r.dtype):<8} {str(tuple(r.shape)):<22} {r.layer or '<top>'}  {r.name}")
    return 0
