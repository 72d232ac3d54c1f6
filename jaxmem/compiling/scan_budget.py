"""The budget search over scan-body policies: the cheapest one that fits, compile-checked.

Third box of the data flow under a budget, for a step whose layers are one ``lax.scan``
(:mod:`jaxmem.rewriting.scans`). Each candidate :class:`~jaxmem.rewriting.scans.BodyPolicy`
is traced (cheap) to get its exact FLOPs (jaxmem's count, loops times their trip count,
recompute included) and the bytes it keeps for the backward pass; candidates are then
compiled in order of FLOPs by bisection along the candidates no other beats on both FLOPs
and kept bytes (their compiled peaks fall as their FLOPs rise): the one found has the fewest
recompute FLOPs among the candidates that fit.

:func:`choose` is the search over plain callables; :func:`choose_for` wires it to
:class:`jaxmem.optimized.Optimized` (each candidate compiled as the whole step: the body
policy inside the scan, nothing dropped outside it; if no candidate fits so, the step's
budget search plans the outside too, from the lowest-peak body policy).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jaxmem.analyzing.analysis import from_program
from jaxmem.analyzing.costmodel import DeviceProfile
from jaxmem.compiling.signature import profile_of
from jaxmem.compiling.steps import figures, read
from jaxmem.planning.budget.units import resolve_budget
from jaxmem.rewriting.scans import BodyPolicy, BodyValue, body_values, candidates
from jaxmem.tracing.program import Program
from jaxmem.xla import measure, targets
from jaxmem.xla.measure import Figures, fmt_bytes

__all__ = ["BodyCandidate", "BodyChoice", "Kept", "auto_choice", "choose", "choose_for",
           "estimate", "program_key"]


class Kept(NamedTuple):
    """An executable :func:`choose_for` compiled, kept for the step that runs: reused only
    where that step lowers to the same program (:meth:`same`)."""

    executable: Any
    key: str  # :func:`program_key` of its lowering
    figures: Figures

    def same(self, jitted: Any, flat: Sequence[Any]) -> bool:
        """Whether ``jitted`` on ``flat`` lowers to the program this executable is of."""
        return program_key(jitted.lower(*flat)) == self.key


def program_key(lowered: Any) -> str:
    """A key of a lowered program: its text (shardings and donation are in it). Two
    lowerings with one key, on the same arguments, compile to the same executable."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()

@dataclasses.dataclass(frozen=True)
class BodyCandidate:
    """One body policy, traced (and maybe compiled).

    Attributes:
      policy: the :class:`~jaxmem.rewriting.scans.BodyPolicy`.
      flops: jaxmem's FLOP count of the whole step with it (recompute included).
      kept_bytes: bytes of the device-resident values the backward pass reads.
      compiled: XLA's figures of the whole step with it, when compiled.
      host_bytes: bytes of the values it parks in host memory (each crosses the host link
        twice per step).
    """

    policy: BodyPolicy
    flops: float
    kept_bytes: int
    compiled: Figures | None = None
    host_bytes: int = 0

    def times(self, profile: Any) -> tuple[float, float]:
        """``(compute, round trip)`` on ``profile`` (a preset name or a profile): the step's
        FLOPs at its rate, and its host bytes there and back over the host link."""
        prof = DeviceProfile.get(profile)
        return self.flops / prof.flops_per_s, 2 * prof.transfer_time(self.host_bytes)

    def seconds(self, profile: Any) -> float:
        """Predicted step time on ``profile``: the compute or the round trip, whichever is
        longer (the copies overlap the compute at best; what they cannot hide adds to it)."""
        return max(self.times(profile))

    def row(self, budget: int | None = None) -> str:
        peak = "-" if self.compiled is None else fmt_bytes(self.compiled.peak)
        fit = ("" if budget is None or self.compiled is None
               else (" fits" if self.compiled.peak <= budget else " over"))
        return (f"{self.policy.name}: {self.flops / 1e9:.4f} GFLOP, kept "
                f"{fmt_bytes(self.kept_bytes)}, peak {peak}{fit}")


@dataclasses.dataclass(frozen=True)
class BodyChoice:
    """What :func:`choose` picked, and every candidate it looked at."""

    chosen: BodyCandidate
    candidates: tuple[BodyCandidate, ...]
    budget: int
    fits: bool
    profile: str | None = None
    # The chosen candidate's executable where it fits (the step that runs it need not be
    # compiled again), and the plain step's (the baseline; where nothing fits, the budget
    # search's plain step): issue 37's "the compile that checks is the compile that runs".
    executable: Kept | None = dataclasses.field(default=None, repr=False, compare=False)
    plain: Kept | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def policy(self) -> BodyPolicy:
        return self.chosen.policy

    @property
    def notes(self) -> tuple[str, ...]:
        n = sum(c.compiled is not None for c in self.candidates)
        least = ("fewest FLOPs" if self.profile is None
                 else f"least predicted time ({DeviceProfile.get(self.profile).name})")
        head = (f"scan bodies: policy {self.policy.name!r} ("
                + (f"{least} that fits" if self.fits else "lowest peak found; over budget")
                + f", {len(self.candidates)} candidates traced, {n} compiled)")
        save = ", ".join(_label(k) for k in self.policy.save) or "-"
        off = ", ".join(_label(k) for k in self.policy.offload) or "-"
        notes = (head, f"scan bodies keep: {save}; offload: {off}; base {self.policy.base}")
        return notes if self.profile is None else (*notes, self.cost(self.profile))

    def cost(self, profile: Any) -> str:
        """The chosen body policy's predicted cost on ``profile`` (a preset name or a
        :class:`~jaxmem.DeviceProfile`): its FLOPs above the candidate with the fewest
        (recompute), its host-link round trip, and whether the step's compute (its
        FLOPs at the profile's rate, a roofline bound) covers that round trip."""
        from jaxmem.planning.costs import fmt_seconds

        prof = DeviceProfile.get(profile)
        least = min(c.flops for c in self.candidates)
        extra = max(self.chosen.flops - least, 0.0)
        compute, link = self.chosen.times(prof)
        line = (f"scan bodies' predicted cost ({prof.name}): recompute "
                f"{extra / 1e9:.1f} GFLOP, {fmt_seconds(extra / prof.flops_per_s)} per step "
                f"(the step's compute {fmt_seconds(compute)})")
        if self.chosen.host_bytes:
            line += (f"; host link {fmt_bytes(self.chosen.host_bytes)} each way, round trip "
                     f"{fmt_seconds(link)}, "
                     + ("below the step's compute" if link <= compute
                        else "more than the step's compute: the transfers cannot all hide"))
        return line


def _label(key: Any) -> str:
    return str(key[1]) if key[0] == "name" else "dot" + str(key[1][0])


def estimate(policy: BodyPolicy, program: Program) -> BodyCandidate:
    """FLOPs and kept bytes of the step traced with ``policy`` on its scan bodies."""
    analysis = from_program(program)
    kept = host = 0
    for r in analysis.residuals:
        if "Host" in str(program.values[r.value].memory_space):
            host += r.nbytes
        else:
            kept += r.nbytes
    return BodyCandidate(policy, float(program.flops), int(kept), host_bytes=int(host))


def _dominated(cands: Sequence[BodyCandidate], profile: Any = None) -> list[BodyCandidate]:
    """Candidates no other one beats on both cost and kept bytes, cheapest first; the cost
    is the FLOPs, or with a ``profile`` the predicted step time
    (:meth:`BodyCandidate.seconds`: host-link time counts where the compute cannot hide
    it)."""
    def cost(c: BodyCandidate) -> float:
        return c.flops if profile is None else c.seconds(profile)

    out: list[BodyCandidate] = []
    for c in sorted(cands, key=lambda c: (cost(c), c.flops, c.kept_bytes)):
        if not out or c.kept_bytes < min(o.kept_bytes for o in out):
            out.append(c)
    return out


#: How far above the budget a candidate must be predicted for :func:`choose` (with a plain
#: peak, :func:`_predicted_search`) to leave it uncompiled. The prediction that rules out
#: is the candidate's kept bytes plus the lowest ``compiled peak - kept bytes`` seen (the
#: plain step's against the most kept bytes included); on the zoo's scanned GPT at bench
#: size, H100 target, that difference was 23.4 to 33.2 MiB over four candidates of 14 to
#: 175 MiB kept (peaks 45 to 198 MiB).
SKIP_ABOVE = 0.25


def choose(cands: Sequence[BodyCandidate], compile_with: Callable[[BodyPolicy], Figures],
           budget: int, *, max_compiles: int = 8, profile: Any = None,
           plain_peak: int | None = None) -> BodyChoice:
    """Compile candidates until the cheapest one that fits ``budget`` is found: the fewest
    FLOPs, or with a ``profile`` the least predicted step time (an offload whose round
    trip the compute cannot hide costs what it exposes).

    Candidates beaten on both cost and kept bytes by another are left out; along the rest
    (cheapest first, so most kept bytes first) the compiled peak falls, so a bisection
    finds the first that fits in a few compiles: the one with the fewest kept bytes first
    (if it does not fit, nothing does, and it is chosen with ``fits=False``), then halves.

    With ``plain_peak`` (the step's compiled peak with nothing re-run in its scan bodies)
    the peak of each candidate is predicted as its kept bytes plus a ``peak - kept`` term
    (the plain step's beside the most kept bytes, then each compiled candidate's): between
    the last candidate known not to fit and the first known to fit, only those the lowest
    term puts within :data:`SKIP_ABOVE` of the budget are compiled, the cheapest predicted
    to fit by the highest term first, and the middle one after a compile that missed its
    prediction (:func:`_predicted_search`).
    """
    debug = os.environ.get("JAXMEM_BUDGET_DEBUG")
    front = _dominated(cands, profile)
    done: dict[str, BodyCandidate] = {}

    def peak(i: int) -> int:
        c = front[i]
        if c.policy.name not in done:
            c = dataclasses.replace(c, compiled=compile_with(c.policy))
            done[c.policy.name] = c
            if debug:
                print(f"jaxmem scan body: {c.row(budget)}")
        return done[front[i].policy.name].compiled.peak

    if plain_peak is not None:
        return _predicted_search(front, cands, peak, done, budget, plain_peak, max_compiles,
                                 profile)

    hi = len(front) - 1  # fits, once checked
    if peak(hi) > budget:
        best = min(done.values(), key=lambda c: (c.compiled.peak, c.flops))
        return BodyChoice(best, _merge(cands, done), budget, False, profile)
    lo = -1  # does not fit (or is before the first)
    while hi - lo > 1 and len(done) < max_compiles:
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            hi = mid
        else:
            lo = mid
    return BodyChoice(done[front[hi].policy.name], _merge(cands, done), budget, True, profile)


def _predicted_search(front: Sequence[BodyCandidate], cands: Sequence[BodyCandidate],
                      peak: Callable[[int], int], done: dict[str, BodyCandidate], budget: int,
                      plain_peak: int, max_compiles: int, profile: Any) -> BodyChoice:
    """:func:`choose` with ``plain_peak``. Along ``front`` (cheapest first, peaks falling)
    the first that fits lies between the last known not to fit and the first known to fit;
    of the candidates there, those whose kept bytes plus the lowest ``peak - kept`` seen are
    within :data:`SKIP_ABOVE` of the budget could still fit (none: the search is done, or,
    with nothing found to fit yet, the one that keeps least is compiled: if it does not fit,
    nothing does). The next compiled is the cheapest of them predicted to fit by the highest
    ``peak - kept`` seen (else the one nearest the fitting end); after a compile that
    missed its prediction, the middle one, as a bisection would."""
    base = plain_peak - max(c.kept_bytes for c in front)
    lo, hi = -1, len(front)  # front[lo] does not fit, front[hi] fits (once compiled)
    missed = False
    while hi - lo > 1 and len(done) < max_compiles:
        seen = [base] + [c.compiled.peak - c.kept_bytes for c in done.values()]
        inside = [k for k in range(lo + 1, hi)
                  if front[k].kept_bytes + min(seen) <= budget * (1 + SKIP_ABOVE)]
        if not inside:
            if hi < len(front):
                break  # none cheaper than the one that fits is predicted near the budget
            i = len(front) - 1
        elif missed:
            i = inside[len(inside) // 2]
        else:
            i = next((k for k in inside if front[k].kept_bytes + max(seen) <= budget),
                     inside[-1])
        predicted = front[i].kept_bytes + max(seen) <= budget
        fits = peak(i) <= budget
        missed = fits != predicted
        if fits:
            hi = i
        else:
            lo = i
    if hi == len(front) and front[-1].policy.name not in done:
        peak(len(front) - 1)  # compiles ran out before the one that keeps least was tried
    if hi == len(front) and done[front[-1].policy.name].compiled.peak <= budget:
        hi = len(front) - 1
    if hi == len(front):
        best = min(done.values(), key=lambda c: (c.compiled.peak, c.flops))
        return BodyChoice(best, _merge(cands, done), budget, False, profile)
    return BodyChoice(done[front[hi].policy.name], _merge(cands, done), budget, True, profile)


def _merge(cands: Sequence[BodyCandidate], done: dict[str, BodyCandidate]
           ) -> tuple[BodyCandidate, ...]:
    return tuple(done.get(c.policy.name, c) for c in cands)


def choose_for(opt: Any, fn: Callable[..., Any], dyn_args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> BodyChoice | None:
    """The body policy for ``opt`` (an :class:`~jaxmem.optimized.Optimized` with a budget)
    on ``fn(*dyn_args, **kwargs)``; ``None`` when the step scans no differentiated layer.
    Candidates are compiled as ``type(opt)`` steps (no import of the entry point here)."""
    from jaxmem import _jax
    from jaxmem.compiling import plan_cache
    from jaxmem.compiling.steps import plain_for
    from jaxmem.tracing.program import trace

    base = trace(fn, *dyn_args, **kwargs)
    values: list[BodyValue] = body_values(base)
    if not values:
        return None
    offload = opt.offload in (True, "auto")
    flat = jax.tree_util.tree_leaves((dyn_args, kwargs))
    # The choice is cached with the plans (jaxmem.plan_cache), without its executables: a
    # warm call traces the step once here and compiles none of the candidates.
    key = _choice_key(base, flat, ("budget scan body", opt.budget, opt.offload,
                                   opt.strategy, opt.donate_argnums,
                                   sorted(opt.jit_kwargs.items())))
    cached = plan_cache.load(key, BodyChoice)
    if cached is not None:
        return cached

    def traced(policy: BodyPolicy) -> Program:
        with _jax.checkpointed_scan_bodies(policy):
            return trace(fn, *dyn_args, **kwargs)

    # The plain step (the step's donation) is what a fractional budget is a fraction of and
    # what the candidates' peaks are predicted from: it compiles in a thread while the
    # candidates are traced (XLA's compile does not hold the GIL).
    plain_jitted, _ = plain_for(fn, dyn_args, kwargs, opt.donate_argnums, base,
                                opt.jit_kwargs)
    plain_lowered = plain_jitted.lower(*flat)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxmem-compile") as pool:
        compiling = pool.submit(measure.compile, plain_lowered)
        cands = [estimate(p, traced(p)) for p in candidates(values, offload=offload)]
        plain_exe = compiling.result()
    plain = Kept(plain_exe, program_key(plain_lowered), read(plain_exe, plain_jitted, flat))
    entries: dict[str, Any] = {}

    def entry(policy: BodyPolicy) -> Any:
        # The body policy with no recompute outside the scan (an auto plan capped at zero
        # FLOPs): the fewest FLOPs. When none fits so, the step's own budget search plans
        # the outside too (compiling/plan_step.py).
        if policy.name not in entries:
            sub = type(opt)(fn, strategy=opt.strategy, donate_argnums=opt.donate_argnums,
                            max_recompute_fraction=0.0, verify=False, remat_scans=policy,
                            **opt.jit_kwargs)
            entries[policy.name] = sub._prepare(dyn_args, kwargs)[0]  # noqa: SLF001
        return entries[policy.name]

    def kept(jitted: Any) -> Kept:
        lowered = jitted.lower(*flat)
        exe = measure.compile(lowered)
        return Kept(exe, program_key(lowered), read(exe, jitted, flat))

    budget = resolve_budget(opt.budget, plain.figures.peak)
    fitting: dict[str, Kept] = {}  # the last candidate compiled that fits: the bisection's best

    def compiled(policy: BodyPolicy) -> Figures:
        k = kept(entry(policy).jitted)
        if k.figures.peak <= budget:
            fitting.clear()  # one executable held at a time, besides the plain step's
            fitting[policy.name] = k
        return k.figures

    choice = choose(cands, compiled, budget, profile=profile_of(flat),
                    plain_peak=plain.figures.peak)
    plan_cache.store(key, choice)  # (choose's choice holds no executable)
    if choice.fits and choice.policy.name in fitting:
        return dataclasses.replace(choice, executable=fitting[choice.policy.name],
                                   plain=plain._replace(executable=None))
    return dataclasses.replace(choice, plain=plain)  # the budget search compiles it no more


def _choice_key(base: Program, flat: Sequence[Any], options: tuple[Any, ...]) -> str:
    """The plan-cache key of a scan-body choice: the step traced before it, the target the
    arguments are placed on (platform and device kinds), and the ``options`` it depends on."""
    from jaxmem.compiling import plan_cache

    platform = targets.platform_of(flat) or jax.default_backend()
    return plan_cache.fingerprint(base.jaxpr, (platform, _kinds(flat)), options)


def _kinds(flat: Sequence[Any]) -> tuple[str, ...]:
    """The device kinds the arguments are placed on (part of a cache key)."""
    return tuple(sorted({str(getattr(d, "device_kind", d)) for x in flat
                         for d in getattr(getattr(x, "sharding", None), "device_set", ())}))


def _lean(cands: Sequence[BodyCandidate], cap: float) -> BodyCandidate | None:
    """The candidate that keeps the fewest bytes with its FLOPs within ``cap`` (no offload)."""
    inside = [c for c in cands if c.flops <= cap and not c.policy.offload]
    return min(inside, key=lambda c: (c.kept_bytes, c.flops)) if inside else None


def auto_choice(opt: Any, fn: Callable[..., Any], dyn_args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[BodyPolicy, tuple[str, ...]] | None:
    """The scan-body policy for ``optimize``'s automatic mode (no budget), and its notes.

    MEDL's rule (:func:`jaxmem.policies.utility`, the default) keeps every matmul output of
    a scanned layer. Among the candidates of :func:`jaxmem.rewriting.scans.candidates` (MaxText's
    presets, the ladder), the one that keeps the fewest bytes with the step's FLOPs within
    ``max_recompute_fraction`` of the step with nothing recomputed in the body is compiled
    beside MEDL's rule (each with nothing dropped outside the scan, on the arguments'
    target), and the lower peak is kept. Two compiles, only when such a candidate keeps
    fewer bytes than MEDL's rule; ``None`` keeps MEDL's rule. The choice is cached with
    the plans (:mod:`jaxmem.plan_cache`), so a cache hit compiles nothing here.
    """
    from jaxmem import _jax
    from jaxmem.compiling import plan_cache
    from jaxmem.planning.plan import Plan
    from jaxmem.tracing.program import trace

    base = trace(fn, *dyn_args, **kwargs)
    values: list[BodyValue] = body_values(base)
    if not values:
        return None
    flat = jax.tree_util.tree_leaves((dyn_args, kwargs))
    key = _choice_key(base, flat, ("auto scan body", opt.max_recompute_fraction,
                                   opt.donate_argnums, opt.strategy,
                                   sorted(opt.jit_kwargs.items())))
    by_name = {p.name: p for p in candidates(values)}
    cached = plan_cache.load(key)
    if cached is not None:
        return (None if cached.strategy == "utility"
                else (by_name[cached.strategy], cached.notes))

    def traced(policy: BodyPolicy) -> Program:
        with _jax.checkpointed_scan_bodies(policy):
            return trace(fn, *dyn_args, **kwargs)

    cands = [estimate(p, traced(p)) for p in by_name.values()]
    full = {c.policy.name: c for c in cands}
    util, lean = full["utility"], _lean(cands, full["everything"].flops
                                        * (1 + opt.max_recompute_fraction))
    chosen, notes = util, ()
    if lean is not None and lean.kept_bytes < util.kept_bytes:
        peaks = {}
        for c in (util, lean):
            sub = type(opt)(fn, strategy=opt.strategy, donate_argnums=opt.donate_argnums,
                            max_recompute_fraction=0.0, verify=False, remat_scans=c.policy,
                            **opt.jit_kwargs)
            peaks[c.policy.name] = figures(sub._prepare(dyn_args, kwargs)[0].jitted,  # noqa: SLF001
                                           flat).peak
        if peaks[lean.policy.name] < peaks["utility"]:
            chosen = lean
        notes = (f"scan bodies: policy {chosen.policy.name!r} (compiled beside MEDL's rule: "
                 f"{lean.policy.name} {fmt_bytes(peaks[lean.policy.name])}, utility "
                 f"{fmt_bytes(peaks['utility'])}; {len(cands)} candidates traced, the fewest "
                 f"bytes kept within {opt.max_recompute_fraction:.0%} more FLOPs)",)
    plan_cache.store(key, Plan(choices=(), strategy=chosen.policy.name, recompute_flops=0.0,
                               baseline_flops=0.0, notes=notes))
    return None if chosen is util else (chosen.policy, notes)
