"""The command line's commands: what ``python -m jaxmem`` and the ``jaxmem`` console script
run (top layer, beside :mod:`jaxmem.__main__`, the entry point that re-exports them).

One module per subcommand, and what they share:

- :mod:`~jaxmem.cli.entry` — :func:`~jaxmem.cli.entry.build_parser`,
  :func:`~jaxmem.cli.entry.main` and ``SUBCOMMANDS``, the registration functions;
- :mod:`~jaxmem.cli.managed_memory` — ``managed-memory``: run a command on CUDA managed
  memory, or print the environment that does it;
- :mod:`~jaxmem.cli.loading` — a STEP string resolved to ``(step, args, label)``
  (:func:`~jaxmem.cli.loading.load_target`, :class:`~jaxmem.cli.loading.TargetError`);
- :mod:`~jaxmem.cli.common` — the options and steps ``analyze``, ``plan`` and ``bench``
  share (STEP, ``--target``, ``--budget``, loading, planning);
- :mod:`~jaxmem.cli.analyze`, :mod:`~jaxmem.cli.plan`, :mod:`~jaxmem.cli.bench` — those
  three subcommands.

Each subcommand module has one ``_register_<name>(subparsers)`` function that adds its
parser and sets ``func`` to its handler ``(args) -> exit code``.
"""
