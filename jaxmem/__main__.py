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

Each subcommand is registered by one small ``_register_<name>(subparsers)`` function
listed in ``SUBCOMMANDS``. It sets ``func`` to a handler ``(args) -> exit code``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

Subparsers = Any  # argparse._SubParsersAction (private type)


# --- managed-memory -------------------------------------------------------------------------

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


# --- analyze / plan / bench: shared target loading ------------------------------------------

TARGET_HELP = (
    "the train step: zoo:<name>[:test|bench], pkg.module:make_step or file.py:make_step "
    "(make_step() returns (step, args) or an object with .step and .args)"
)


class TargetError(ValueError):
    """A TARGET that cannot be loaded; its message says why (printed, exit code 2)."""


def _step_and_args(obj: Any, where: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if hasattr(obj, "step") and hasattr(obj, "args"):
        return obj.step, tuple(obj.args)
    if isinstance(obj, tuple | list) and len(obj) == 2 and callable(obj[0]):
        return obj[0], tuple(obj[1])
    raise TargetError(
        f"{where} gave {type(obj).__name__}; expected (step, args) or an object with .step "
        "and .args (a benchmarks.zoo.Workload, say)"
    )


def load_target(spec: str, batch: int | None = None, *, abstract: bool = False
                ) -> tuple[Callable[..., Any], tuple, str]:
    """Resolve a STEP string to ``(step, args, label)``.

    ``abstract``: build zoo models with ``jax.ShapeDtypeStruct`` state (for compile-only
    targets; realistic sizes then cost no memory).

    ``zoo:<name>[:size]`` builds ``benchmarks.zoo.make`` (``batch`` overrides its batch):
    the zoo ships with the repository's ``benchmarks/``, not with the installed library, so
    these targets work from a checkout. ``module:attr`` / ``file.py:attr`` imports ``attr``
    and, if it is not already a ``(step, args)`` pair or a Workload-like object, calls it
    with no arguments (or with ``batch=`` when given). The current directory is importable,
    as with ``python -m``.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if spec.startswith("zoo:"):
        zoo = _zoo(spec)
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[1]:
            raise TargetError(f"{spec!r}: expected zoo:<name>[:size]")
        name, size = parts[1], parts[2] if len(parts) == 3 else "test"
        if name not in zoo.names():
            raise TargetError(f"{spec!r}: unknown zoo model {name!r}; choose from {zoo.names()}")
        try:
            zoo.config(name, size)
        except ValueError as e:
            raise TargetError(f"{spec!r}: {e}") from e
        w = zoo.make(name, size=size, batch=batch, abstract=abstract)
        return w.step, tuple(w.args), f"zoo {name} ({size}, batch {w.batch_size})"
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise TargetError(f"{spec!r}: expected pkg.module:make_step, file.py:make_step or "
                          "zoo:<name>[:size]")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise TargetError(f"{spec!r}: no file {mod_name!r}")
            name = "_jaxmem_target_" + os.path.splitext(os.path.basename(mod_name))[0]
            file_spec = importlib.util.spec_from_file_location(name, mod_name)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise TargetError(f"{spec!r}: cannot import {mod_name!r}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise TargetError(f"{spec!r}: {mod_name!r} has no attribute {attr!r}")
    if not (hasattr(obj, "step") and hasattr(obj, "args")) and not isinstance(obj, tuple):
        if not callable(obj):
            raise TargetError(f"{spec!r}: {attr!r} is neither callable nor (step, args)")
        obj = obj(batch=batch) if batch is not None else obj()
    step, args = _step_and_args(obj, spec)
    return step, args, spec


def _zoo(spec: str) -> Any:
    """``benchmarks.zoo``, or a :class:`TargetError` saying where the zoo lives."""
    try:
        return importlib.import_module("benchmarks.zoo")
    except ModuleNotFoundError as e:
        # "The zoo is not here" and "a package the zoo needs is missing" are ours to explain;
        # anything else failing inside the zoo is a bug and keeps its traceback.
        if e.name in ("benchmarks", "benchmarks.zoo"):
            raise TargetError(
                f"{spec!r}: zoo targets need the model zoo, benchmarks/zoo, which ships with "
                "the jaxmem repository, not with the installed package: run from a checkout "
                "of the repository (its root as the current directory), or name your own "
                "step as pkg.module:make_step or file.py:make_step"
            ) from e
        if e.name and e.name.partition(".")[0] not in ("benchmarks", "jaxmem"):
            raise TargetError(
                f"{spec!r}: the model zoo needs {e.name!r}, which is not installed: "
                "pip install -e '.[test]' from the repository root"
            ) from e
        raise


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


# --- analyze --------------------------------------------------------------------------------

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


# --- plan -----------------------------------------------------------------------------------

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


# --- bench ----------------------------------------------------------------------------------

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


# --- entry point ----------------------------------------------------------------------------

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


if __name__ == "__main__":
    sys.exit(main())
