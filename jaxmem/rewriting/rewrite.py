"""Apply a :class:`~jaxmem.planning.plan.Plan` to a whole program: the joint-jaxpr rewrite.

Fourth box of the data flow: ``Program + Plan -> new function`` (:func:`apply`). A train
step already holds its backward pass, so ``jax.checkpoint`` cannot be applied to it; instead
the flattened program is replayed equation by equation and

- a residual marked RECOMPUTE is re-emitted just before the backward region that reads it,
  from the values the plan keeps, behind ``lax.optimization_barrier`` tied to that region's
  cotangents, so XLA can neither merge it back into the forward pass (CSE) nor hoist it;
- a residual marked OFFLOAD is copied to ``pinned_host`` after it is made and back to the
  device one backward region before it is read (prefetch);
- a primitive with a lean equivalent in :mod:`jaxmem.rewriting.substitutes` (max-pooling's
  derivative) is emitted as that equivalent;
- where a concatenation's cotangent is split across backward regions, the cotangents that
  cross regions are materialised where they are made (:func:`crossing_cotangents`).

Each chain is re-emitted once per backward region (a run of backward nodes of one layer),
not once per reading equation; where chains start and how regions are cut is
:mod:`jaxmem.analyzing.chains`'s. Every equation is re-bound under its original name stack and
traceback, so profiles and later analyses still read the same layer paths.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax

from jaxmem.analyzing.analysis import find_residuals
from jaxmem.analyzing.chains import backward_regions, chain_start, is_anchor, replay_chain
from jaxmem.planning.plan import Plan
from jaxmem.rewriting.emitters import Traced
from jaxmem.rewriting.settle import Orderings, beside_barrier, cotangent_ties, narrowest
from jaxmem.rewriting.substitutes import substitute_for
from jaxmem.tracing.primitives import CHEAP
from jaxmem.tracing.program import Node, Program, region_of

__all__ = ["apply", "crossing_cotangents", "kept_by", "narrow_residuals", "rewrite"]


class _Replay:
    def __init__(self, program: Program, recompute: frozenset[int], offload: frozenset[int],
                 residuals: frozenset[int], prefetch: bool = True,
                 reuse: frozenset[int] = frozenset(), narrow: frozenset[int] = frozenset(),
                 region_depth: int | None = None, tie_kept: bool = False,
                 substitute: bool = True, cut_cotangents: bool | None = None,
                 settle_host: bool = True, fence_gradients: bool = True,
                 ops: Any = None) -> None:
        self.p = program
        self.ops = Traced() if ops is None else ops
        self.substitutes = {n.index: fn for n in program.nodes
                            if substitute and (fn := substitute_for(n.eqn)) is not None}
        self.depth = region_depth
        crossing = crossing_cotangents(program, region_depth)
        if cut_cotangents is None:  # on where a concatenation's cotangent is split across
            cut_cotangents = any(
                (m := program.nodes[i]).primitive in _SPLITS
                and region_of(m, region_depth) != region_of(
                    program.nodes[program.values[v].producer], region_depth)
                for v in crossing for i in program.users.get(v, ()))
        self.cut = crossing if cut_cotangents else frozenset()
        self.tie_kept = tie_kept
        self.narrow = narrow
        self.recompute = recompute
        self.offload = offload
        self.reuse = reuse
        self.starts = chain_start(program, dropped=recompute, kept=residuals, offloaded=offload)
        # A region opens at the first node of each run that reads a re-created or fetched
        # value (jaxmem.analyzing.chains.backward_regions): there the re-created values are dropped.
        self.opens = frozenset(r[0] for r in backward_regions(
            program, lambda n: any(v in recompute or v in offload for v in n.inputs),
            region_depth))
        self.orderings = Orderings(program, offload, region_depth,
                                   settle_host=settle_host and bool(offload),
                                   fence_gradients=fence_gradients)
        self.run_of: dict[int, int] = {}
        self.ahead: dict[int, list[int]] = {}   # node index -> offloaded values to fetch there
        if prefetch and offload:
            self._plan_prefetch()

    def _plan_prefetch(self) -> None:
        """Backward runs: maximal runs of consecutive backward nodes of one region key. An
        offloaded value first read in run k is fetched at the start of run k-1."""
        program = self.p
        runs = backward_regions(program, None, self.depth)
        reads: list[dict[int, None]] = []
        for k, run in enumerate(runs):
            reads.append({})
            for i in run:
                n = program.nodes[i]
                self.run_of[i] = k
                for v in n.inputs:
                    if v in self.offload:
                        reads[-1][v] = None
                # offloaded values the run's recompute chains start from are read there too
                redo = [v for v in n.inputs if v in self.recompute]
                if redo:
                    for a in replay_chain(program, redo, self.starts)[1]:
                        if a in self.offload:
                            reads[-1][a] = None
        for k in range(1, len(runs)):
            early = [v for v in reads[k] if program.values[v].producer < runs[k - 1][0]]
            if early:
                self.ahead[runs[k - 1][0]] = early

    def emit(self, n: Node, ins: list[Any]) -> list[Any]:
        """Re-bind node ``n`` on ``ins`` (its lean substitute where there is one)."""
        with self.ops.context(n):
            sub = self.substitutes.get(n.index)
            return self.ops.substitute(sub, ins) if sub is not None else \
                self.ops.bind(n.eqn, ins)

    def tied(self, v: int) -> bool:
        """A kept value a backward region reads through its barrier (``tie_kept``)."""
        val = self.p.values[v]
        if val.is_const or v in self.p.constant_derived or v in self.recompute \
                or v in self.offload:
            return False
        return val.producer is not None and self.p.nodes[val.producer].phase == "forward"

    def tie(self, n: Node, env: dict[int, Any], last: int | None) -> list[Any]:
        """The values a barrier ties re-created or fetched values to: ``n``'s cotangents
        (:func:`~jaxmem.rewriting.settle.cotangent_ties`); where ``n`` reads none, the
        last backward value made (``last``), as narrow as it comes
        (:func:`~jaxmem.rewriting.settle.narrowest`, the loss's seed followed to its
        scalar), or nothing before the first."""
        tie = cotangent_ties(self.p, n)
        if not tie and last is not None:
            tie = narrowest(self.p, last)
        return [env[v] for v in tie]

    def run(self, *flat_args: Any) -> list[Any]:
        p = self.p
        env: dict[int, Any] = {}
        for vid, x in zip(p.inputs, flat_args, strict=True):
            env[vid] = x
        for v in p.values:
            if v.is_const:
                env[v.id] = self.ops.const(v)
        host: dict[int, Any] = {}
        region: tuple[str, str] | None = None
        cache: dict[int, Any] = {}
        reused: dict[int, Any] = {}      # reuse: re-created copies later regions read too
        fetched: dict[tuple[int, int], Any] = {}  # (run, value) -> prefetched device copy
        last: int | None = None  # the last backward value made
        # this trace's ties for the accelerators' schedulers
        order = self.orderings.fresh(self.ops.barrier)
        for n in p.nodes:
            if n.index in self.ahead:
                self.prefetch(n, env, host, fetched, last)
            needs = [v for v in n.inputs if v in self.recompute or v in self.offload]
            if n.index in self.opens:
                region, cache = region_of(n, self.depth), dict(reused)
            if self.tie_kept and n.phase == "backward" and region_of(n, self.depth) == region:
                # Block mode: the region reads its kept inputs through its barrier too, as
                # jax.checkpoint does, so XLA cannot hoist copies of them (a transposed
                # layout for a weight gradient) into the forward pass and keep both.
                needs += [v for v in n.inputs if self.tied(v)]
            if n.phase == "backward" and needs:
                run = self.run_of.get(n.index)
                for (r, v), x in fetched.items():
                    if r == run and v not in cache:
                        cache[v] = x
                tie = self.tie(n, env, last)
                self.materialise([v for v in dict.fromkeys(needs) if v not in cache],
                                 env, host, cache, tie)
                if self.reuse:
                    reused.update({v: x for v, x in cache.items() if v in self.reuse})
                ins = [cache[v] if v in cache else env[v] for v in n.inputs]
            else:
                ins = [env[v] for v in n.inputs]
            ins = order.inputs(n, ins, env, host)
            outs = self.emit(n, ins)
            if n.phase == "forward" and any(o in self.narrow for o in n.outputs):
                outs = [self.ops.barrier(x) if o in self.narrow else x
                        for o, x in zip(n.outputs, outs, strict=True)]
            if n.phase == "backward" and any(o in self.cut for o in n.outputs):
                outs = [self.ops.barrier(x) if o in self.cut else x
                        for o, x in zip(n.outputs, outs, strict=True)]
            for o, x in zip(n.outputs, outs, strict=True):
                env[o] = x
                if o in self.offload:
                    with self.ops.context(n):
                        host[o] = self.ops.to_host(x)
            order.made(n)
            if n.phase == "backward" and outs:
                last = n.outputs[0]
        return [env[v] for v in p.outputs]

    def prefetch(self, n: Node, env: dict[int, Any], host: dict[int, Any],
                 fetched: dict[tuple[int, int], Any], last: int | None) -> None:
        """Fetch the offloaded values the next backward run reads, at the start of this one,
        tied to this run's cotangents (so the copy overlaps this run's compute)."""
        vs = [v for v in self.ahead[n.index] if v in host]
        if not vs:
            return
        tie = self.tie(n, env, last)
        operands = [host[v] for v in vs]
        if tie:
            operands, _ = self.ops.barrier((operands, list(tie)))
        run = self.run_of[n.index] + 1
        for v, x in zip(vs, operands, strict=True):
            m = self.p.nodes[self.p.values[v].producer]
            with self.ops.context(m):
                fetched[(run, v)] = self.ops.to_device(x)

    def untied(self, anchors: list[int], nodes: list[int]) -> list[int]:
        """The chain anchors read beside the barrier: the step's own inputs that the chain
        reads only through cheap nodes, and whose re-created values from them alone have no
        live forward original.

        A donated input read through a barrier in the backward pass is copied by XLA (its
        buffer is the output's): an L2 penalty's ``2 * w`` re-created from every weight
        kept a second copy of each (flax ResNet18 on the H100 target: +29 MiB). An input a
        re-created matmul or convolution reads stays in the barrier, or XLA could hoist its
        layout copy into the forward pass; so does one whose cheap derivatives (a bias's
        broadcast) the forward pass also makes and reads: outside the barrier XLA would CSE
        the re-created copy with the forward one and keep that buffer to the backward pass.
        """
        p = self.p
        if all(p.values[a].producer is not None for a in anchors):
            return []   # no step input among them
        readers = [p.nodes[i] for i in nodes]
        reads = [{v for v in n.inputs if not p.values[v].is_const} for n in readers]
        out = []
        for a in anchors:
            if p.values[a].producer is not None or any(
                    n.kind not in CHEAP for n in readers if a in n.inputs):
                continue
            made = {a}  # the chain's values made from ``a`` (and constants) alone
            for n, r in zip(readers, reads, strict=True):
                if made.issuperset(r):
                    made.update(n.outputs)
            if not any(p.nodes[u].phase == "forward" for v in made - {a}
                       for u in p.users.get(v, ())):
                out.append(a)
        return out

    def materialise(self, targets: list[int], env: dict[int, Any], host: dict[int, Any],
                    cache: dict[int, Any], tie: list[Any]) -> None:
        if not targets:
            return
        redo = [v for v in targets if v in self.recompute]
        nodes, anchors = replay_chain(self.p, redo, self.starts, cache) if redo else ([], [])
        # Offloaded values read here, directly or as a chain's start, come back from host.
        fetch = list(dict.fromkeys([v for v in targets if v in self.offload]
                                   + [a for a in anchors if a in self.offload]))
        # Kept values a block region reads (tie_kept) pass the barrier as they are.
        anchors = list(dict.fromkeys(
            [a for a in anchors if not self.p.values[a].is_const and a not in self.offload]
            + [v for v in targets if v not in self.offload and v not in self.recompute]))
        # Anchors pass through the barrier below; the step inputs of :meth:`untied` are
        # read beside it.
        inputs = self.untied(anchors, nodes)
        anchors = [a for a in anchors if a not in inputs]
        operands = [env[a] for a in anchors] + [host[v] for v in fetch]
        if tie and operands:
            # The barrier makes the re-created values depend on this region's cotangents, so
            # XLA cannot compute them early, nor CSE them with the forward originals.
            operands, _ = self.ops.barrier((operands, list(tie)))
        local = dict(cache)
        local.update((a, env[a]) for a in inputs)
        for a, x in zip(anchors, operands[:len(anchors)], strict=True):
            local[a] = x
        for v, x in zip(fetch, operands[len(anchors):], strict=True):
            n = self.p.nodes[self.p.values[v].producer]
            with self.ops.context(n):
                cache[v] = local[v] = self.ops.to_device(x)
        # Matmul outputs are read beside the barrier where it orders the node already.
        beside = beside_barrier(self.p, nodes, anchors, fetch) if tie and operands else {}
        for i in nodes:
            n = self.p.nodes[i]
            raw = beside.get(i, frozenset())
            ins = [local[v] if v in local and v not in raw else env[v] for v in n.inputs]
            outs = self.emit(n, ins)
            for o, x in zip(n.outputs, outs, strict=True):
                local[o] = x
                # Block regions re-run a block once: later readers in the region reuse
                # every value of the replayed chain, not only the targets.
                if o in self.reuse or self.depth is not None:
                    cache[o] = x
        for v in targets:
            if v not in self.offload:
                cache[v] = local[v]


_SPLITS = ("split", "slice")


def crossing_cotangents(program: Program, region_depth: int | None = None) -> frozenset[int]:
    """Backward values read by a backward region other than the one that makes them.

    A concatenation's cotangent is split among the regions of its pieces (DenseNet: layer
    ``l``'s input gradient is sliced by every earlier layer). XLA fuses the producer of such
    a value into each reader rather than materialising it once, so the producer's inputs —
    re-created activations, ReLU derivatives — stay live across every later region; on the
    zoo DenseNet three layers' worth at once. :func:`rewrite` can pass these values through
    an ``optimization_barrier`` where they are made (``cut_cotangents``)."""
    return program.crossing("backward", region_depth)


def narrow_residuals(program: Program, kept: frozenset[int]) -> frozenset[int]:
    """Kept forward residuals that XLA would store as a wider operand unless kept narrow.

    A narrow value (a dropout mask ``lt(uniform, p)``: 1 byte per element) made by a fusible
    op from a wider operand that is itself made from the program's inputs alone (random bits
    from a key): XLA fuses the cheap op into every reader and keeps the wide operand alive for
    the backward pass. Narrow values of activations (a ReLU mask of a conv output) are left
    alone: XLA re-derives those from activations it keeps anyway.
    """
    out = set()
    for v in kept:
        p = program.values[v].producer
        if p is None or is_anchor(program, v):
            continue
        n = program.nodes[p]
        if n.phase != "forward":
            continue
        wide = [u for u in n.inputs if not program.values[u].is_const
                and program.values[u].nbytes > program.values[v].nbytes]
        if wide and all(_from_inputs_only(program, u) for u in wide):
            out.add(v)
    return frozenset(out)


def _from_inputs_only(program: Program, v: int) -> bool:
    """Whether ``v``'s fusible chain starts only from program inputs and constants."""
    nodes, starts = replay_chain(program, [v], chain_start(program))
    return bool(nodes) and all(program.values[u].producer is None for u in starts)


def apply(program: Program, plan: Plan, **options: Any) -> Callable[..., list[Any]]:
    """The function that carries out ``plan`` on ``program``: the fourth box of the data flow.

    Every value the plan chose for (its residuals and the anchors it decided on) that it
    neither recomputes nor offloads is kept, as are the plan's ``keep`` values (a block
    plan's boundaries); regions are cut at the plan's ``region_depth``.

    Args:
      program: the traced program the plan's analysis was made from.
      plan: a :class:`~jaxmem.planning.plan.Plan` (:mod:`jaxmem.planning.strategies`,
      :mod:`jaxmem.planning.budget`).
      **options: :func:`rewrite`'s keyword options (``prefetch``, ``reuse``,
        ``keep_narrow``, ``tie_kept``, ``substitute``, ``cut_cotangents``, ``settle_host``,
        ``fence_gradients``; a plan marked ``unfenced`` is never fenced).

    Returns:
      A function of the program's flat inputs returning its flat outputs; jit it.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> from jaxmem.planning.strategies import plan_auto
      >>> step = jax.value_and_grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
      >>> args = (jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> prog = jaxmem.trace(step, *args)
      >>> fn = apply(prog, plan_auto(jaxmem.analyzing.analysis.from_program(prog)))
      >>> loss, g = jax.jit(fn)(*args)
    """
    return replay(program, plan, **options).run


def replay(program: Program, plan: Plan, *, ops: Any = None, **options: Any) -> _Replay:
    """:func:`apply`'s replay of ``program`` (its ``run`` is the function :func:`apply`
    returns), emitting through ``ops`` (:class:`~jaxmem.rewriting.emitters.Traced` when None; a
    :class:`jaxmem.rewriting.symbolic.Symbolic` builds the rewritten program's nodes
    without tracing)."""
    if plan.unfenced:
        options = {**options, "fence_gradients": False}
    run = rewrite(program, plan.recompute, plan.offload, kept_by(plan),
                  region_depth=plan.region_depth, ops=ops, **options)
    return run.__self__


def kept_by(plan: Plan) -> frozenset[int]:
    """The kept values the replay of ``plan`` starts its chains from (:func:`replay`'s
    ``residuals``): the residuals the plan chose for, and the values it keeps."""
    return frozenset(c.residual.value for c in plan.choices) | plan.keep


_RENAMED = {"persist": "reuse", "pin_narrow": "keep_narrow", "route_kept": "tie_kept"}


def rewrite(program: Program, recompute: Iterable[int] = frozenset(),
            offload: Iterable[int] = frozenset(),
            residuals: Iterable[int] | None = None, *, prefetch: bool = True,
            reuse: Iterable[int] = frozenset(), keep_narrow: bool = True,
            region_depth: int | None = None, tie_kept: bool | None = None,
            substitute: bool = True, cut_cotangents: bool | None = None,
            settle_host: bool | None = None, fence_gradients: bool | None = None,
            ops: Any = None, **renamed: Any) -> Callable[..., list[Any]]:
    """A function of the program's flat inputs that recomputes / offloads the given values.

    :func:`apply` calls it with a plan's sets; call it directly to try sets by hand.

    Args:
      program: the traced program (see :func:`jaxmem.program.trace`).
      recompute: value ids to drop after the forward pass and re-create in the backward.
      offload: value ids to park in host memory between their forward and backward uses.
      residuals: the kept value ids chains may start from (those in ``recompute`` or
        ``offload`` excepted); defaults to the program's residuals.
      prefetch: fetch each offloaded value back at the start of the backward run (a run of
        consecutive backward nodes of one layer) *before* the one that reads it, behind a
        barrier tied to that earlier run's cotangents, so the copy overlaps its compute.
        ``False``: fetch in the reading run itself. Only offloaded values are affected.
      reuse: recomputed value ids whose re-created copies later backward regions reuse
        (segment recompute: a segment is re-run once, not once per backward region that
        reads it). Default: none; every region re-creates what it reads.
      keep_narrow: keep narrow residuals narrow: materialise kept residuals that are
        narrower than an operand made from the program's inputs alone (a dropout mask
        ``lt(uniform, p)``: 1 byte from 4) behind a barrier where they are made
        (:func:`narrow_residuals`). Otherwise XLA fuses the cheap producer into every reader
        and keeps the wide operand alive for the backward pass instead.
      region_depth: cut layer paths to this many parts to form backward regions (one region
        per block, as :func:`jaxmem.planning.strategies.plan_blocks` needs). Default: one per layer
        path.
      tie_kept: a backward region also ties the kept forward values it reads to its barrier,
        as ``jax.checkpoint`` does, so XLA cannot hoist copies of them (a transposed layout
        for a weight gradient) into the forward pass and keep both. Default: on in block
        mode (``region_depth`` given), off otherwise (there it can force narrow masks XLA
        would re-derive to be stored; measured worse on DenseNet).
      substitute: emit the equivalents in :mod:`jaxmem.rewriting.substitutes` for primitives whose
        XLA lowering holds large temporaries (max-pooling's derivative); same values.
      cut_cotangents: pass every backward value read by another backward region through an
        ``optimization_barrier`` where it is made (:func:`crossing_cotangents`), so XLA
        materialises it once instead of fusing its producer into each later reader.
        Default: on where a concatenation's cotangent is split across regions (measured:
        zoo DenseNet auto plan −28.5% → −60.2%, U-Net −38.6% → −41.8%), off otherwise (the
        zoo GPT's plan rose from −45.6% to −32.7% with it on).
      settle_host: where values are offloaded, tie each host copy to the first node of a
        later forward region, and the step outputs the forward pass makes (the loss value)
        to the first backward node, behind barriers (:mod:`jaxmem.rewriting.settle`):
        XLA:GPU otherwise issues a device-to-host copy
        just before its copy back, so the device buffer lives through the forward pass
        and nothing is freed. Default: on unless the default backend is the CPU, whose
        compiles strip host placement (:class:`jaxmem.compiling.steps.Step` passes its
        arguments' platform); no effect without offloads.
      fence_gradients: each backward run (the backward nodes of one region) waits, behind a
        barrier on its first node's inputs, for the values the runs before it made that
        nothing later in the backward pass reads (weight gradients on their way to the
        update; :func:`jaxmem.rewriting.settle.fence_finished`). XLA:GPU's and XLA:TPU's
        schedulers otherwise move that work late, past the blocks that follow, and keep
        the cotangents it reads live meanwhile (H100 target, zoo GPT bench block plan:
        64.3 MiB unfenced, 41.1 MiB fenced, per-block ``nothing_saveable`` 41.3 MiB).
        Default: as ``settle_host`` (off on the CPU, where it changes nothing).
      ops: what the replay emits through: :class:`jaxmem.rewriting.emitters.Traced` (None:
        JAX operations, for a trace) or a :class:`jaxmem.rewriting.symbolic.Symbolic`
        (the rewritten program's nodes, built without a trace; :func:`replay`).
      **renamed: the former names ``persist``, ``pin_narrow`` and ``route_kept`` of
        ``reuse``, ``keep_narrow`` and ``tie_kept`` (deprecated).
    """
    for old in renamed:
        if old not in _RENAMED:
            raise TypeError(f"rewrite() got an unexpected keyword argument {old!r}")
        warnings.warn(f"rewrite({old}=...) is deprecated; use {_RENAMED[old]}=",
                      DeprecationWarning, stacklevel=2)
    reuse = renamed.get("persist", reuse)
    keep_narrow = renamed.get("pin_narrow", keep_narrow)
    tie_kept = renamed.get("route_kept", tie_kept)
    recompute, offload = frozenset(recompute), frozenset(offload)
    if residuals is None:
        residuals = frozenset(r.value for r in find_residuals(program))
    residuals = frozenset(residuals)
    bad = [v for v in recompute | offload if program.values[v].producer is None]
    if bad:
        raise ValueError(f"values {bad} are program inputs or constants: nothing to recompute "
                         "or offload")
    narrow = (narrow_residuals(program, residuals - recompute - offload) if keep_narrow
              else frozenset())
    accelerator = jax.default_backend() != "cpu"
    emitted = _Replay(program, recompute, offload, residuals, prefetch=prefetch,
                      reuse=frozenset(reuse) & recompute, narrow=narrow,
                      region_depth=region_depth,
                      tie_kept=region_depth is not None if tie_kept is None else tie_kept,
                      substitute=substitute, cut_cotangents=cut_cotangents,
                      settle_host=accelerator if settle_host is None else settle_host,
                      fence_gradients=(accelerator if fence_gradients is None
                                       else fence_gradients), ops=ops)
    return emitted.run
