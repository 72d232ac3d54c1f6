"""What ``analyze``, ``plan`` and ``bench`` share (command line, :mod:`jaxmem.cli`).

The STEP, ``--batch`` and ``--target`` options and the ``--budget``/``--offload`` ones; a
STEP loaded (and placed on its ``--target``) or its error printed; the step under
``jaxmem.optimize`` and its plan, or the :class:`jaxmem.BudgetError` printed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from jaxmem.cli.loading import TARGET_HELP, TargetError, load_target

Subparsers = Any  # argparse._SubParsersAction (private type)


def _add_target(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("step", metavar="STEP", help=TARGET_HELP)
    p.add_argument("--batch", type=int, help="batch size (zoo models; passed as batch= to "
                   "make_step otherwise)")
    if device:
        p.add_argument("--target", metavar="DEVICE",
                       help="compile for this device instead of where the arrays live: h100, "
                       "h200, a100, v5e, v5p, v4, v6e or a GpuTargetConfig .pbtxt "
                       "(jaxmem.targets; compile only, nothing runs)")


def _add_budget(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", help="memory budget: bytes, 6GiB / 500MB, or a fraction in "
                   "(0, 1] of the plain-jit peak (default: none, jaxmem's default plan)")
    p.add_argument("--offload", action="store_true", help="allow offloading residuals to host "
                   "memory (optimize(offload=True))")


def _budget_value(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text  # "6GiB", "500MB": parsed by jaxmem


def _load(args: argparse.Namespace, command: str) -> tuple[Callable[..., Any], tuple, str] | None:
    device = getattr(args, "target", None)
    try:
        step, step_args, label = load_target(args.step, args.batch, abstract=bool(device))
        if device:
            import jaxmem

            target = jaxmem.targets.require(device)
            step_args = jaxmem.targets.place(step_args, target)
            label += f", compiled for {target}"
        return step, step_args, label
    except TargetError as e:
        print(f"jaxmem {command}: {e}", file=sys.stderr)
        return None
    except RuntimeError as e:  # jaxmem.targets.TargetError: unknown device, no plugin
        print(f"jaxmem {command}: {e}", file=sys.stderr)
        return None


def _optimized(step: Callable[..., Any], args: argparse.Namespace) -> Any:
    import jaxmem

    return jaxmem.optimize(step, budget=_budget_value(args.budget), offload=args.offload)


def _plan_or_error(opt: Any, step_args: tuple, command: str) -> Any:
    import jaxmem

    try:
        return opt.plan(*step_args)
    except jaxmem.BudgetError as e:
        print(f"jaxmem {command}: {e}", file=sys.stderr)
        return None
