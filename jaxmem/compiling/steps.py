"""The jitted programs one signature of a step is compiled as, and their figures.

Part of the fifth box (:mod:`jaxmem.compiling`). For one signature (:mod:`.signature`) the
step is one :class:`Step`: its traced program, the arguments it is compiled for, its
donation (:mod:`.donation`) and the plain ``jax.jit`` of the user's own step on flat inputs
with that donation: the baseline every plan is checked against. From it come the other
programs a plan can run as: the joint-jaxpr rewrite of a plan (:meth:`Step.rewrite`), and
the user's step with its loss under a built-in ``jax.checkpoint`` policy
(:meth:`Step.loss`). :func:`read` gives a compiled one's figures for the arguments' target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem import _jax
from jaxmem.compiling.signature import device_of
from jaxmem.memory import state_offload
from jaxmem.planning.plan import Plan
from jaxmem.rewriting import blockwise, symbolic
from jaxmem.rewriting.rewrite import apply
from jaxmem.tracing.program import Program, from_jaxpr
from jaxmem.xla import measure, targets
from jaxmem.xla.measure import Figures


@dataclasses.dataclass(frozen=True)
class Step:
    """One signature of the step: what every candidate is compiled from and for."""

    program: Program  # the traced (labelled) program the plans rewrite
    fn: Callable[..., Any]  # the user's step on the traced arguments (signature.bind)
    args: Any  # (dyn_args, kwargs): the traced arguments (or their abstract stand-ins)
    flat: list[Any]  # their leaves: what each candidate is lowered with
    in_tree: Any  # the structure of the traced arguments (that the plain jit unflattens)
    platform: str  # the arguments' platform (the default backend where they name none)
    donated: tuple[int, ...]  # dynamic positional arguments donated
    donate_flat: tuple[int, ...]  # the same, as flat argument positions
    jit_kwargs: dict[str, Any]
    plain: Any  # jax.jit of the user's own step on flat inputs (same donation): the baseline

    def rewrite(self, plan: Plan) -> Any:
        """``jax.jit`` of the joint-jaxpr rewrite of ``plan``, with the step's donation."""
        return jax.jit(apply(self.program, plan, **self._rewrite_options()),
                       donate_argnums=self.donate_flat,
                       **self.jit_kwargs)

    def rewritten(self, plan: Plan, limit: int | None = None) -> Program:
        """The program of :meth:`rewrite`'s trace, for the analysis: built without tracing
        (:func:`jaxmem.rewriting.symbolic.rewritten_program`, the same nodes), or traced
        where the plan offloads. Raises what the trace raises, and
        :class:`~jaxmem.rewriting.symbolic.TooLarge` where the build passes ``limit``
        nodes."""
        try:
            return symbolic.rewritten_program(self.program, plan, limit,
                                              **self._rewrite_options())
        except symbolic.Unsupported:
            return from_jaxpr(self.rewrite(plan).trace(*self.flat).jaxpr)

    def _rewrite_options(self) -> dict[str, bool]:
        # host copies are tied into the forward pass, and finished gradients into the next
        # backward run, only for the accelerators' schedulers (XLA:CPU strips host placement
        # and keeps the program's order: there the ties would only add barriers)
        accelerator = self.platform != "cpu"
        return {"settle_host": accelerator, "fence_gradients": accelerator}

    def loss(self, policy: str, per_block: bool = False) -> tuple[Any, list[str]]:
        """``jax.jit`` of the user's step on flat inputs with every loss it differentiates
        under ``jax.checkpoint(policy=jax.checkpoint_policies.<policy>)``
        (:func:`jaxmem._jax.checkpointed_losses`, applied inside the traced function, so every
        trace of it is the checkpointed one), and the names of the losses wrapped by its
        last trace (empty: the step differentiates nothing through ``jax.grad`` /
        ``jax.value_and_grad``, and runs as the plain step). ``per_block``: each block of
        the loss under its own ``jax.checkpoint`` (:mod:`jaxmem.rewriting.blockwise`); a loss
        whose name stack gives no blocks is not wrapped then."""
        checkpoint_policy = getattr(jax.checkpoint_policies, policy)
        wrapped: list[str] = []
        fn = self.fn

        def checkpointed(*a: Any, **k: Any) -> Any:
            with _jax.checkpointed_losses(
                    checkpoint_policy,
                    blockwise.checkpoint_blocks if per_block else None) as names:
                out = fn(*a, **k)
            wrapped[:] = names
            return out
        return plain_jit(checkpointed, self.in_tree, self.donate_flat, self.jit_kwargs), wrapped

    def streamed(self, jitted: Any, mode: Any, window: int) -> tuple[Any, Any]:
        """``jitted`` (one of this step's programs) with the optimizer state streamed from
        host memory: ``mode`` is ``offload_state``, ``window`` the groups in flight.
        :func:`jaxmem.memory.state_offload.wrap`'s ``(jitted, StateOffload or None)``."""
        return state_offload.wrap(jitted, self.program, self.args, self.flat,
                                  self.donate_flat, mode, device_of(self.flat),
                                  self.jit_kwargs, window=window)

    def running(self, plan: Plan, body: Any = None) -> Any:
        """The jitted step that runs ``plan``: the plain step, the step with its loss under
        the built-in policy, or the rewrite. ``body``: a budget's scan-body choice (the
        step is then traced under it, even with nothing dropped outside the scan)."""
        if plan.strategy == "none" and body is None:
            return self.plain
        if plan.loss_policy:
            return self.loss(plan.loss_policy, plan.loss_blocks)[0]
        return self.rewrite(plan)


def make(program: Program, fn: Callable[..., Any], args: Any, donated: tuple[int, ...],
         donate_flat: tuple[int, ...], jit_kwargs: dict[str, Any]) -> Step:
    """The :class:`Step` of ``fn`` on ``args`` (its plain jit built here)."""
    flat, in_tree = jax.tree_util.tree_flatten(args)
    platform = targets.platform_of(flat) or jax.default_backend()
    return Step(program=program, fn=fn, args=args, flat=flat, in_tree=in_tree,
                platform=platform, donated=donated, donate_flat=donate_flat,
                jit_kwargs=jit_kwargs, plain=plain_jit(fn, in_tree, donate_flat, jit_kwargs))


def plain_for(fn: Callable[..., Any], dyn_args: tuple[Any, ...], kwargs: dict[str, Any],
              donate_argnums: Any, program: Program, jit_kwargs: dict[str, Any]
              ) -> tuple[Any, tuple[int, ...]]:
    """The plain step of ``fn(*dyn_args, **kwargs)`` (:func:`plain_jit`) donated as the
    step is (``donate_argnums`` decided on its traced ``program``), and the flat positions
    it donates."""
    from jaxmem.compiling.donation import decide
    from jaxmem.tracing.program import flat_donated

    donate = flat_donated(dyn_args, decide(donate_argnums, dyn_args, program).argnums)
    in_tree = jax.tree_util.tree_structure((dyn_args, kwargs))
    return plain_jit(fn, in_tree, donate, jit_kwargs), donate


def plain_jit(fn: Callable[..., Any], in_tree: Any, donate_flat: tuple[int, ...],
              jit_kwargs: dict[str, Any]) -> Any:
    """``jax.jit`` of ``fn`` on the flat leaves of arguments of structure ``in_tree``."""
    def flat_fn(*leaves: Any) -> Any:
        a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
        return jax.tree_util.tree_leaves(fn(*a, **k))
    return jax.jit(flat_fn, donate_argnums=donate_flat, **jit_kwargs)


def figures(jitted: Any, flat: Sequence[Any]) -> Figures:
    """Compiled figures of ``jitted`` on the flat arguments, compiled the jaxmem way, for
    the arguments' target (jaxmem's FLOP count where that compiler reports none)."""
    return read(measure.compile(jitted.lower(*flat)), jitted, flat)


def read(compiled: Any, jitted: Any, flat: Sequence[Any]) -> Figures:
    """The figures of ``compiled`` (``jitted`` compiled on ``flat``) for their target."""
    platform = targets.platform_of(flat) or jax.default_backend()
    return measure.compiled_figures(compiled, jitted, flat, platform=platform)


def rewrite_key(plan: Plan) -> Any:
    """What the rewrite of ``plan`` depends on (:func:`jaxmem.rewriting.rewrite.apply`):
    plans equal in it compile to one program."""
    return (plan.recompute, plan.offload, plan.region_depth, plan.keep,
            frozenset(c.residual.value for c in plan.choices), plan.unfenced)


#: The most equations a plan's rewrite may have, as a multiple of the step's, to be
#: compiled: XLA's compile time and host memory grow with the program. BERT-base's
#: lowest-memory greedy plan at its bench size (seeded with the automatic plan, as the
#: budget search seeds it) replays chains region by region into 148,318 equations, 18.1x
#: the step's 8,217, and XLA:GPU's compile of it passed 21 GB of host memory on a 24 GB
#: machine (unseeded: 30,469 equations and 400 barriers, 3.7x); its block plans, the
#: search's next stage, are 1.3x. MEDL's automatic plan of the lm1b-width GPT-2 decoder
#: (``corpus:tx_gpt2_ts`` at size ``lm1b``, H100 target) is 3.3x (12,902 equations): 199 s
#: to compile, 16x the plain step, to a peak 26% above it. The budget search's plans
#: (greedy, exact, MEDL's) and ``verify``'s candidates (but ``verify="all"``'s) over the
#: limit are not compiled; the plan's notes say so. None of the 174 candidate plans of
#: the 27 zoo and corpus steps of ``benchmarks/results/prediction*/plans-*.json`` is over
#: it (the largest 1.94x).
MAX_REWRITE_GROWTH = 3.0


def equations(jaxpr: Any) -> int:
    """Equations of ``jaxpr``, those of its sub-jaxprs (loop and remat bodies) included."""
    return sum(1 + sum(map(equations, _jax.sub_jaxprs(eqn))) for eqn in jaxpr.eqns)


def program_equations(program: Program) -> int:
    """The equations of ``program``'s nodes, those of their sub-jaxprs (loop and remat
    bodies) included: :func:`equations` of its trace, with nested ``jit`` calls
    inlined."""
    return sum(1 + sum(map(equations, _jax.sub_jaxprs(n.eqn))) for n in program.nodes)


def too_large(jaxpr: Any, step_equations: int) -> str | None:
    """Why ``jaxpr`` (a rewrite of a step of ``step_equations`` equations) is not compiled:
    it has more than :data:`MAX_REWRITE_GROWTH` times as many equations; None when it is
    not over."""
    return too_many(equations(jaxpr), step_equations)


def too_many(n: int, step_equations: int, more: bool = False) -> str | None:
    """:func:`too_large` of a rewrite of ``n`` equations (``more``: of more than ``n``,
    its build stopped there: :func:`growth_limit`)."""
    if n <= MAX_REWRITE_GROWTH * max(step_equations, 1) and not more:
        return None
    return (f"its rewrite has {'more than ' * more}{n:,} equations, "
            f"{'over ' * more}{n / max(step_equations, 1):.1f}x the step's "
            f"{step_equations:,} (over MAX_REWRITE_GROWTH={MAX_REWRITE_GROWTH:g}: XLA's "
            "compile time and host memory grow with the program)")


def growth_limit(step_equations: int) -> int:
    """The most nodes a rewrite of a step of ``step_equations`` is built to before it is
    known to be too large (:data:`MAX_REWRITE_GROWTH`: nodes are at most its equations)."""
    return int(MAX_REWRITE_GROWTH * max(step_equations, 1))


def within_growth(build: Callable[[int], Program], step_equations: int
                  ) -> tuple[Program | None, str | None]:
    """``build(limit)``, a rewrite built up to :func:`growth_limit` nodes of a step of
    ``step_equations``: ``(program, None)``, or ``(None, why it is too large)`` where the
    build passed the limit (:class:`~jaxmem.rewriting.symbolic.TooLarge`; not built
    further). Whether a built program is over :data:`MAX_REWRITE_GROWTH` is
    :func:`too_many` of its equations."""
    try:
        return build(growth_limit(step_equations)), None
    except symbolic.TooLarge as e:
        return None, too_many(e.limit, step_equations, more=True)
