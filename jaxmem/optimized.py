"""``@jaxmem.optimize``: a drop-in ``jax.jit`` for train steps that needs less memory.

The last box of the data flow: trace the step, analyse it, plan, rewrite the joint jaxpr,
jit the result and compile it the jaxmem way (:func:`jaxmem.measure.compile`: barrier flag on
CPU), then check XLA's figures against the plan. Plans and executables are cached per
argument shapes, dtypes, shardings and static arguments, like ``jax.jit``'s cache. The
budget search (:mod:`jaxmem.planning.budget`) gets its compiles from here as callbacks; so does
:func:`pareto`, which runs ``optimize`` at each budget.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem import _jax
from jaxmem.analyzing.analysis import Analysis, from_program
from jaxmem.analyzing.liveness import liveness
from jaxmem.analyzing.losses import logits_notes
from jaxmem.analyzing.tags import offload_tagged, offload_tags_out_of_reach
from jaxmem.compiling import plan_cache, quick_compile
from jaxmem.compiling.multihost import check_same_plan
from jaxmem.compiling.scan_budget import auto_choice, choose_for
from jaxmem.compiling.shard_map import BodyPlanner, plan_bodies
from jaxmem.memory import state_offload
from jaxmem.planning import strategies
from jaxmem.planning.budget import (
    BudgetError,
    Pareto,
    parse_budget,
    plan_with_budget,
    resolve_budget,
)
from jaxmem.planning.budget.pareto import sweep
from jaxmem.planning.plan import Decision, Plan
from jaxmem.rewriting import blockwise
from jaxmem.rewriting.policies import utility
from jaxmem.rewriting.rewrite import apply
from jaxmem.rewriting.scans import TrainBodies, bodies_only, loop_plan
from jaxmem.tracing import arguments, structure
from jaxmem.tracing.program import (
    Program,
    backward_in_units,
    check_leaves,
    flat_donated,
    from_jaxpr,
    trace,
)
from jaxmem.xla import measure, targets
from jaxmem.xla.measure import PEAK_TIE, Figures, fmt_bytes, lowest

STRATEGIES = ("auto", "none")
#: The built-in policy the automatic mode compiles as a candidate of its own, on the whole
#: loss: what users of every JAX library can do without editing the model.
LOSS_POLICY = "dots_saveable"
#: The built-in policies a budget falls back to when jaxmem's own search cannot meet it.
BUILTIN_POLICIES = ("dots_saveable", "nothing_saveable")
VERIFY = (True, False, "background")
log = logging.getLogger("jaxmem")
#: Set when the interpreter exits: background verifications stop before their next compile
#: (a non-daemon thread is joined at exit; this keeps that wait to the compiles in flight).
_CANCEL = threading.Event()
threading._register_atexit(_CANCEL.set)  # noqa: SLF001 - before non-daemon threads are joined


class _Cancelled(Exception):
    """The interpreter is exiting: a background verification stops."""


_VERIFIER: concurrent.futures.ThreadPoolExecutor | None = None


def _in_background(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Run ``fn`` on the background-verification thread (one for the process, created on
    first use: verifications queue rather than share the cores); its result in a future.
    Its worker is joined at exit after :data:`_CANCEL` is set (``_register_atexit`` calls
    run last-registered first, and concurrent.futures registered before jaxmem)."""
    global _VERIFIER
    if _VERIFIER is None:
        _VERIFIER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxmem-verify")
    return _VERIFIER.submit(fn)


def _thread_sees_context() -> bool:
    """Whether a new thread traces under this thread's JAX configuration: context managers
    (``jax.default_matmul_precision``, ``enable_x64``, ...) are thread-local, and a
    background trace under different settings would be a different program."""
    from jax._src import config as jax_config
    here, there = jax_config.trace_context(), []
    t = threading.Thread(target=lambda: there.append(jax_config.trace_context()))
    t.start()
    t.join()
    return bool(there) and there[0] == here


def _first_to_run(plan: Plan, candidates: Sequence[Plan], notes: tuple[str, ...]) -> Plan:
    """The plan ``verify="background"`` runs until the verified one is ready: the candidate
    that drops the most bytes, the fewest recompute FLOPs among equals. (On the zoo GPT at
    bench size on CPU that is ``selective``: the lowest compiled peak of the six and the
    quickest to compile, 12.9 s against MEDL's per-layer plan's 24.7 s.)"""
    if not candidates:
        return plan
    best = max(candidates, key=lambda p: (p.dropped_bytes, -p.recompute_flops))
    return dataclasses.replace(best, donated=plan.donated, notes=best.notes + notes)


def _cancellable(lower: Callable[[], Any]) -> Callable[[], Any]:
    """``lower``, unless the interpreter is exiting (:data:`_CANCEL`)."""
    def call() -> Any:
        if _CANCEL.is_set():
            raise _Cancelled("the interpreter is exiting")
        return lower()
    return call


def _stand_ins(tree: Any) -> Any:
    """Abstract stand-ins (shape, dtype, weak type, sharding) for the arrays of ``tree``:
    what a background compile lowers with after the first call donated the arrays."""
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                        weak_type=getattr(x, "weak_type", False))
        return x
    return jax.tree.map(one, tree)


class Lowered:
    """``jax.stages.Lowered`` whose ``compile()`` uses jaxmem's compiler options.

    On CPU that keeps optimisation barriers, so ``memory_analysis()`` reflects the plan.
    Everything else is delegated to the wrapped object.
    """

    def __init__(self, lowered: Any, compiled: Any = None) -> None:
        self._lowered = lowered
        self._compiled = compiled  # the same program, already compiled the jaxmem way

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Any:
        if self._compiled is not None and (not compiler_options or compiler_options ==
                measure.compiler_options(measure._platform_of(self._lowered))):  # noqa: SLF001
            return self._compiled
        return measure.compile(self._lowered, compiler_options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


@dataclasses.dataclass
class _Entry:
    analysis: Analysis
    plan: Plan
    jitted: Any
    donate_flat: tuple[int, ...]
    plain: Any  # jax.jit of the user's own step on flat inputs (same donation): the baseline
    compiled: Any = None
    static_out: Any = None  # the step's static (non-array) outputs: arguments.partition
    # Executables compiled (the jaxmem way) for arguments the first one rejects: other
    # committed devices or shardings, keyed by _placement.
    placed: dict[Any, Any] = dataclasses.field(default_factory=dict)
    host_state: tuple[int, ...] = ()  # flat argument positions kept in pinned_host memory
    # verify="background": the verification running beside the first calls; its result
    # (the verified plan, its jitted step and executable) replaces plan/jitted/compiled
    # at the start of the first call after it is done (_Entry.adopt).
    # It starts once the first call's own executable is compiled and running (verify_later),
    # so that the two compiles do not share the cores.
    verify_later: Callable[[], Any] | None = None
    plain_predicted: int | None = None  # the plain step's predicted peak: the first plan's bar
    pending: concurrent.futures.Future | None = None
    calls: int = 0  # calls run so far (for the log line that says when a plan was adopted)

    def start_verifying(self) -> None:
        if self.verify_later is not None:
            self.pending, self.verify_later = _in_background(self.verify_later), None

    def adopt(self, wait: bool = False) -> None:
        """Take the background verification's plan, once it is done (or ``wait`` for it)."""
        if wait:
            self.start_verifying()
        fut = self.pending
        if fut is None or not (wait or fut.done()):
            return
        self.pending = None
        try:
            plan, jitted, compiled = fut.result()
        except Exception as e:  # noqa: BLE001 - the running plan stays; say why
            note = (f"background verification failed ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else ''}); the unverified "
                    f"{self.plan.strategy!r} plan keeps running (verify=True verifies "
                    "before the first call)")
            log.warning("jaxmem: %s", note)
            self.plan = dataclasses.replace(self.plan, notes=self.plan.notes + (note,))
            return
        note = (f"verified in the background: ran the unverified {self.plan.strategy!r} plan "
                f"for the first {self.calls} call(s), then this one" if self.calls else
                f"verified before the first call: the unverified {self.plan.strategy!r} plan "
                "did not compile below the plain step's predicted peak")
        log.info("jaxmem: %s (%s)", note, plan.strategy)
        self.plan = dataclasses.replace(plan, notes=plan.notes + (note,))
        self.jitted, self.compiled, self.placed = jitted, compiled, {}


def _placement(flat: Sequence[Any]) -> Any:
    return tuple((getattr(x, "committed", None), repr(getattr(x, "sharding", None)))
                 for x in flat)


def _leaf_key(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    weak = getattr(x, "weak_type", False)
    if isinstance(x, bool | int | float | complex):
        return (type(x).__name__,)
    return (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))), weak,
            None if sharding is None else repr(sharding))


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s positional parameters, in order ([] when it has no signature)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _normalise_argnums(argnums: int | Sequence[int] | None, n: int) -> tuple[int, ...]:
    if argnums is None:
        return ()
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    out = []
    for a in nums:
        if not -n <= a < n:
            raise ValueError(f"argnum {a} is out of range for {n} positional arguments")
        out.append(a % n)
    return tuple(sorted(set(out)))


class Optimized:
    """A train step wrapped by :func:`optimize`. Call it like the original function."""

    def __init__(self, fn: Callable[..., Any], *, budget: Any = None, strategy: str = "auto",
                 offload: bool | str = False, static_argnums: int | Sequence[int] | None = None,
                 static_argnames: str | Sequence[str] | None = None,
                 donate_argnums: int | Sequence[int] | str | None = "auto",
                 max_recompute_fraction: float = 0.05, verify: bool | str = True,
                 remat_scans: bool | Callable[..., Any] = True, offload_state: Any = False,
                 **jit_kwargs: Any) -> None:
        if not (callable(offload_state) or offload_state in state_offload.MODES):
            raise ValueError(f"offload_state must be True, False, 'opt', 'auto', 'all' or a "
                             f"predicate (path, leaf) -> bool, got {offload_state!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not any(verify is v or (isinstance(v, str) and verify == v) for v in VERIFY):
            raise ValueError(f"verify must be True, False or 'background', got {verify!r}")
        _check_options(budget, offload, donate_argnums, max_recompute_fraction)
        unknown = set(jit_kwargs) - {"keep_unused", "inline"}
        if unknown:
            raise TypeError(f"optimize got unsupported jit arguments {sorted(unknown)}; "
                            "shardings follow the arguments' own shardings")
        self.fn = fn
        self.budget = budget
        self.strategy = strategy
        self.offload = offload
        self.static_argnums = static_argnums
        self.static_argnames = ((static_argnames,) if isinstance(static_argnames, str)
                                else tuple(static_argnames or ()))
        self.donate_argnums = donate_argnums
        self.max_recompute_fraction = max_recompute_fraction
        self.verify = verify
        self.remat_scans = remat_scans
        self.offload_state = offload_state
        self.jit_kwargs = jit_kwargs
        self._cache: dict[Any, _Entry] = {}
        self._warned_no_backward = False
        functools.update_wrapper(self, fn)

    # -- public -----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, flat, out_tree = self._prepare(args, kwargs)
        abstract = [x for x in flat if isinstance(x, jax.ShapeDtypeStruct)]
        if abstract:
            where = targets.platform_of(abstract) or "no device"
            raise TypeError(
                f"jaxmem.optimize({getattr(self.fn, '__name__', 'fn')}) was called with "
                f"{len(abstract)} abstract argument(s) (jax.ShapeDtypeStruct, placed on "
                f"{where}): there is nothing to run. For a compile-only target use "
                ".lower(*args).compile() or .plan(*args); to run, pass arrays.")
        entry.adopt()  # verify="background": the verified plan, once it is ready
        if entry.compiled is None:
            entry.compiled = measure.compile(entry.jitted.lower(*flat))
            if entry.verify_later is not None and entry.plain_predicted is not None:
                peak = measure.figures(entry.compiled).peak
                if peak >= entry.plain_predicted:  # unverified and no better: verify first
                    log.info("jaxmem: the unverified %r plan compiled to %s, not below the "
                             "plain step's predicted %s: verifying before the first call",
                             entry.plan.strategy, fmt_bytes(peak),
                             fmt_bytes(entry.plain_predicted))
                    entry.adopt(wait=True)
        entry.calls += 1
        try:
            outs = entry.compiled(*flat)
        except (TypeError, ValueError):
            # An executable is strict about committed devices and shardings (jit is not):
            # compile the same step for these arguments, the jaxmem way (never a plain jit
            # call: on CPU that would drop the barriers and with them the plan's recompute).
            outs = self._placed(entry, flat)(*flat)
        entry.start_verifying()  # verify="background": after the first call's compile
        return arguments.combine(jax.tree_util.tree_unflatten(out_tree, outs), entry.static_out)

    def _placed(self, entry: _Entry, flat: list[Any]) -> Callable[..., Any]:
        key = _placement(flat)
        if key not in entry.placed:
            entry.placed[key] = measure.compile(entry.jitted.lower(*flat))
        exe = entry.placed[key]

        def call(*leaves: Any) -> Any:
            try:
                return exe(*leaves)
            except (TypeError, ValueError) as e:
                name = getattr(self.fn, "__name__", "fn")
                raise (TypeError if isinstance(e, TypeError) else ValueError)(
                    f"jaxmem.optimize({name}): the step compiled for these arguments' devices "
                    f"and shardings rejects them: {e}. Put the arguments on one device (or "
                    "mesh) with jax.device_put before the call.") from e
        return call

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Like ``jax.jit(f).lower``; ``.compile()`` on the result applies jaxmem's options."""
        entry, flat, _ = self._prepare(args, kwargs)
        entry.adopt(wait=True)
        return Lowered(entry.jitted.lower(*flat), entry.compiled)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """Like ``jax.jit(f).trace``: a ``jax.stages.Traced`` of the rewritten step."""
        entry, flat, _ = self._prepare(args, kwargs)
        entry.adopt(wait=True)
        return entry.jitted.trace(*flat)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The :class:`~jaxmem.planning.plan.Plan` for these arguments, with compiled figures."""
        entry, flat, _ = self._prepare(args, kwargs)
        entry.adopt(wait=True)
        if entry.plan.compiled is None:
            if entry.compiled is None:
                entry.compiled = measure.compile(entry.jitted.lower(*flat))
            baseline = self._baseline(entry, flat)
            entry.plan = entry.plan.with_figures(_read(entry.compiled, entry.jitted, flat),
                                                 baseline)
        return entry.plan

    def analysis(self, *args: Any, **kwargs: Any) -> Analysis:
        """The :class:`~jaxmem.analyzing.analysis.Analysis` the plan was made from."""
        return self._prepare(args, kwargs)[0].analysis

    # -- internals --------------------------------------------------------------------------
    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[int, ...], tuple[Any, ...], frozenset[str]]:
        """Static positions, their values, and static keyword names. As in ``jax.jit``, a
        static argument is static however it is passed: ``static_argnames`` given
        positionally, ``static_argnums`` given by keyword (matched through the signature)."""
        names = _positional_names(self.fn)
        nums = (self.static_argnums,) if isinstance(self.static_argnums, int) else tuple(
            self.static_argnums or ())
        by_kw = {names[i % len(names)] for i in nums
                 if names and not -len(args) <= i < len(args) and -len(names) <= i < len(names)
                 and names[i % len(names)] in kwargs}
        nums = tuple(i for i in nums if not (names and -len(names) <= i < len(names)
                                              and names[i % len(names)] in by_kw))
        nums += tuple(names.index(n) for n in self.static_argnames
                      if n in names and names.index(n) < len(args))
        static = _normalise_argnums(nums, len(args))
        return static, tuple(args[i] for i in static), frozenset(self.static_argnames) | by_kw

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Entry, list, Any]:
        arguments.check_no_nnx_nodes(args, kwargs, getattr(self.fn, "__name__", "fn"))
        static, static_vals, static_names = self._split(args, kwargs)
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static)
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in static_names))
        kwargs = {k: v for k, v in kwargs.items() if k not in static_names}
        (dyn_args, kwargs), leaf_static = arguments.partition((dyn_args, kwargs))
        check_leaves(dyn_args, kwargs)
        flat, in_tree = jax.tree_util.tree_flatten((dyn_args, kwargs))
        if self.offload_state:  # traced, keyed and compared on the device, streamed from host
            dyn_args, kwargs = jax.tree.map(state_offload.device_view, (dyn_args, kwargs))
        try:
            leaves = jax.tree_util.tree_leaves((dyn_args, kwargs))
            key = (in_tree, tuple(_leaf_key(x) for x in leaves), static, static_vals, static_kw,
                   leaf_static)
            hash(key)
        except TypeError as e:
            raise TypeError(f"static arguments must be hashable: {e}") from e
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(args, static, dyn_args, kwargs, dict(static_kw), leaf_static)
            check_same_plan(entry.plan, getattr(self.fn, "__name__", "the step"))  # multihost
            self._cache[key] = entry
        out_tree = entry.analysis.program.out_tree
        if entry.host_state:
            flat = state_offload.place(flat, entry.host_state)
        return entry, flat, out_tree

    def _bound(self, args: tuple[Any, ...], static: tuple[int, ...],
               static_kw: dict[str, Any], leaf_static: Any = None) -> Callable[..., Any]:
        def call(*dyn: Any, **kw: Any) -> Any:
            dyn, kw = arguments.combine((dyn, kw), leaf_static)
            it = iter(dyn)
            full = [args[i] if i in static else next(it) for i in range(len(args))]
            out, call.static_out = arguments.partition(self.fn(*full, **kw, **static_kw),
                                                       "output")
            return out
        call.__name__ = getattr(self.fn, "__name__", "fn")  # named in trace errors
        return call

    def _donated(self, dyn_args: tuple[Any, ...], analysis: Analysis) -> tuple[int, ...]:
        """Positional (dynamic) argument indices to donate."""
        if self.donate_argnums == "auto":
            out_avals: dict[Any, int] = {}
            prog = analysis.program
            for v in prog.outputs:
                k = (prog.values[v].shape, prog.values[v].dtype)
                out_avals[k] = out_avals.get(k, 0) + 1
            chosen = []
            for i, a in enumerate(dyn_args):
                leaves = jax.tree_util.tree_leaves(a)
                need: dict[Any, int] = {}
                for x in leaves:
                    k = (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", "")))
                    need[k] = need.get(k, 0) + 1
                # arrays, or their abstract stand-ins placed on a (compile-only) target
                arrays = [x for x in leaves if isinstance(x, jax.Array | jax.ShapeDtypeStruct)]
                if arrays and len(arrays) == len(leaves) and all(
                        out_avals.get(k, 0) >= c for k, c in need.items()):
                    chosen.append(i)
                    for k, c in need.items():
                        out_avals[k] -= c
            return tuple(chosen)
        return _normalise_argnums(self.donate_argnums, len(dyn_args))

    def _build(self, args: tuple[Any, ...], static: tuple[int, ...], dyn_args: tuple[Any, ...],
               kwargs: dict[str, Any], static_kw: dict[str, Any], leaf_static: Any) -> _Entry:
        fn = self._bound(args, static, static_kw, leaf_static)
        body = None  # a budget picks the scan bodies' policy too (jaxmem.compiling.scan_budget)
        lean = None  # no budget: a leaner body policy within the FLOP cap, compile-checked
        program, loop_plans = self._trace(fn, dyn_args, kwargs)
        # Only a step that scans can have a body policy to choose: the choice traces the
        # step again under each candidate, so a step without a scan skips it (one trace).
        if self.remat_scans is True and self.strategy != "none" and _scans(program.jaxpr.jaxpr):
            if self.budget is not None:
                body = choose_for(self, fn, dyn_args, kwargs)
            elif self.verify:
                lean = auto_choice(self, fn, dyn_args, kwargs)
            if body or lean:
                program, loop_plans = self._trace(
                    fn, dyn_args, kwargs, body.policy if body else lean[0])
        program = structure.label(program)
        analysis = from_program(program)
        flat = jax.tree_util.tree_leaves((dyn_args, kwargs))
        platform = targets.platform_of(flat) or jax.default_backend()
        self._check_offload(analysis, flat, platform)
        donated = self._donated(dyn_args, analysis)
        donate_flat = flat_donated(dyn_args, donated)

        def jit_plan(p: Plan) -> Any:
            return jax.jit(apply(program, p), donate_argnums=donate_flat, **self.jit_kwargs)

        in_tree = jax.tree_util.tree_structure((dyn_args, kwargs))
        plain = self._plain(fn, in_tree, donate_flat)

        def loss_ckpt(policy: str = LOSS_POLICY, per_block: bool = False
                      ) -> tuple[Any, list[str]]:
            return self._loss_checkpointed(fn, in_tree, donate_flat, policy, per_block)

        planning = program.has_backward and self.strategy != "none"
        # The plan cache holds plans; a step that streams its state from host memory decides
        # that per call of the budget search, so it is planned afresh.
        key = plan_cache.fingerprint(program.jaxpr, (platform, _device_kind(flat),
                                                     _shardings(flat)),
                                     self._options(donate_flat)) \
            if planning and self.offload_state is False else None
        cached = plan_cache.load(key) if key else None
        # verify="background": the first call runs one unverified candidate; the others
        # compile in a thread beside the next calls (single process only: hosts must run
        # the same program at every step; and only where the thread traces the same way).
        defer = (self.verify == "background" and planning and self.budget is None
                 and self.offload_state is False and jax.process_count() == 1
                 and cached is None and _thread_sees_context())
        lean_notes = lean[1] if lean else ()
        deferred, made = False, None
        if cached is not None:  # made before (this process, or the disk cache): no compiles
            plan, compiled = dataclasses.replace(cached, donated=donated), None
            stream_state = False
        else:
            plan, compiled, stream_state = self._make_plan(analysis, jit_plan, plain, dyn_args,
                                                           kwargs, donated, platform, body,
                                                           loop_plans, loss_ckpt, defer)
            deferred = defer and bool(plan.recompute) and not plan.offload
            made = plan  # the plan _verified starts from (its donation, its fallback note)
            plan = dataclasses.replace(plan, notes=plan.notes + lean_notes)
            if deferred:
                plan = dataclasses.replace(plan, notes=plan.notes + (
                    "not verified yet: verify='background' compiles the candidate plans and "
                    "the plain step beside the first calls, and the lowest takes over at the "
                    "first call after that (step.plan(...) waits for it)",))
            elif key:
                plan_cache.store(key, plan)
        # A budget the plain step already fits drops nothing: run the plain step itself (its
        # figures are the ones the budget was checked against).
        nothing = (self.budget is not None and not (plan.recompute or plan.offload)
                   and body is None and not plan.inner and not plan.loss_policy)
        jitted = plain if nothing else self._jitted_for(plan, plain, jit_plan, loss_ckpt, body)
        host_state: tuple[int, ...] = ()
        if stream_state:
            jitted, info = state_offload.wrap(jitted, program, (dyn_args, kwargs), flat,
                                              donate_flat, self.offload_state,
                                              _device_of(flat), self.jit_kwargs)
            if info is not None:
                host_state, compiled = info.inputs, None
                plan = dataclasses.replace(plan, state_offload=info, compiled=None,
                                           notes=plan.notes + (info.describe(_profile_of(flat)),))
        entry = _Entry(analysis=analysis, plan=plan, jitted=jitted, donate_flat=donate_flat,
                       plain=plain, compiled=compiled, static_out=fn.static_out,
                       host_state=host_state)
        if deferred:
            stand = _stand_ins((dyn_args, kwargs))

            def verify_later() -> tuple[Plan, Any, Any]:
                best, exe = self._verified(made, analysis, jit_plan, plain, *stand, loss_ckpt)
                best = dataclasses.replace(best, notes=best.notes + lean_notes)
                if key:
                    plan_cache.store(key, best)
                return best, self._jitted_for(best, plain, jit_plan, loss_ckpt), exe
            entry.verify_later = verify_later
            entry.plain_predicted = from_program(program, donated=donate_flat,
                                                 platform=platform).peak_bytes
        return entry

    @staticmethod
    def _jitted_for(plan: Plan, plain: Any, jit_plan: Callable[[Plan], Any],
                    loss_ckpt: Callable[..., Any], body: Any = None) -> Any:
        """The jitted step that runs ``plan``: the plain step, the step with its loss under
        the built-in policy, or the rewrite. ``body``: a budget's scan-body choice (the
        step is then traced under it, even with nothing dropped outside the scan)."""
        if plan.strategy == "none" and body is None:
            return plain
        if plan.loss_policy:
            return loss_ckpt(plan.loss_policy, plan.loss_blocks)[0]
        return jit_plan(plan)

    def _options(self, donate_flat: tuple[int, ...]) -> tuple[Any, ...]:
        """What changes the plan besides the program and target: the plan cache's key."""
        # verify="background" ends with the plan verify=True makes: one cache entry for both
        return (self.budget, self.strategy, self.offload, self.max_recompute_fraction,
                self.verify is not False, self.remat_scans, donate_flat,
                sorted(self.jit_kwargs.items()))

    def _make_plan(self, analysis: Analysis, jit_plan: Callable[[Plan], Any], plain: Any,
                   dyn_args: tuple[Any, ...], kwargs: dict[str, Any], donated: tuple[int, ...],
                   platform: str, body: Any = None, loop_plans: tuple[Any, ...] = (),
                   loss_ckpt: Callable[[], tuple[Any, list[str]]] | None = None,
                   defer: bool = False) -> tuple[Plan, Any, bool]:
        """Plan the step (compiling candidates on its target); the chosen plan's executable
        when one was compiled on the way; whether the optimizer state streams from host
        memory (``offload_state``). ``loop_plans``: the plans of loop and shard_map bodies
        planned as steps of their own (:meth:`_trace`). ``loss_ckpt()``: the step with its
        loss under ``jax.checkpoint`` of the built-in policy (:meth:`_loss_checkpointed`),
        one more candidate of the automatic mode. ``defer``: leave the candidates' verifying
        compiles to the caller (``verify="background"``)."""
        program, flat = analysis.program, jax.tree_util.tree_leaves((dyn_args, kwargs))
        compiled, exes, plain_figures = None, {}, {}

        def compile_plan(p: Plan) -> Figures:
            jitted = jit_plan(p)
            exe = exes[_rewrite_key(p)] = measure.compile(jitted.lower(*flat))
            return _read(exe, jitted, flat)

        def compile_plain() -> Figures:
            # The plain step is the same program however often a search asks: compiled once
            # (the state-offload path runs up to two searches and reads the plain peak too).
            if None not in plain_figures:
                exe = exes[None] = measure.compile(plain.lower(*flat))
                plain_figures[None] = _read(exe, plain, flat)
            return plain_figures[None]

        plan = dataclasses.replace(self._first_plan(analysis, loop_plans), donated=donated)
        planning = program.has_backward and self.strategy != "none"
        # "auto": only where a budget needs it (state_offload.with_budget decides)
        stream_state = self.offload_state is not False and self.offload_state != "auto"
        if planning and body is not None and body.fits:
            # The body policy fits with no recompute outside the scan (compiled so).
            plan = dataclasses.replace(
                strategies.plan_auto(analysis, max_recompute_fraction=0.0), donated=donated,
                strategy="budget: scan body", budget=body.budget, notes=body.notes)
        elif planning and self.budget is not None:
            auto = plan
            try:
                plan, stream_state = state_offload.with_budget(
                    lambda b: plan_with_budget(
                        analysis, b, auto=auto,
                        compile_plan=plan_cache.progress(compile_plan, "budget search"),
                        compile_plain=plan_cache.progress(compile_plain, "budget search"),
                        device_peak=lambda p, fig: device_peak(program, p, fig, platform),
                        offload=self.offload),
                    self.budget, self.offload_state,
                    self.offload_state and state_offload.preview(
                        program, (dyn_args, kwargs), self.offload_state, flat),
                    lambda: compile_plain().peak, _profile_of(flat))
            except BudgetError as e:
                if self.offload_state is not False or loss_ckpt is None:
                    raise
                plan, compiled = self._builtin_within(e, analysis, donated, loss_ckpt, flat,
                                                      compile_plain)
            else:
                plan = dataclasses.replace(plan, donated=donated,
                                           notes=plan.notes + (body.notes if body else ()))
                # the executable the search compiled for the chosen plan runs the first call
                compiled = exes.get(_rewrite_key(plan) if plan.recompute or plan.offload
                                    else None)
        elif planning and (self.offload is True or offload_tagged(analysis)):
            # No budget: values tagged with jaxmem.offload_name are offloaded; offload=True
            # also offloads kept residuals whose round trip hides under compute.
            plan = strategies.plan_offload(analysis, plan, offload=self.offload)
            plan = dataclasses.replace(plan, donated=donated)
        if self.budget is not None and not planning:
            plan, compiled = self._unplanned_budget(plan, analysis, plain, flat,
                                                    jit_plan(plan) if plan.inner else None)
        plan = dataclasses.replace(plan, notes=plan.notes + logits_notes(analysis))
        if (self.verify and self.budget is None and plan.recompute and not plan.offload):
            if not defer:
                plan, compiled = self._verified(plan, analysis, jit_plan, plain, dyn_args,
                                                kwargs, loss_ckpt)
            else:  # the first calls run the candidate that drops the most (fewest FLOPs)
                plan = _first_to_run(plan, strategies.auto_candidates(
                    analysis, max_recompute_fraction=self.max_recompute_fraction),
                    logits_notes(analysis))
        elif self.verify and self.budget is None and plan.offload:
            plan, compiled = self._verified_offload(plan, analysis, jit_plan, plain, flat,
                                                    platform)
        return plan, compiled, stream_state

    @staticmethod
    def _builtin_within(error: BudgetError, analysis: Analysis, donated: tuple[int, ...],
                        loss_ckpt: Callable[..., Any], flat: Sequence[Any],
                        compile_plain: Callable[[], Figures]) -> tuple[Plan, Any]:
        """A budget jaxmem's search cannot meet, tried with JAX's built-in policies: the loss
        under ``jax.checkpoint(policy=dots_saveable | nothing_saveable)``, around each block
        of the name stack (what ``nn.remat`` does) and around the whole loss. The one with
        the fewest FLOPs among those whose compiled peak fits runs; none fits: ``error``
        again, its minimum the lowest peak found either way."""
        base = compile_plain()
        fits, lowest = [], error.minimum_bytes
        for policy in BUILTIN_POLICIES:
            for per_block in (True, False):
                jitted, wrapped = loss_ckpt(policy, per_block)
                try:
                    lowered = jitted.lower(*flat)
                except Exception:  # noqa: BLE001 - jax.checkpoint cannot take this loss
                    continue
                if not wrapped:  # no differentiated loss, or no blocks in its names: plain
                    continue
                exe = measure.compile(lowered)
                fig = _read(exe, jitted, flat)
                lowest = min(lowest, fig.peak)
                if fig.peak <= error.requested_bytes:
                    fits.append((fig.flops, fig.peak, policy, per_block, fig, exe))
        if not fits:
            raise BudgetError(
                f"{error} The loss under JAX's built-in policies (dots_saveable, "
                f"nothing_saveable; per block and whole) compiled to {fmt_bytes(lowest)} at "
                "the lowest.", error.requested_bytes, lowest) from error
        _, _, policy, per_block, fig, exe = min(fits, key=lambda t: t[:2])
        what = (f"jax.checkpoint(block, policy={policy}) per block" if per_block
                else f"jax.checkpoint(loss, policy={policy})")
        note = (f"jaxmem's budget search reached {fmt_bytes(error.minimum_bytes)}, above the "
                f"budget {fmt_bytes(error.requested_bytes)}; the step runs as written with "
                f"its loss under {what}, which compiled to {fmt_bytes(fig.peak)}: of JAX's "
                "built-in policies that fit, the fewest FLOPs")
        plan = dataclasses.replace(
            strategies.plan_none(analysis), donated=donated, strategy=f"budget: {what}",
            loss_policy=policy, loss_blocks=per_block, budget=error.requested_bytes,
            recompute_flops=max(fig.flops - base.flops, 0.0), notes=(note,))
        return plan.with_figures(fig, base), exe

    def _trace(self, fn: Callable[..., Any], dyn_args: tuple[Any, ...],
               kwargs: dict[str, Any], policy: Any = None) -> tuple[Program, tuple[Any, ...]]:
        """The step's program, and the plans of the loop and shard_map bodies planned as
        steps of their own on the way; scan bodies under jax.checkpoint(policies.utility)
        when ``remat_scans`` (the joint rewrite keeps a scan whole), or under ``policy`` (or
        the policy ``remat_scans`` is)."""
        if self.remat_scans and self.strategy != "none":
            policy = policy or (utility if self.remat_scans is True else self.remat_scans)
            bodies = TrainBodies(lambda body: Optimized(  # gradient-accumulation loops
                body, donate_argnums=(), verify=self.verify is not False,
                max_recompute_fraction=self.max_recompute_fraction))
            with _jax.checkpointed_scan_bodies(policy, bodies):
                program = trace(fn, *dyn_args, **kwargs)
            sharded = BodyPlanner(self.max_recompute_fraction, self.verify is not False)
            program = plan_bodies(program, sharded)
            loop_plans = tuple(bodies.plans) + tuple(sharded.plans)
            if program.has_backward or loop_plans:
                return program, loop_plans
        return trace(fn, *dyn_args, **kwargs), ()  # nothing differentiated: trace it untouched

    def _first_plan(self, analysis: Analysis, loop_plans: tuple[Any, ...] = ()) -> Plan:
        """MEDL's auto plan, or keep everything (``strategy="none"``, no backward pass); a
        step whose only backward passes are in loop bodies runs their ``loop_plans``."""
        if not analysis.program.has_backward and loop_plans:
            return loop_plan(analysis, loop_plans)
        if not analysis.program.has_backward:
            if not self._warned_no_backward:
                warnings.warn(f"jaxmem.optimize: {_why_unplanned(self.fn, analysis)}; running "
                              "it as a plain jax.jit.", stacklevel=5)
                self._warned_no_backward = True
            return strategies.plan_none(analysis)
        if self.strategy == "none":
            return strategies.plan_none(analysis)
        return strategies.plan_auto(analysis,
                                    max_recompute_fraction=self.max_recompute_fraction)

    def _unplanned_budget(self, plan: Plan, analysis: Analysis, plain: Any,
                          flat: Sequence[Any], planned: Any = None) -> tuple[Plan, Any]:
        """A budget on a step with nothing to plan (no backward pass at the top level, or
        ``strategy="none"``): the plain step runs, so its compiled peak must fit, or
        ``BudgetError`` (a budget is a guarantee, never a hint). ``planned``: the step with
        its loop or shard_map bodies planned, which runs if its compiled peak fits."""
        exe = measure.compile(plain.lower(*flat))
        base = _read(exe, plain, flat)
        requested = resolve_budget(self.budget, base.peak)
        if planned is not None:  # bodies planned as steps of their own (loops, shard_map)
            planned_exe = measure.compile(planned.lower(*flat))
            fig = _read(planned_exe, planned, flat)
            if fig.peak <= requested:
                note = (f"bodies planned as steps of their own (without the budget): the "
                        f"step's compiled peak {fmt_bytes(fig.peak)} fits the budget "
                        f"{fmt_bytes(requested)}")
                return dataclasses.replace(plan, budget=requested, notes=plan.notes + (note,),
                                           compiled=fig, baseline=base), planned_exe
            plan = dataclasses.replace(plan, inner=())  # the plain step, if anything fits
        why = (_why_unplanned(self.fn, analysis) if not analysis.program.has_backward
               else 'strategy="none" runs the plain step')
        if base.peak > requested:
            raise BudgetError(
                f"jaxmem.optimize: {why}, so nothing can be recomputed or offloaded, and the "
                f"plain step's compiled peak {fmt_bytes(base.peak)} is above the budget "
                f"{fmt_bytes(requested)}. Raise the budget, use a smaller batch, or put the "
                "memory-heavy part under jaxmem.checkpoint.", requested, base.peak)
        note = (f"{why}: the plain step's compiled peak {fmt_bytes(base.peak)} fits the budget "
                f"{fmt_bytes(requested)}")
        return dataclasses.replace(plan, budget=requested, notes=plan.notes + (note,),
                                   compiled=base, baseline=base), exe

    def _check_offload(self, analysis: Analysis, flat: Sequence[Any], platform: str) -> None:
        """Offload needs a host memory kind; tags the rewrite cannot reach are reported."""
        far = offload_tags_out_of_reach(analysis)
        wanted = self.offload in (True, "auto") or offload_tagged(analysis)
        if wanted and "pinned_host" not in (kinds := _jax.memory_kinds(_device_of(flat))):
            raise ValueError(
                f"jaxmem.optimize: offload needs a 'pinned_host' memory kind, but the "
                f"{platform} device has {sorted(kinds) or 'none'}; pass "
                "offload=False (and remove jaxmem.offload_name tags), or run on a backend "
                "with host memory (GPU, TPU, CPU)")
        for tag, unit, layer in far:
            warnings.warn(
                f"jaxmem.optimize: offload_name({tag!r}) is inside a {unit} "
                f"(layer {layer or '<top>'}); the joint rewrite keeps control flow whole, so "
                "that value was kept on the device. To offload inside a loop body, wrap the "
                "body in jaxmem.checkpoint(body, budget=..., offload=True).", stacklevel=5)

    def _verified(self, plan: Plan, analysis: Analysis, jit_plan: Callable[[Plan], Any],
                  plain: Any, dyn_args: tuple[Any, ...], kwargs: dict[str, Any],
                  loss_ckpt: Callable[[], tuple[Any, list[str]]] | None = None
                  ) -> tuple[Plan, Any]:
        """Compile the auto strategy's candidates and the plain step on the arguments'
        target; keep the lowest peak, and return its executable with it (the first call
        runs it instead of compiling again).

        The candidates (:func:`jaxmem.planning.strategies.auto_candidates`) drop the same kind of
        values but group their re-creation differently (per layer, per block, per block
        with every cheap value): which one XLA keeps least of depends on the compiler, so
        the compiler the step is for decides. One more candidate is the built-in policy
        itself: the step traced with its loss differentiated under
        ``jax.checkpoint(policy=dots_saveable)`` (``loss_ckpt``), what a user does without
        editing the model, and the same around each block of the loss (blocks from the name
        stack, :mod:`jaxmem.rewriting.blockwise`: what ``nn.remat`` around every block does); so the
        automatic plan is never above them on the step's compiler.
        If none beats the plain step's compiled peak, the plain step is kept, with a warning
        and a note in the plan.
        """
        flat = jax.tree_util.tree_leaves((dyn_args, kwargs))
        variants = [dataclasses.replace(p, donated=plan.donated) for p in
                    strategies.auto_candidates(
                        analysis, max_recompute_fraction=self.max_recompute_fraction)]
        if self.remat_scans:  # scanned layers: their body policy alone is a candidate too
            variants += bodies_only(analysis, plan.donated)
        variants = variants or [plan]
        jitted_all = [plain] + [jit_plan(p) for p in variants]
        thunks = [_cancellable(functools.partial(j.lower, *flat)) for j in jitted_all]
        skipped: tuple[str, ...] = ()
        # The built-in policy itself, around the whole loss and around each of its blocks
        # (nn.remat's per-block dots_saveable, blocks from the name stack): a step whose loss
        # jax.grad / value_and_grad differentiates gets both as candidates.
        for per_block in (False, True) if loss_ckpt is not None else ():
            what = (f"jax.checkpoint(block, policy={LOSS_POLICY}) per block" if per_block
                    else f"jax.checkpoint(loss, policy={LOSS_POLICY})")
            loss_jit, wrapped = loss_ckpt(LOSS_POLICY, per_block)
            try:
                loss_lowered = loss_jit.lower(*flat)
            except Exception as e:  # noqa: BLE001 - jax.checkpoint cannot take this loss
                skipped += (f"{what} not compiled: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",)
                continue
            if wrapped:  # a differentiated loss (with blocks, per_block) was wrapped
                variants = [*variants, dataclasses.replace(
                    strategies.plan_none(analysis), donated=plan.donated, strategy=what,
                    loss_policy=LOSS_POLICY, loss_blocks=per_block)]
                jitted_all.append(loss_jit)
                thunks.append(functools.partial(lambda lowered: lowered, loss_lowered))
        # Side by side in threads, for their figures only (quick_compile): the winner alone
        # is compiled in full to run.
        lowered, exes = quick_compile.compile_all(thunks)
        base = _read(exes[0], plain, flat)
        figs = [_read(exe, jitted, flat) for jitted, exe in
                zip(jitted_all[1:], exes[1:], strict=True)]
        best_i = lowest(figs) + 1
        best, best_fig = variants[best_i - 1], figs[best_i - 1]
        if best_fig.peak < base.peak:
            best_exe = quick_compile.finish(lowered[best_i], exes[best_i])
            if best_exe is not exes[best_i]:  # figures of what runs: the same, or warned
                best_fig = quick_compile.checked(best_fig, _read(best_exe, jitted_all[best_i],
                                                                 flat))
            if best.strategy != "auto":
                best = dataclasses.replace(best, strategy=f"auto: {best.strategy}")
            if best.loss_policy:  # JAX's partial evaluation chose what is recomputed
                best = dataclasses.replace(
                    best, recompute_flops=max(best_fig.flops - base.flops, 0.0),
                    notes=best.notes + (
                        f"the step runs as written, its loss differentiated under "
                        f"jax.checkpoint(policy=jax.checkpoint_policies.{best.loss_policy})"
                        + (" around each block (blocks from the name stack)"
                           if best.loss_blocks else "") +
                        ": it compiled lower than jaxmem's rewrites here; the residual table "
                        "above is the step's own, JAX decides what is recomputed",))
            tried = ", ".join(p.strategy for p in variants)
            note = (f"compiled {len(variants)} candidate plan(s) for {best_fig.platform or 'cpu'}"
                    f" ({tried}); kept the lowest peak (within {PEAK_TIE:.2%}, the fewest "
                    "FLOPs)")
            best = dataclasses.replace(best, notes=best.notes + (note,) + skipped)
            return best.with_figures(best_fig, base), best_exe
        none = dataclasses.replace(strategies.plan_none(analysis), donated=plan.donated)
        note = (f"the {plan.strategy!r} plan compiled to a peak of {fmt_bytes(best_fig.peak)}, "
                f"not below the plain step's {fmt_bytes(base.peak)}: kept the plain step "
                "(pass verify=False to force the plan, or try a budget)")
        warnings.warn(f"jaxmem.optimize: {note}", stacklevel=5)
        return dataclasses.replace(none, notes=plan.notes + (note,) + skipped, compiled=base,
                                   baseline=base), quick_compile.finish(lowered[0], exes[0])

    def _verified_offload(self, plan: Plan, analysis: Analysis,
                          jit_plan: Callable[[Plan], Any], plain: Any, flat: Sequence[Any],
                          platform: str) -> tuple[Plan, Any]:
        """``verify`` for a plan that offloads (``offload=True`` or ``offload_name`` tags, no
        budget): compile it and the same offloads without recompute, keep the lower device
        peak (:func:`device_peak`: XLA's, or on CPU the estimate without host-resident
        bytes); if neither is below the plain step's compiled peak, keep the plain step with
        a warning and a note, as :meth:`_verified` does."""
        base_exe = measure.compile(plain.lower(*flat))
        base = _read(base_exe, plain, flat)
        only = strategies.plan_offload(analysis, strategies.plan_none(analysis),
                                       offload=self.offload)
        variants = [plan] + ([dataclasses.replace(only, donated=plan.donated)]
                             if only.offload and set(only.offload) != set(plan.offload) or
                             plan.recompute else [])
        best = None
        for p in variants:
            jitted = jit_plan(p)
            exe = measure.compile(jitted.lower(*flat))
            fig = _read(exe, jitted, flat)
            peak, why = device_peak(analysis.program, p, fig, platform)
            if best is None or (peak, fig.flops) < (best[0], best[2].flops):
                best = (peak, p, fig, exe, why)
        peak, best_plan, fig, exe, why = best
        if peak <= base.peak:
            notes = best_plan.notes + ((why,) if why else ())
            return dataclasses.replace(best_plan, notes=notes).with_figures(fig, base), exe
        note = (f"the {plan.strategy!r} plan's device peak {fmt_bytes(peak)} is not below the "
                f"plain step's {fmt_bytes(base.peak)}: kept the plain step, nothing offloaded "
                "(pass verify=False to force the plan, or try a budget)")
        warnings.warn(f"jaxmem.optimize: {note}", stacklevel=5)
        none = dataclasses.replace(strategies.plan_none(analysis), donated=plan.donated)
        return dataclasses.replace(none, notes=plan.notes + (note,), compiled=base,
                                   baseline=base), base_exe

    def _baseline(self, entry: _Entry, flat: list[Any]) -> Figures:
        """Plain ``jax.jit`` of the user's step, compiled the same way (same donation)."""
        return _figures(entry.plain, [state_offload.device_view(x) for x in flat])

    def _loss_checkpointed(self, fn: Callable[..., Any], in_tree: Any,
                           donate_flat: tuple[int, ...], policy: str = "dots_saveable",
                           per_block: bool = False) -> tuple[Any, list[str]]:
        """``jax.jit`` of the user's step on flat inputs with every loss it differentiates
        under ``jax.checkpoint(policy=jax.checkpoint_policies.<policy>)``
        (:func:`jaxmem._jax.checkpointed_losses`, applied inside the traced function, so every
        trace of it is the checkpointed one), and the names of the losses wrapped by its
        last trace (empty: the step differentiates nothing through ``jax.grad`` /
        ``jax.value_and_grad``, and runs as the plain step). ``per_block``: each block of
        the loss under its own ``jax.checkpoint`` (:mod:`jaxmem.rewriting.blockwise`); a loss whose
        name stack gives no blocks is not wrapped then."""
        checkpoint_policy = getattr(jax.checkpoint_policies, policy)
        wrapped: list[str] = []

        def checkpointed(*a: Any, **k: Any) -> Any:
            with _jax.checkpointed_losses(
                    checkpoint_policy,
                    blockwise.checkpoint_blocks if per_block else None) as names:
                out = fn(*a, **k)
            wrapped[:] = names
            return out
        return self._plain(checkpointed, in_tree, donate_flat), wrapped

    def _plain(self, fn: Callable[..., Any], in_tree: Any, donate_flat: tuple[int, ...]) -> Any:
        def flat_fn(*leaves: Any) -> Any:
            a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
            return jax.tree_util.tree_leaves(fn(*a, **k))
        return jax.jit(flat_fn, donate_argnums=donate_flat, **self.jit_kwargs)


def _check_options(budget: Any, offload: Any, donate_argnums: Any,
                   max_recompute_fraction: Any) -> None:
    """Reject bad options when ``optimize`` is called, each with what to pass instead (an
    option that slipped through used to be ignored or fail on the first call)."""
    if budget is not None:
        parse_budget(budget)
    if not (isinstance(offload, bool | np.bool_) or offload == "auto"):
        raise ValueError(f"offload must be True, False or 'auto', got {offload!r} "
                         f"({type(offload).__name__})")
    d = donate_argnums
    ints = (isinstance(d, int | np.integer) and not isinstance(d, bool)) or (
        isinstance(d, Sequence) and not isinstance(d, str)
        and all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in d))
    if not (d is None or d == "auto" or ints):
        raise ValueError(
            f"donate_argnums must be 'auto', None, an int or a sequence of ints (positions of "
            f"the arguments to donate), got {d!r}; to donate every argument pass "
            "tuple(range(n_args))")
    f = max_recompute_fraction
    if isinstance(f, bool) or not isinstance(f, int | float | np.number) or not 0 <= f < np.inf:
        raise ValueError(f"max_recompute_fraction must be a number >= 0 (a fraction of the "
                         f"step's FLOPs), got {f!r}")


def _figures(jitted: Any, flat: Sequence[Any]) -> Figures:
    """Compiled figures of ``jitted`` on the flat arguments, compiled the jaxmem way, for
    the arguments' target (jaxmem's FLOP count where that compiler reports none)."""
    return _read(measure.compile(jitted.lower(*flat)), jitted, flat)


def _read(compiled: Any, jitted: Any, flat: Sequence[Any]) -> Figures:
    platform = targets.platform_of(flat) or jax.default_backend()
    return measure.compiled_figures(compiled, jitted, flat, platform=platform)


def _why_unplanned(fn: Any, analysis: Analysis) -> str:
    """Why a step without a top-level backward pass gets no plan, for warnings and errors."""
    name = getattr(fn, "__name__", "fn")
    units = backward_in_units(analysis.program)
    if units:
        return (f"{name}'s jax.grad is inside a {'/'.join(units)} body, which the joint "
                "rewrite keeps whole (no backward pass at the top level to plan; to save "
                "memory there, wrap the loss inside the body in jaxmem.checkpoint)")
    return (f"{name} has no backward pass (no jax.grad inside, or no parameter reaches the "
            "loss)")


def _scans(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or any program nested in it) has a ``scan``."""
    return any(e.primitive.name == "scan" or any(_scans(s) for s in _jax.sub_jaxprs(e))
               for e in jaxpr.eqns)


def _rewrite_key(plan: Plan) -> Any:
    """What the rewrite of ``plan`` depends on (:func:`jaxmem.rewriting.rewrite.apply`):
    plans equal in it compile to one program."""
    return (plan.recompute, plan.offload, plan.region_depth, plan.keep,
            frozenset(c.residual.value for c in plan.choices))


def _shardings(flat: Sequence[Any]) -> tuple[str, ...]:
    """The arguments' shardings, for the plan cache: a jaxpr traced on an ``Auto`` mesh
    does not show them, yet per-device sizes (and so plans and figures) follow them."""
    return tuple(repr(getattr(x, "sharding", None)) for x in flat)


def _device_kind(flat: Sequence[Any]) -> str:
    device = _device_of(flat) or jax.devices()[0]
    return str(getattr(device, "device_kind", device.platform))


def _profile_of(flat: Sequence[Any]) -> str:
    """The device profile preset of the arguments' target (``"cpu"`` where unknown)."""
    try:
        return targets.of(flat).profile
    except Exception:  # noqa: BLE001 - a label for a note: never fail the step over it
        return "cpu"


def _device_of(flat: Sequence[Any]) -> Any:
    """The first device an argument is placed on (None: the default device)."""
    for x in flat:
        s = getattr(x, "sharding", None)
        if s is not None and getattr(s, "device_set", None):
            return next(iter(s.device_set))
    return None


def device_peak(program: Program, plan: Plan, compiled: Figures,
                platform: str | None = None) -> tuple[int, str | None]:
    """The device peak to check a budget against, and a note when it is an estimate.

    XLA's compiled peak, except for a plan that offloads compiled on CPU: XLA:CPU strips
    host placement, so its peak still counts the offloaded values on the device; the
    estimate subtracts what :func:`host_correction` says is in host memory at the peak.
    """
    if not plan.offload or (platform or jax.default_backend()) != "cpu":
        return compiled.peak, None
    try:
        corr = host_correction(program, plan, donated=compiled.alias > 0)
    except Exception as e:  # noqa: BLE001 - an estimate: fall back to the offloaded bytes
        corr = sum(c.residual.nbytes for c in plan.of(Decision.OFFLOAD))
        why = f"(rewritten program not analysable: {type(e).__name__}; used offloaded bytes)"
    else:
        why = "(host-resident bytes at the rewritten program's predicted peak)"
    est = max(compiled.peak - corr, 0)
    return est, (f"CPU compile strips host placement, so XLA's compiled peak "
                 f"{fmt_bytes(compiled.peak)} still counts the offloaded residuals on the "
                 f"device; the budget was checked against the predicted device peak "
                 f"{fmt_bytes(est)} = compiled - {fmt_bytes(corr)} {why}. On a GPU the "
                 f"compiled peak itself drops")


def host_correction(program: Program, plan: Plan, donated: bool = False) -> int:
    """Predicted device bytes the offloads free at the peak: the bytes placed in host memory
    that are live at the peak of the rewritten program's liveness. ``donated``: the step was
    compiled with its state donated (outputs alias the inputs of the same shape and dtype).

    An estimate for CPU, where XLA strips host placement: it assumes the compiled peak stays
    where the liveness model puts it. A GPU compile reports the real figure."""
    avals = [jax.ShapeDtypeStruct(v.shape, v.aval.dtype if v.aval is not None else v.dtype)
             for v in (program.values[i] for i in program.inputs)]
    p2 = from_jaxpr(jax.make_jaxpr(apply(program, plan))(*avals))
    donate: list[int] = []
    if donated:
        free: dict[tuple, list[int]] = {}
        for k, i in enumerate(p2.inputs):
            v = p2.values[i]
            free.setdefault((v.shape, str(v.dtype)), []).append(k)
        for o in p2.outputs:
            v = p2.values[o]
            if v.producer is not None and free.get((v.shape, str(v.dtype))):
                donate.append(free[(v.shape, str(v.dtype))].pop())
    # The host-resident bytes at the rewritten program's own peak (where XLA's compiled
    # peak is taken to be): what the device does not hold there.
    _, with_host, _ = liveness(p2, donated=donate)
    _, device, _ = liveness(p2, donated=donate, device_only=True)
    if not with_host:
        return 0
    i = int(np.argmax(with_host))
    return max(0, with_host[i] - device[i])


def pareto(step: Callable[..., Any], *args: Any,
           budgets: Sequence[Any] = (1.0, 0.7, 0.5, 0.35), offload: bool | str = False,
           **optimize_kwargs: Any) -> Pareto:
    """Optimise ``step`` at each budget and tabulate (budget, compiled peak, FLOPs overhead).

    Example:
      >>> sweep = jaxmem.pareto(step, state, batch, budgets=(0.7, 0.5, 0.35))  # doctest: +SKIP
      >>> print(sweep); sweep.plot()                                            # doctest: +SKIP
    """
    return sweep(lambda b: optimize(step, budget=b, offload=offload,
                                    **optimize_kwargs).plan(*args), budgets)


def optimize(fn: Callable[..., Any] | None = None, *, budget: Any = None,
             strategy: str = "auto", offload: bool | str = False,
             static_argnums: int | Sequence[int] | None = None,
             static_argnames: str | Sequence[str] | None = None,
             donate_argnums: int | Sequence[int] | str | None = "auto",
             max_recompute_fraction: float = 0.05, verify: bool | str = True,
             remat_scans: bool | Callable[..., Any] = True, offload_state: Any = False,
             **jit_kwargs: Any) -> Any:
    """Jit a train step so that it needs less accelerator memory, with the same results.

    jaxmem traces the step (which calls ``jax.grad``/``value_and_grad`` and an optimizer
    update inside), finds the forward values its backward pass reads, and re-creates the cheap
    ones (utility-layer outputs: activations, normalisation, dropout masks, adds, pooling)
    in the backward pass instead of keeping them, from the heavy outputs it keeps.

    Args:
      fn: the train step. ``optimize`` also works as a decorator, with or without arguments.
      budget: peak-memory budget (bytes, ``"6GiB"``, or a fraction of the plain-jit peak).
      strategy: ``"auto"`` (MEDL's rule, cost-aware) or ``"none"`` (plain jit: a baseline).
      offload: park residuals in pinned host memory (``True``/``"auto"``), see docs.
      static_argnums, static_argnames: arguments that are Python values, as in ``jax.jit``.
      donate_argnums: ``"auto"`` donates each argument whose arrays all reappear as outputs
        of the same shape and dtype (the train state): XLA then updates it in place. Pass
        ``()`` to donate nothing (keep using the old arrays) or explicit indices.
      max_recompute_fraction: cap on the recompute FLOPs of the ``"auto"`` plan, as a
        fraction of the step's FLOPs (cheapest bytes first).
      verify: compile the automatic mode's candidate plans (the rewrite's, per layer and
        per block: :func:`jaxmem.planning.strategies.auto_candidates`; and the step with its loss
        differentiated under ``jax.checkpoint(policy=dots_saveable)``, what a user can do
        without editing the model) and the plain step on the arguments' target, keep the
        smallest; keep the plain step (with a warning and a note in the plan) if no plan's
        compiled peak is lower. This guarantees ``optimize`` is never worse than
        ``jax.jit``, nor than that built-in policy on the whole loss, at one compile per
        candidate on the first call (a plan cache hit compiles only the step).
        ``"background"``: the first call compiles and runs MEDL's auto plan alone
        (unverified, as ``verify=False`` would), then the candidates and the plain step
        compile in a thread while later calls run; the lowest takes over at the first call
        after that (logged at INFO, noted in the plan) and goes to the plan cache, so a
        restart starts on it. ``.plan``/``.lower``/``.trace`` wait for it. The swap changes
        which program runs mid-training (same results up to float rounding), so it applies
        to single-process runs only (several processes verify before the first call, as with
        ``True``), and not with a ``budget``, offload, or a thread-local JAX context
        (``jax.default_matmul_precision(...)`` around the first call), which also verify first.
      remat_scans: run the bodies of ``lax.scan`` (``nn.scan``/``nnx.scan`` stacks) under
        ``jax.checkpoint(policy=jaxmem.policies.utility)`` while tracing, so layers inside a
        scan save only their heavy outputs too (the joint rewrite keeps a scan whole);
        without a budget a leaner body policy within the FLOP cap is compiled beside it and
        kept when lower (:func:`jaxmem.compiling.scan_budget.auto_choice`). With a ``budget``, the
        body's policy is planned too: per value in the layer (MaxText's tagged names, or
        each matmul) keep, recompute or offload, the fewest FLOPs that fit
        (:mod:`jaxmem.compiling.scan_budget`). A ``jax.checkpoint`` policy here is used as given.
      offload_state: keep the optimizer state (adam's moments) in ``pinned_host`` memory
        between steps and stream it through the update one layer at a time
        (:mod:`jaxmem.memory.state_offload`, docs/state_offload.md). ``True``/``"opt"``: the
        floating leaves only the update reads; or a predicate ``(path, leaf) -> bool``;
        ``"auto"``: only where a ``budget`` is not met otherwise (the planner weighs the
        state's transfer time against recompute and residual offload); ``"all"``: the
        optimizer state and the parameters, fetched again before each forward and backward
        use (:mod:`jaxmem.memory.param_offload`).
      **jit_kwargs: ``keep_unused`` / ``inline``, passed to ``jax.jit``.

    Returns:
      An :class:`Optimized`: callable like the step; ``.lower``, ``.trace`` like ``jax.jit``;
      ``.plan(*args)`` returns the :class:`~jaxmem.planning.plan.Plan` with compiled figures.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> def step(w, x):
      ...     loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
      ...     return w - 0.1 * g, loss
      >>> fast = jaxmem.optimize(step, donate_argnums=())
      >>> w, loss = fast(jnp.ones((8, 8)), jnp.ones((4, 8)))
    """
    kw = dict(budget=budget, strategy=strategy, offload=offload, static_argnums=static_argnums,
              static_argnames=static_argnames, donate_argnums=donate_argnums,
              max_recompute_fraction=max_recompute_fraction, verify=verify,
              remat_scans=remat_scans, offload_state=offload_state, **jit_kwargs)
    if fn is None:
        return lambda f: Optimized(f, **kw)
    if not callable(fn):
        raise TypeError(f"optimize expects a callable, got {type(fn).__name__}")
    return Optimized(fn, **kw)
