"""Apply a :class:`~jaxmem.plan.Plan` to a whole program: the joint-jaxpr rewrite.

Fourth box of the data flow: ``Program + Plan -> new function``. A train step already holds
its backward pass, so ``jax.checkpoint`` cannot be applied to it; instead the flattened
program is replayed equation by equation and

- a residual marked RECOMPUTE is re-emitted just before the backward region that reads it,
  from the values the plan keeps, behind ``lax.optimization_barrier`` tied to that region's
  cotangents, so XLA can neither merge it back into the forward pass (CSE) nor hoist it;
- a residual marked OFFLOAD is copied to ``pinned_host`` after it is made and back to the
  device one backward region before it is read (prefetch);
- a primitive with a lean equivalent in :mod:`jaxmem.substitutes` (max-pooling's
  derivative) is emitted as that equivalent;
- where a concatenation's cotangent is split across backward regions, the cotangents that
  cross regions are materialised where they are made (:func:`crossing_cotangents`).

Each chain is re-emitted once per backward region (a run of backward nodes of one layer),
not once per reading equation. Every equation is re-bound under its original name stack
and traceback, so profiles and later analyses still read the same layer paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from jaxmem import _jax
from jaxmem.analysis import is_anchor, replay_chain
from jaxmem.program import Node, Program, region_of
from jaxmem.substitutes import substitute_for


class _Replay:
    def __init__(self, program: Program, recompute: frozenset[int], offload: frozenset[int],
                 residuals: frozenset[int], prefetch: bool = True,
                 persist: frozenset[int] = frozenset(), pin: frozenset[int] = frozenset(),
                 region_depth: int | None = None, route_kept: bool = False,
                 substitute: bool = True, cut_cotangents: bool | None = None) -> None:
        self.p = program
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
        self.route = route_kept
        self.pin = pin
        self.recompute = recompute
        self.offload = offload
        self.persist = persist
        # Values a chain may start from: program inputs, constants, kept residuals and
        # anchors (heavy outputs, units), and offloaded values (fetched back from the host)
        # — never a value the plan re-creates.
        self.kept = lambda v: v not in recompute and (
            v in offload or v in residuals or is_anchor(program, v))
        # Backward runs: maximal runs of consecutive backward nodes of one layer. With
        # prefetch, an offloaded value first read in run k is fetched at the start of run k-1.
        self.run_of: dict[int, int] = {}
        self.ahead: dict[int, list[int]] = {}   # node index -> offloaded values to fetch there
        if prefetch and offload:
            starts: list[int] = []
            reads: list[dict[int, None]] = []
            key = None
            for n in program.nodes:
                if n.phase != "backward":
                    continue
                if region_of(n, self.depth) != key:
                    key = region_of(n, self.depth)
                    starts.append(n.index)
                    reads.append({})
                self.run_of[n.index] = len(starts) - 1
                for v in n.inputs:
                    if v in offload:
                        reads[-1][v] = None
                # offloaded values the run's recompute chains start from are read there too
                redo = [v for v in n.inputs if v in recompute]
                if redo:
                    for a in replay_chain(program, redo, self.kept)[1]:
                        if a in offload:
                            reads[-1][a] = None
            for k in range(1, len(starts)):
                early = [v for v in reads[k]
                         if program.values[v].producer < starts[k - 1]]
                if early:
                    self.ahead[starts[k - 1]] = early

    def emit(self, n: Node, ins: list[Any]) -> list[Any]:
        """Re-bind node ``n`` on ``ins`` (its lean substitute where there is one)."""
        with _jax.user_context(n.eqn.source_info.traceback, n.stack):
            sub = self.substitutes.get(n.index)
            return sub(*ins) if sub is not None else _jax.bind(n.eqn, *ins)

    def routed(self, v: int) -> bool:
        """A kept value a backward region reads through its barrier (block mode)."""
        val = self.p.values[v]
        if val.is_const or v in self.p.constant_derived or v in self.recompute \
                or v in self.offload:
            return False
        return val.producer is not None and self.p.nodes[val.producer].phase == "forward"

    def tie(self, n: Node, env: dict[int, Any]) -> list[Any]:
        """The values a barrier ties re-created or fetched values to: ``n``'s inputs made in
        the backward pass (its cotangents).

        Forward values are never tied: a barrier operand must be materialised, and a value
        XLA would otherwise re-derive in place (a broadcast zero of a ReLU's derivative, an
        iota) would be kept as a whole buffer from the forward pass to this region.
        """
        return [env[v] for v in dict.fromkeys(n.inputs)
                if (u := self.p.values[v].producer) is not None
                and self.p.nodes[u].phase == "backward" and v not in self.p.constant_derived]

    def chain(self, targets: Sequence[int], cache: dict[int, Any]) -> tuple[list[int], list[int]]:
        """Nodes to replay for ``targets`` (program order) and the anchor values they read."""
        return replay_chain(self.p, targets, self.kept, cache)

    def run(self, *flat_args: Any) -> list[Any]:
        p = self.p
        env: dict[int, Any] = {}
        for vid, x in zip(p.inputs, flat_args, strict=True):
            env[vid] = x
        for v in p.values:
            if v.is_const:
                env[v.id] = v.const
        host: dict[int, Any] = {}
        region: tuple[str, str] | None = None
        cache: dict[int, Any] = {}
        kept_on: dict[int, Any] = {}     # persist: recomputed copies kept to the end
        fetched: dict[tuple[int, int], Any] = {}  # (run, value) -> prefetched device copy
        last_backward: list[Any] = []
        for n in p.nodes:
            if n.index in self.ahead:
                self.prefetch(n, env, host, fetched, last_backward)
            needs = [v for v in n.inputs if v in self.recompute or v in self.offload]
            if n.phase == "backward" and needs and region_of(n, self.depth) != region:
                region, cache = region_of(n, self.depth), dict(kept_on)
            if self.route and n.phase == "backward" and region_of(n, self.depth) == region:
                # Block mode: the region reads its kept inputs through its barrier too, as
                # jax.checkpoint does, so XLA cannot hoist copies of them (a transposed
                # layout for a weight gradient) into the forward pass and keep both.
                needs += [v for v in n.inputs if self.routed(v)]
            if n.phase == "backward" and needs:
                run = self.run_of.get(n.index)
                for (r, v), x in fetched.items():
                    if r == run and v not in cache:
                        cache[v] = x
                tie = self.tie(n, env) or last_backward
                self.materialise([v for v in dict.fromkeys(needs) if v not in cache],
                                 env, host, cache, tie)
                if self.persist:
                    kept_on.update({v: x for v, x in cache.items() if v in self.persist})
                ins = [cache[v] if v in cache else env[v] for v in n.inputs]
            else:
                ins = [env[v] for v in n.inputs]
            outs = self.emit(n, ins)
            if n.phase == "forward" and any(o in self.pin for o in n.outputs):
                outs = [lax.optimization_barrier(x) if o in self.pin else x
                        for o, x in zip(n.outputs, outs, strict=True)]
            if n.phase == "backward" and any(o in self.cut for o in n.outputs):
                outs = [lax.optimization_barrier(x) if o in self.cut else x
                        for o, x in zip(n.outputs, outs, strict=True)]
            for o, x in zip(n.outputs, outs, strict=True):
                env[o] = x
                if o in self.offload:
                    with _jax.user_context(n.eqn.source_info.traceback, n.stack):
                        host[o] = jax.device_put(x, _jax.host_space())
            if n.phase == "backward" and outs:
                last_backward = [outs[0]]
        return [env[v] for v in p.outputs]

    def prefetch(self, n: Node, env: dict[int, Any], host: dict[int, Any],
                 fetched: dict[tuple[int, int], Any], last_backward: list[Any]) -> None:
        """Fetch the offloaded values the next backward run reads, at the start of this one,
        tied to this run's cotangents (so the copy overlaps this run's compute)."""
        vs = [v for v in self.ahead[n.index] if v in host]
        if not vs:
            return
        tie = self.tie(n, env) or last_backward
        operands = [host[v] for v in vs]
        if tie:
            operands, _ = lax.optimization_barrier((operands, list(tie)))
        run = self.run_of[n.index] + 1
        for v, x in zip(vs, operands, strict=True):
            m = self.p.nodes[self.p.values[v].producer]
            with _jax.user_context(m.eqn.source_info.traceback, m.stack):
                fetched[(run, v)] = jax.device_put(x, _jax.device_space())

    def materialise(self, targets: list[int], env: dict[int, Any], host: dict[int, Any],
                    cache: dict[int, Any], tie: list[Any]) -> None:
        if not targets:
            return
        redo = [v for v in targets if v in self.recompute]
        nodes, anchors = self.chain(redo, cache) if redo else ([], [])
        # Offloaded values read here, directly or as a chain's start, come back from host.
        fetch = list(dict.fromkeys([v for v in targets if v in self.offload]
                                   + [a for a in anchors if a in self.offload]))
        # Kept values a block region reads (route_kept) pass the barrier as they are.
        anchors = list(dict.fromkeys(
            [a for a in anchors if not self.p.values[a].is_const and a not in self.offload]
            + [v for v in targets if v not in self.offload and v not in self.recompute]))
        operands = [env[a] for a in anchors] + [host[v] for v in fetch]
        if tie and operands:
            # The barrier makes the re-created values depend on this region's cotangents, so
            # XLA cannot compute them early, nor CSE them with the forward originals.
            operands, _ = lax.optimization_barrier((operands, list(tie)))
        local = dict(cache)
        for a, x in zip(anchors, operands[:len(anchors)], strict=True):
            local[a] = x
        for v, x in zip(fetch, operands[len(anchors):], strict=True):
            n = self.p.nodes[self.p.values[v].producer]
            with _jax.user_context(n.eqn.source_info.traceback, n.stack):
                cache[v] = local[v] = jax.device_put(x, _jax.device_space())
        for i in nodes:
            n = self.p.nodes[i]
            ins = [local[v] if v in local else env[v] for v in n.inputs]
            outs = self.emit(n, ins)
            for o, x in zip(n.outputs, outs, strict=True):
                local[o] = x
                # Block regions re-run a block once: later readers in the region reuse
                # every value of the replayed chain, not only the targets.
                if o in self.persist or self.depth is not None:
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
    """Kept forward residuals that XLA would store as a wider operand unless pinned.

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
    nodes, starts = replay_chain(program, [v], lambda u: is_anchor(program, u))
    return bool(nodes) and all(program.values[u].producer is None for u in starts)


def rewrite(program: Program, recompute: frozenset[int] = frozenset(),
            offload: frozenset[int] = frozenset(),
            residuals: frozenset[int] | None = None, *, prefetch: bool = True,
            persist: frozenset[int] = frozenset(),
            pin_narrow: bool = True, region_depth: int | None = None,
            route_kept: bool | None = None,
            substitute: bool = True,
            cut_cotangents: bool | None = None) -> Callable[..., list[Any]]:
    """A function of the program's flat inputs that recomputes / offloads as told.

    Args:
      program: the traced program (see :func:`jaxmem.program.trace`).
      recompute: value ids to drop after the forward pass and re-create in the backward.
      offload: value ids to park in host memory between their forward and backward uses.
      residuals: all residual value ids (those not in ``recompute``/``offload`` are kept
        and may anchor chains). Defaults to the program's residuals.
      prefetch: fetch each offloaded value back at the start of the backward run (a run of
        consecutive backward nodes of one layer) *before* the one that reads it, behind a
        barrier tied to that earlier run's cotangents, so the copy overlaps its compute.
        ``False``: fetch in the reading run itself. Only offloaded values are affected.
      persist: recomputed value ids whose re-created copies are kept for the rest of the
        backward pass (segment recompute: a segment is re-run once, not once per backward
        region that reads it). Default: none; every region re-creates what it reads.
      pin_narrow: materialise kept residuals that are narrower than an operand made from
        the program's inputs alone (a dropout mask ``lt(uniform, p)``: 1 byte from 4) behind
        a barrier where they are made (:func:`narrow_residuals`). Otherwise XLA fuses the
        cheap producer into every reader and keeps the wide operand alive for the backward
        pass instead.
      region_depth: cut layer paths to this many parts to form backward regions (one region
        per block, as :func:`jaxmem.plan.plan_blocks` needs). Default: one per layer path.
      route_kept: a backward region also reads the kept forward values it needs through its
        barrier, as ``jax.checkpoint`` does, so XLA cannot hoist copies of them (a transposed
        layout for a weight gradient) into the forward pass and keep both. Default: on in
        block mode (``region_depth`` given), off otherwise (there it can force narrow masks
        XLA would re-derive to be stored; measured worse on DenseNet).
      substitute: emit the equivalents in :mod:`jaxmem.substitutes` for primitives whose
        XLA lowering holds large temporaries (max-pooling's derivative); same values.
      cut_cotangents: pass every backward value read by another backward region through an
        ``optimization_barrier`` where it is made (:func:`crossing_cotangents`), so XLA
        materialises it once instead of fusing its producer into each later reader.
        Default: on where a concatenation's cotangent is split across regions (measured:
        zoo DenseNet auto plan −28.5% → −60.2%, U-Net −38.6% → −41.8%), off otherwise (the
        zoo GPT's plan rose from −45.6% to −32.7% with it on).
    """
    if residuals is None:
        from jaxmem.analysis import find_residuals

        residuals = frozenset(r.value for r in find_residuals(program))
    bad = [v for v in recompute | offload if program.values[v].producer is None]
    if bad:
        raise ValueError(f"values {bad} are program inputs or constants: nothing to recompute "
                         "or offload")
    pin = narrow_residuals(program, frozenset(residuals) - frozenset(recompute)
                           - frozenset(offload)) if pin_narrow else frozenset()
    replay = _Replay(program, frozenset(recompute), frozenset(offload), frozenset(residuals),
                     prefetch=prefetch, persist=frozenset(persist) & frozenset(recompute),
                     pin=pin, region_depth=region_depth,
                     route_kept=region_depth is not None if route_kept is None else route_kept,
                     substitute=substitute, cut_cotangents=cut_cotangents)
    return replay.run
