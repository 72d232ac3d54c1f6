"""``python -m jaxmem`` (also the ``jaxmem`` console script): jaxmem from the command line.

Subcommands:

- ``managed-memory``: run a command with XLA's GPU client on CUDA managed memory, or print
  the environment that does it::

      python -m jaxmem managed-memory --oversubscription 1.5 -- python train.py
      eval "$(python -m jaxmem managed-memory --oversubscription 1.5 --print-env)"

- ``analyze STEP``: print :func:`jaxmem.analyze` of a train step (which forward values the
  backward keeps, by layer, and the predicted peak).
- ``plan STEP [--budget B] [--offload] [--target T]``: print the :class:`jaxmem.Plan` of
  ``jaxmem.optimize(step)`` with XLA's compiled figures, plain jit against jaxmem.
- ``bench STEP [--runs N] [--target T]``: plain ``jax.jit`` against ``jaxmem.optimize``:
  compiled peak, FLOPs and (with ``--runs``) CPU/accelerator step time.

``--target`` compiles for a device this machine need not have (:mod:`jaxmem.targets`:
``h100``, ``h200``, ``a100``, ``v5e``, ``v5p``, ``v4``, ``v6e``, a ``.pbtxt`` GPU config):
"what is my peak, my plan, on an H100?" from a laptop. Zoo models are then built abstractly
(nothing initialised), so realistic sizes (``zoo:llama_scan:1b``) work too.

``STEP`` names a train step and its arguments::

      zoo:<name>[:size]          a model of the repository's zoo, benchmarks/zoo (size:
                                 test, the default, or bench); run from a checkout
      pkg.module:make_step       a callable returning (step, args), or an object with
                                 .step and .args (a zoo Workload, say); called with no
                                 arguments (an attribute that already is such an object is
                                 used as is)
      path/to/file.py:make_step  the same, from a file

      python -m jaxmem analyze zoo:resnet
      python -m jaxmem plan zoo:transformer:bench --budget 0.6
      python -m jaxmem plan zoo:transformer:bench --target h100
      python -m jaxmem bench examples.resnet_linen:make_step --runs 3

The commands live in :mod:`jaxmem.cli`, one module each. Each subcommand is registered by one
small ``_register_<name>(subparsers)`` function listed in ``SUBCOMMANDS``
(:mod:`jaxmem.cli.entry`). It sets ``func`` to a handler ``(args) -> exit code``. This module
is the entry point; it re-exports :func:`main`, :func:`build_parser`, :func:`load_target`,
:class:`TargetError` and the rest of the command line's public names.
"""

from __future__ import annotations

import sys

from jaxmem.cli.common import Subparsers
from jaxmem.cli.entry import SUBCOMMANDS, build_parser, main
from jaxmem.cli.loading import TARGET_HELP, TargetError, load_target

__all__ = ["SUBCOMMANDS", "TARGET_HELP", "Subparsers", "TargetError", "build_parser",
           "load_target", "main"]

if __name__ == "__main__":
    sys.exit(main())
