"""``python -m jaxmem managed-memory`` (command line, :mod:`jaxmem.cli`): run a command with
XLA's GPU client on CUDA managed memory, or print the environment that does it.

The environment comes from :mod:`jaxmem.memory.managed_memory`; settings already in the
environment that disagree are reported and nothing runs, unless ``--override``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from jaxmem.cli.common import Subparsers


def _register_managed_memory(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "managed-memory",
        help="run a command with XLA's GPU client on CUDA managed (unified) memory",
        description=(
            "Set TF_FORCE_UNIFIED_MEMORY=1, XLA_CLIENT_MEM_FRACTION=<oversubscription> and "
            "XLA_PYTHON_CLIENT_PREALLOCATE, then run COMMAND with that environment (or print "
            "it as export lines). Settings already in the environment that disagree are "
            "reported and nothing runs, unless --override. See docs/managed_memory.md."
        ),
        epilog=(
            "examples:\n"
            "  python -m jaxmem managed-memory --oversubscription 1.5 -- python train.py\n"
            '  eval "$(python -m jaxmem managed-memory --print-env)"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--oversubscription",
        type=float,
        default=1.5,
        metavar="RATIO",
        help="managed pool size as a multiple of device memory, >= 1 (default: 1.5)",
    )
    p.add_argument(
        "--preallocate",
        action="store_true",
        help="reserve the whole pool when the backend starts (default: grow on demand)",
    )
    p.add_argument(
        "--override",
        action="store_true",
        help="replace conflicting settings already in the environment (reported on stderr)",
    )
    p.add_argument(
        "--print-env",
        action="store_true",
        help="print `export`/`unset` lines for the shell instead of running a command",
    )
    p.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="the command to run (put it after --); without one, prints the environment",
    )
    p.set_defaults(func=_cmd_managed_memory)


def _cmd_managed_memory(args: argparse.Namespace) -> int:
    from jaxmem.memory import managed_memory as mm

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        wanted = mm.environment(args.oversubscription, args.preallocate)
    except (TypeError, ValueError) as e:
        print(f"jaxmem managed-memory: {e}", file=sys.stderr)
        return 2
    to_set, to_unset, problems = mm._merged_environment(wanted, os.environ, args.override)
    if problems and not args.override:
        print(
            "jaxmem managed-memory: the environment already has conflicting settings; nothing "
            "was run:\n  - " + "\n  - ".join(problems) + "\nFix them, or add --override.",
            file=sys.stderr,
        )
        return 2
    for p in problems:
        print(f"jaxmem managed-memory: --override replaces: {p}", file=sys.stderr)
    if args.print_env or not cmd:
        for k in to_unset:
            print(f"unset {k}")
        for k, v in to_set.items():
            print(f"export {k}={shlex.quote(v)}")
        return 0
    env = {k: v for k, v in os.environ.items() if k not in to_unset}
    env.update(to_set)
    ok, why = mm._gpu_possible()
    if not ok:
        print(f"jaxmem managed-memory: note: no effect on this machine ({why}).", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:  # not found, not executable
        print(f"jaxmem managed-memory: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - execvpe does not return
