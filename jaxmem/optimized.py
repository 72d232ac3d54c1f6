"""``@jaxmem.optimize``: a drop-in ``jax.jit`` for train steps that needs less memory.

The last box of the data flow, and only its facade: :class:`Optimized` has ``jax.jit``'s
surface (call, ``.lower``, ``.trace``) and ``.plan``, and one cache entry per argument
signature (shapes, dtypes, shardings and static arguments, like ``jax.jit``'s cache:
:mod:`jaxmem.compiling.signature`). What a new signature costs is
:mod:`jaxmem.compiling`'s: trace the step, analyse it, plan, rewrite the joint jaxpr, jit
the result and compile it the jaxmem way (:func:`jaxmem.measure.compile`: barrier flag on
CPU), then check XLA's figures against the plain step (:mod:`jaxmem.compiling.build`). The
budget search (:mod:`jaxmem.planning.budget`) gets its compiles from there as callbacks;
:func:`pareto` runs ``optimize`` at each budget.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem.analyzing.analysis import Analysis
from jaxmem.compiling import background, heap, plan_cache
from jaxmem.compiling import signature as _signature
from jaxmem.compiling.build import build
from jaxmem.compiling.builtin_fallbacks import BUILTIN_POLICIES  # noqa: F401 - re-exported
from jaxmem.compiling.choose import LOSS_POLICY  # noqa: F401 - re-exported
from jaxmem.compiling.entry import Entry, placed
from jaxmem.compiling.multihost import check_same_plan
from jaxmem.compiling.offload_verify import device_peak, host_correction  # noqa: F401
from jaxmem.compiling.options import STRATEGIES, VERIFY, Options  # noqa: F401
from jaxmem.compiling.options import check as check_options
from jaxmem.compiling.steps import figures, read
from jaxmem.memory import state_offload
from jaxmem.planning.budget import Pareto
from jaxmem.planning.budget.pareto import sweep
from jaxmem.planning.plan import Plan
from jaxmem.tracing import arguments
from jaxmem.xla import measure, targets
from jaxmem.xla.measure import Figures

log = logging.getLogger("jaxmem")


class Lowered:
    """``jax.stages.Lowered`` whose ``compile()`` uses jaxmem's compiler options.

    On CPU that keeps optimisation barriers, so ``memory_analysis()`` reflects the plan.
    Everything else is delegated to the wrapped object, lowered when first asked for:
    ``compile()`` of a step whose plan was compiled already (the executable the first call
    runs) returns that executable without lowering the step again (issue 37: the zoo Llama
    at bench size spent 0.6 s of its first ``.lower().compile()`` on the H100 target
    lowering the step a second time).
    """

    def __init__(self, lower: Callable[[], Any], compiled: Any = None) -> None:
        self._lower = lower  # lowers the step: called once, when the lowering is asked for
        self._compiled = compiled  # the same program, already compiled the jaxmem way

    @functools.cached_property
    def _lowered(self) -> Any:
        return self._lower()

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Any:
        if self._compiled is not None and (not compiler_options or compiler_options ==
                measure.compiler_options(measure._platform_of(self._lowered))):  # noqa: SLF001
            return self._compiled
        return measure.compile(self._lowered, compiler_options)

    def __getattr__(self, name: str) -> Any:
        if name in ("_lower", "_compiled"):  # this object's own, not set yet
            raise AttributeError(name)
        # everything else, private attributes too (jaxmem reads the lowering's platform)
        return getattr(self._lowered, name)


class Optimized:
    """A train step wrapped by :func:`optimize`. Call it like the original function."""

    def __init__(self, fn: Callable[..., Any], *, budget: Any = None, strategy: str = "auto",
                 offload: bool | str = False, static_argnums: int | Sequence[int] | None = None,
                 static_argnames: str | Sequence[str] | None = None,
                 donate_argnums: int | Sequence[int] | str | None = "auto",
                 max_recompute_fraction: float = 0.05, verify: bool | str = True,
                 remat_scans: bool | Callable[..., Any] = True, offload_state: Any = False,
                 **jit_kwargs: Any) -> None:
        check_options(budget=budget, strategy=strategy, offload=offload,
                      donate_argnums=donate_argnums,
                      max_recompute_fraction=max_recompute_fraction, verify=verify,
                      offload_state=offload_state, jit_kwargs=jit_kwargs)
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
        self._cache: dict[Any, Entry] = {}
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
        background.adopt(entry)  # verify="background": the verified plan, once it is ready
        if entry.compiled is None:
            entry.compiled = measure.compile(entry.jitted.lower(*flat))
            background.verify_first_if_no_better(entry)
        entry.calls += 1
        try:
            outs = entry.compiled(*flat)
        except (TypeError, ValueError):
            # An executable is strict about committed devices and shardings (jit is not):
            # compile the same step for these arguments, the jaxmem way (never a plain jit
            # call: on CPU that would drop the barriers and with them the plan's recompute).
            outs = placed(entry, flat, getattr(self.fn, "__name__", "fn"))(*flat)
        background.start(entry)  # verify="background": after the first call's compile
        return arguments.combine(jax.tree_util.tree_unflatten(out_tree, outs), entry.static_out)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Like ``jax.jit(f).lower``; ``.compile()`` on the result applies jaxmem's options."""
        entry, flat, _ = self._prepare(args, kwargs)
        background.adopt(entry, wait=True)
        return Lowered(functools.partial(entry.jitted.lower, *flat), entry.compiled)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """Like ``jax.jit(f).trace``: a ``jax.stages.Traced`` of the rewritten step."""
        entry, flat, _ = self._prepare(args, kwargs)
        background.adopt(entry, wait=True)
        return entry.jitted.trace(*flat)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The :class:`~jaxmem.planning.plan.Plan` for these arguments, with compiled figures
        (the plan's and plain ``jax.jit``'s: the latter compiled here where the first call
        did not need it)."""
        entry, flat, _ = self._prepare(args, kwargs)
        background.adopt(entry, wait=True)
        if entry.plan.compiled is None:
            if entry.compiled is None:
                entry.compiled = measure.compile(entry.jitted.lower(*flat))
            baseline = self._baseline(entry, flat)
            entry.plan = entry.plan.with_figures(read(entry.compiled, entry.jitted, flat),
                                                 baseline)
        elif entry.plan.baseline is None:
            # verify=True checked the plan against the plain step's predicted peak and did
            # not compile it: the report compiles it now, off the first call's path
            entry.plan = entry.plan.with_figures(baseline=self._baseline(entry, flat))
        else:
            return entry.plan
        if entry.cache_key is not None:  # a later hit's report needs no compile
            plan_cache.store(entry.cache_key, entry.plan)
        return entry.plan

    def analysis(self, *args: Any, **kwargs: Any) -> Analysis:
        """The :class:`~jaxmem.analyzing.analysis.Analysis` the plan was made from."""
        return self._prepare(args, kwargs)[0].analysis

    # -- the per-signature cache ------------------------------------------------------------
    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Entry, list, Any]:
        """The cache entry for these arguments (built on a miss), the flat arguments to call
        its executable with (state kept in host memory placed there), the output tree."""
        sig = _signature.of(self.fn, self.static_argnums, self.static_argnames,
                            self.offload_state, args, kwargs)
        entry = self._cache.get(sig.key)
        if entry is None:
            with heap.frozen():  # the heap before the miss is not walked by gc while it builds
                entry = build(self, self._options(), self.fn, args, sig, self._warn_once)
            check_same_plan(entry.plan, getattr(self.fn, "__name__", "the step"))  # multihost
            self._cache[sig.key] = entry
        out_tree = entry.analysis.program.out_tree
        flat = sig.flat
        if entry.host_state:
            flat = state_offload.place(flat, entry.host_state)
        return entry, flat, out_tree

    def _options(self) -> Options:
        """This ``optimize``'s options, as the planning functions read them."""
        return Options(budget=self.budget, strategy=self.strategy, offload=self.offload,
                       donate_argnums=self.donate_argnums,
                       max_recompute_fraction=self.max_recompute_fraction, verify=self.verify,
                       remat_scans=self.remat_scans, offload_state=self.offload_state,
                       jit_kwargs=self.jit_kwargs)

    def _warn_once(self, message: str) -> None:
        """Warn (the first time only) that the step has no backward pass to plan."""
        if not self._warned_no_backward:
            warnings.warn(message, stacklevel=6)
            self._warned_no_backward = True

    def _baseline(self, entry: Entry, flat: list[Any]) -> Figures:
        """Plain ``jax.jit`` of the user's step, compiled the same way (same donation)."""
        return figures(entry.plain, [state_offload.device_view(x) for x in flat])


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
      donate_argnums: ``"auto"`` donates each argument whose leaves (arrays, or Python
        scalars such as a flax ``TrainState``'s ``step``) all reappear as outputs of the
        same shape and dtype (the train state): XLA then updates it in place, as with
        ``jax.jit(step, donate_argnums=0)``; the plan's notes say why any other argument is
        not donated. Every plain-``jax.jit`` figure the plan is checked against has the same
        donation. Pass ``()`` to donate nothing (keep using the old arrays) or indices.
      max_recompute_fraction: cap on the recompute FLOPs of the ``"auto"`` plan, as a
        fraction of the step's FLOPs (cheapest bytes first).
      verify: check the automatic mode's plan by compiling it on the arguments' target.
        ``True`` (the default): rank the candidate plans (the rewrite's, per layer and per
        block: :func:`jaxmem.planning.strategies.auto_candidates`) by the peak jaxmem's
        cost model predicts, compile the best predicted in full (with any the model ties
        with it, and the one whose rewritten step is predicted lowest), and run the first
        that compiles more than the model's error bound for the target (20%) below the
        plain step's *predicted* peak, or else below its *compiled* peak (the plain step
        then compiled too); the next best only when it does not (at most three plans).
        What runs has been compiled and checked against the plain step, and is the
        executable the first call runs (nothing is compiled again): one compile where the
        margin allows, where ``jax.jit`` makes one (:mod:`jaxmem.compiling.predicted`).
        If no plan passes, the plain step runs, with a warning and a note in the plan.
        ``"builtins"`` (the default until issue 37; about six compiles): compile the three
        best-predicted plans, the plain step, and the step with its loss differentiated
        under ``jax.checkpoint(policy=dots_saveable)`` whole and per block (what a user
        can do without editing the model), and keep the lowest: never above ``jax.jit``
        nor those built-ins on the step's compiler. ``"all"``: the same with every
        candidate plan compiled. ``"predicted"``: ``True``'s earlier name.
        ``"background"``: the first call compiles and runs MEDL's auto plan alone
        (unverified, as ``verify=False`` would, where it compiles below the plain step's
        predicted peak by the model's error bound; else it waits for the verification),
        then the candidates and the plain step
        compile in a thread while later calls run; the lowest takes over at the first call
        after that (logged at INFO, noted in the plan) and goes to the plan cache, so a
        restart starts on it (it verifies as ``"builtins"`` does: the compiles are off the
        first call's path). ``.plan``/``.lower``/``.trace`` wait for it. The swap changes
        which program runs mid-training (same results up to float rounding), so it applies
        to single-process runs only (several processes verify before the first call, as with
        ``"builtins"``), and not with a ``budget``, offload, or a thread-local JAX context
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
