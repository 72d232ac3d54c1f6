"""The differential check: ``jaxmem.optimize`` (and jaxmem's block plans) against ``jax.jit``.

For one generated program (a :class:`~.generator.Case`, or a *pack* of cases run side by
side in one step so that one compile serves several cases) and one strategy, :func:`check`
returns a list of :class:`Finding`\\ s; empty means the promises held:

- same output pytree structure, shapes and dtypes as ``jax.jit`` of the step;
- integer and bool outputs equal; float outputs (loss, gradients, new parameters, optimizer
  and BatchNorm state) equal within :func:`tolerance` of the leaf's scale, or else shown
  by the op-by-op oracle (:mod:`.oracle`) to be the same program: a leaf outside the
  tolerance counts as a mismatch only if the rewritten program and the user's, evaluated
  one primitive at a time, differ on it too (a gradient that is zero in exact arithmetic
  is rounding noise, and the two compiled programs round it differently). Programs with a
  bf16/f16 section, whose tolerance is loose, are put to the oracle on every leaf;
- the compiled peak of what runs (compiled the jaxmem way: barrier flag on CPU) is at most
  plain ``jax.jit``'s, unless the plan carries a note saying why (verify's fallback);
- budgets are guarantees: ``optimize(step, budget=B)`` either raises ``BudgetError`` or
  compiles to a peak of at most ``B`` (on CPU, plans that offload are checked against the
  plan's own device-peak estimate, since XLA:CPU strips host placement).

With ``target`` (a :mod:`jaxmem.targets` name such as ``"h100"``) the step is compiled for
that target instead, from abstract arguments placed on it: nothing runs, so only the
memory promises are checked there (budgets met or ``BudgetError``; peaks never above
plain), on the compiler the plan was made for.

Strategies: ``auto``, ``auto_donate`` (state donated), ``budget`` (int bytes, a fraction
of plain's peak), ``budget_frac`` (a float fraction), ``offload`` (``offload=True``) and
``blocks`` (``jaxmem.planning.strategies.plan_blocks`` at each depth, rewritten and jitted).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem import measure
from tests.difftest import oracle
from tests.difftest.generator import Case, init, make_step

STRATEGIES = ("auto", "budget", "offload", "blocks", "auto_donate", "budget_frac")
#: What a compile-only target checks (nothing runs there, so no values; no jaxmem-side
#: block rewrite either, which has no peak promise).
TARGET_STRATEGIES = ("auto", "budget", "offload", "auto_donate", "budget_frac")

#: relative tolerance of float outputs, per dtype of the worst path in the program: f32
#: programs differ by XLA's fusion choices (re-associated reductions, FMA contraction) only;
#: a program with a bf16/f16 section can round a 1-ulp f32 difference to a bf16 ulp.
RTOL_F32 = 2e-5
RTOL_LOW = 3e-2


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str      # "mismatch" | "structure" | "peak" | "budget" | "error"
    strategy: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.strategy}: {self.detail}"


def pack(cases: Sequence[Case]) -> tuple[Callable[..., Any], Any, Any]:
    """One step running every case's step side by side: ``(step, states, batches)``."""
    steps = [make_step(c) for c in cases]
    inits = [init(c) for c in cases]

    def step(states: Any, batches: Any) -> Any:
        outs = [s(st, b) for s, st, b in zip(steps, states, batches, strict=True)]
        return tuple(o[0] for o in outs), tuple(o[1] for o in outs)

    step.__name__ = "pack_" + "_".join(str(c.seed) for c in cases[:4])
    return step, tuple(i[0] for i in inits), tuple(i[1] for i in inits)


def tolerance(cases: Sequence[Case]) -> float:
    low = any(op.family == "low_precision" for c in cases for op in c.ops)
    return RTOL_LOW if low else RTOL_F32


def _copy(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


#: What :func:`compare` has seen in this process: float leaves compared, how many were bit for
#: bit equal, the largest difference relative to the leaf's scale (f32-only programs and
#: programs with a bf16/f16 section apart).
OBSERVED = {"float_leaves": 0, "bitwise_equal": 0, "max_rel_f32": 0.0, "max_rel_low": 0.0,
            "budget_met": 0, "budget_error": 0, "rounding_only": 0}
#: Compiled differences outside the tolerance that the op-by-op oracle showed to be XLA's
#: rounding (the two programs bitwise equal evaluated one primitive at a time), as
#: ``{"leaf", "detail", "jit_vs_op_by_op"}``: the last is how far plain ``jax.jit``'s own
#: compiled value is from the op-by-op value of the user's program, the leaf's rounding level.
ROUNDING: list[dict[str, Any]] = []


def compare(ref: Any, got: Any, rtol: float) -> list[str]:
    """Differences between two output pytrees: structure, dtype, shape, values."""
    return [msg for _, msg in compare_leaves(ref, got, rtol)]


def compare_leaves(ref: Any, got: Any, rtol: float) -> list[tuple[int | None, str]]:
    """:func:`compare`, each difference with the index of its output leaf: ``None`` for a
    structure, dtype or shape difference (a mismatch whatever the values), an index for
    a value difference (one :func:`check` asks the op-by-op oracle about)."""
    rs, gs = jax.tree_util.tree_structure(ref), jax.tree_util.tree_structure(got)
    if rs != gs:
        return [(None, f"structure {gs} != jax.jit's {rs}")]
    out: list[tuple[int | None, str]] = []
    leaves = jax.tree_util.tree_flatten_with_path(ref)[0]
    for k, ((path, r), g) in enumerate(zip(leaves, jax.tree_util.tree_leaves(got),
                                            strict=True)):
        name = jax.tree_util.keystr(path)
        r, g = np.asarray(r), np.asarray(g)
        if r.dtype != g.dtype or r.shape != g.shape:
            out.append((None, f"{name}: {g.dtype}{list(g.shape)} != jax.jit's "
                              f"{r.dtype}{list(r.shape)}"))
            continue
        if r.dtype.kind in "biu" or r.dtype == np.dtype(jax.dtypes.float0):
            if not np.array_equal(r, g):
                out.append((k, f"{name}: integer/bool values differ ({np.sum(r != g)} "
                               "elements)"))
            continue
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        if not np.array_equal(np.isnan(r64), np.isnan(g64)):
            out.append((k, f"{name}: NaNs differ"))
            continue
        scale = float(np.nanmax(np.abs(r64))) if r64.size else 0.0
        err = float(np.nanmax(np.abs(r64 - g64))) if r64.size else 0.0
        OBSERVED["float_leaves"] += 1
        OBSERVED["bitwise_equal"] += int(np.array_equal(r, g, equal_nan=True))
        key = "max_rel_f32" if rtol <= RTOL_F32 else "max_rel_low"
        OBSERVED[key] = max(OBSERVED[key], err / max(scale, 1e-6))
        if err > rtol * max(scale, 1e-6):
            out.append((k, f"{name}: max |diff| {err:.3g} > {rtol:g} x scale {scale:.3g}"))
    return out


def plain_peak(step: Callable[..., Any], args: tuple[Any, ...], donate: tuple[int, ...] = ()
               ) -> tuple[Any, int]:
    """Plain ``jax.jit`` of ``step`` compiled the jaxmem way: ``(executable, peak)``."""
    exe = measure.compile(jax.jit(step, donate_argnums=donate).lower(*args))
    return exe, measure.figures(exe).peak


def _optimized_peak(opt: Any, args: tuple[Any, ...]) -> tuple[int, Any]:
    plan = opt.plan(*args)
    return measure.figures(opt.lower(*args).compile()).peak, plan


def check(step: Callable[..., Any], args: tuple[Any, ...], strategy: str, *,
          rtol: float = RTOL_F32, fraction: float = 0.6, of_headroom: bool = True,
          max_compiles: int = 6,
          reference: tuple[Any, int] | None = None, target: Any = None) -> list[Finding]:
    """Check one step under one strategy (see the module doc). ``reference``: the plain
    executable and peak from :func:`plain_peak`, to share one compile between strategies.
    Budgets are ``fraction`` of the headroom above arguments + outputs, or of the whole
    plain peak (``of_headroom=False``). ``target``: compile for this
    :mod:`jaxmem.targets` target (``args`` are placed on it; memory promises only)."""
    donate = (0,) if strategy == "auto_donate" else ()
    if target is not None:
        if strategy not in TARGET_STRATEGIES:
            raise ValueError(f"strategy {strategy!r} runs the step; on a compile-only target "
                             f"use one of {TARGET_STRATEGIES}")
        args = jaxmem.targets.get(target).place(args)
    if reference is None or donate:
        reference = plain_peak(step, args, donate)
    exe, base = reference
    want = exe(*_copy(args)) if target is None else None
    found: list[Finding] = []

    def outputs(fn: Callable[..., Any], rewritten: Callable[[], Any]) -> None:
        """Compare ``fn``'s outputs with jit's; ``rewritten()`` gives the closed jaxpr
        ``fn`` compiled, for the oracle to judge value differences by."""
        if target is not None:
            return  # nothing runs on a compile-only target
        got = fn(*_copy(args))
        diffs = compare_leaves(want, got, rtol)
        found.extend(Finding("mismatch", strategy, d) for k, d in diffs if k is None)
        values = [(k, d) for k, d in diffs if k is not None]
        if values or rtol > RTOL_F32:  # bf16/f16: the loose tolerance alone is not enough
            found.extend(_judge(step, args, rewritten(), want, values, strategy))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if strategy == "blocks":
                _check_blocks(step, args, outputs)
                return found
            if strategy in ("budget", "budget_frac"):
                # ``fraction`` of the headroom above the arguments' and outputs' own bytes,
                # which no plan can go below (a fraction of the whole peak is mostly out of
                # reach for tiny steps, and every check would end in BudgetError)
                fig = measure.figures(exe)
                floor = fig.argument + fig.output - fig.alias if of_headroom else 0
                limit = int(floor + fraction * (base - floor))
                budget = limit / base if strategy == "budget_frac" else limit
                if strategy == "budget_frac":
                    limit = int(budget * base)
                opt = jaxmem.optimize(step, budget=jaxmem.Budget(budget, max_compiles=max_compiles),
                                      donate_argnums=())
                try:
                    peak, plan = _optimized_peak(opt, args)
                except jaxmem.BudgetError as e:
                    OBSERVED["budget_error"] += 1
                    if e.minimum_bytes is not None and e.minimum_bytes <= limit:
                        found.append(Finding("budget", strategy,
                                             f"BudgetError for {limit} B, but its minimum "
                                             f"found is {e.minimum_bytes} B"))
                    return found
                OBSERVED["budget_met"] += 1
                if plan.offload and target is None and jax.default_backend() == "cpu":
                    peak = min(peak, _estimate(plan, peak))
                if peak > limit:
                    found.append(Finding("budget", strategy,
                                         f"budget {limit} B (plain {base} B) but "
                                         f"compiled peak {peak} B; plan {plan.strategy}"))
                outputs(opt, lambda: opt.trace(*args).jaxpr)
                return found
            kw = {"offload": True} if strategy == "offload" else {}
            opt = jaxmem.optimize(step, donate_argnums=donate or (), **kw)
            peak, plan = _optimized_peak(opt, args)
            outputs(opt, lambda: opt.trace(*args).jaxpr)
            if plan.offload and target is None:
                from jaxmem.optimized import device_peak
                peak = device_peak(opt.analysis(*args).program, plan,
                                   measure.figures(opt.lower(*args).compile()))[0]
            if peak > base and not _explained(plan):
                found.append(Finding("peak", strategy,
                                     f"compiled peak {peak} B above plain jit's {base} B; "
                                     f"plan {plan.strategy!r}, notes {plan.notes}"))
    except Exception as e:  # noqa: BLE001 - every exception is a finding
        found.append(Finding("error", strategy, f"{type(e).__name__}: {e}"[:600]))
    return found


def _judge(step: Callable[..., Any], args: tuple[Any, ...], rewritten: Any, want: Any,
           values: list[tuple[int, str]], strategy: str) -> list[Finding]:
    """Value differences of the compiled steps, judged by the op-by-op oracle: a leaf on
    which the rewritten program and the user's, evaluated one primitive at a time, are
    bitwise equal differs by XLA's rounding only (kept in :data:`ROUNDING`); any leaf on
    which they differ is a mismatch, flagged by the compiled comparison or not."""
    flat = jax.tree_util.tree_leaves(args)
    original = jax.make_jaxpr(step)(*args)
    ref = oracle.evaluate(original, *flat)
    got = oracle.evaluate(rewritten, *flat)
    if len(ref) != len(got):
        return [Finding("mismatch", strategy, f"op by op: {len(got)} outputs, the original "
                                              f"program has {len(ref)}")]
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    compiled = jax.tree_util.tree_leaves(want)
    differ = {k for k, (r, g) in enumerate(zip(ref, got, strict=True))
              if not oracle.bitwise(np.asarray(r), np.asarray(g))}
    out = [Finding("mismatch", strategy, f"{d} (op by op too)") for k, d in values
           if k in differ]
    out += [Finding("mismatch", strategy, f"{names[k]}: op by op not bitwise equal to the "
                                          "original program") for k in sorted(differ)
            if k not in {k for k, _ in values}]
    for k, d in values:
        if k not in differ:
            OBSERVED["rounding_only"] += 1
            noise = np.abs(np.asarray(compiled[k], np.float64) - np.asarray(ref[k], np.float64))
            ROUNDING.append({"leaf": names[k], "strategy": strategy, "detail": d,
                             "jit_vs_op_by_op": float(np.nanmax(noise)) if noise.size else 0.0})
    return out


def _estimate(plan: Any, peak: int) -> int:
    """The device-peak estimate a CPU budget plan that offloads was checked against."""
    for note in plan.notes:
        if "predicted device peak" in note:
            return peak  # the note is there; the search already compared its estimate
    return peak


def _explained(plan: Any) -> bool:
    """A plan may compile above plain only if a note says why (none does today: verify
    keeps the plain step instead)."""
    return any("above the plain" in n for n in plan.notes)


def _check_blocks(step: Callable[..., Any], args: tuple[Any, ...],
                  outputs: Callable[..., None]) -> None:
    """Every block depth's plan, rewritten by jaxmem and jitted, against jax.jit."""
    from jaxmem.analyzing.analysis import from_program
    from jaxmem.planning.strategies import block_depths, plan_blocks
    from jaxmem.rewriting.rewrite import apply

    program = jaxmem.trace(step, *args)
    if not program.has_backward:
        return
    analysis = from_program(program)
    flat, _ = jax.tree_util.tree_flatten((args, {}))
    out_tree = program.out_tree
    for depth in block_depths(program)[:2]:
        rewritten = apply(program, plan_blocks(analysis, depth))
        exe = measure.compile(jax.jit(rewritten).lower(*flat))

        def run(*a: Any, exe: Any = exe) -> Any:
            return jax.tree_util.tree_unflatten(out_tree, exe(*jax.tree_util.tree_leaves(a)))
        outputs(run, lambda rewritten=rewritten: jax.make_jaxpr(rewritten)(*flat))
