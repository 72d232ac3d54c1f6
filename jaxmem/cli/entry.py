"""The ``python -m jaxmem`` parser and entry point (command line, :mod:`jaxmem.cli`).

``SUBCOMMANDS`` lists one registration function per subcommand; :func:`build_parser` calls
each, and :func:`main` runs the handler the parsed arguments name. :mod:`jaxmem.__main__`
re-exports both.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from jaxmem.cli.analyze import _register_analyze
from jaxmem.cli.bench import _register_bench
from jaxmem.cli.common import Subparsers
from jaxmem.cli.managed_memory import _register_managed_memory
from jaxmem.cli.plan import _register_plan

#: One registration function per subcommand; add yours here.
SUBCOMMANDS: list[Callable[[Subparsers], None]] = [
    _register_managed_memory,
    _register_analyze,
    _register_plan,
    _register_bench,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m jaxmem`` argument parser, with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxmem",
        description="jaxmem: train bigger models in the same accelerator memory.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m jaxmem``; returns the exit code.

    >>> main(["managed-memory", "--oversubscription", "1.5", "--print-env"])  # doctest: +SKIP
    export TF_FORCE_UNIFIED_MEMORY=1
    export XLA_CLIENT_MEM_FRACTION=1.5
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args))
