"""Apply a :class:`~jaxmem.plan.Plan` to a whole program: the joint-jaxpr rewrite.

Fourth box of the data flow: ``Program + Plan -> new function``. A train step already holds
its backward pass, so ``jax.checkpoint`` cannot be applied to it; instead the flattened
program is replayed equation by equation and

- a residual marked RECOMPUTE is re-emitted just before the backward region that reads it,
  from the values the plan keeps, behind ``lax.optimization_barrier`` tied to that region's
  cotangents, so XLA can neither merge it back into the forward pass (CSE) nor hoist it;
- a residual marked OFFLOAD is copied to ``pinned_host`` after it is made and back to the
  device one backward region before it is read (prefetch).

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
from jaxmem.analysis import is_anchor
from jaxmem.program import Node, Program


def _region(node: Node) -> tuple[str, str]:
    return (node.phase, node.layer)


class _Replay:
    def __init__(self, program: Program, recompute: frozenset[int], offload: frozenset[int],
                 residuals: frozenset[int]) -> None:
        self.p = program
        self.recompute = recompute
        self.offload = offload
        # Values a chain may start from: program inputs, constants, kept residuals and
        # anchors (heavy outputs, units) — never a value the plan drops.
        self.kept = lambda v: v not in recompute and v not in offload and (
            v in residuals or is_anchor(program, v))

    def chain(self, targets: Sequence[int], cache: dict[int, Any]) -> tuple[list[int], list[int]]:
        """Nodes to replay for ``targets`` (program order) and the anchor values they read."""
        nodes: set[int] = set()
        anchors: dict[int, None] = {}
        stack = list(targets)
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in cache:
                continue
            if v not in targets and self.kept(v):
                anchors[v] = None
                continue
            prod = self.p.values[v].producer
            if prod is None:
                anchors[v] = None
                continue
            nodes.add(prod)
            stack.extend(self.p.nodes[prod].inputs)
        return sorted(nodes), list(anchors)

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
        last_backward: list[Any] = []
        for n in p.nodes:
            needs = [v for v in n.inputs if v in self.recompute or v in self.offload]
            if n.phase == "backward" and needs:
                if _region(n) != region:
                    region, cache = _region(n), {}
                tie = [env[v] for v in n.inputs
                       if v not in self.recompute and v not in self.offload
                       and not p.values[v].is_const] or last_backward
                self.materialise([v for v in dict.fromkeys(needs) if v not in cache],
                                 env, host, cache, tie)
                ins = [cache[v] if v in cache else env[v] for v in n.inputs]
            else:
                ins = [env[v] for v in n.inputs]
            with _jax.user_context(n.eqn.source_info.traceback, n.stack):
                outs = _jax.bind(n.eqn, *ins)
            for o, x in zip(n.outputs, outs, strict=True):
                env[o] = x
                if o in self.offload:
                    with _jax.user_context(n.eqn.source_info.traceback, n.stack):
                        host[o] = jax.device_put(x, _jax.host_space())
            if n.phase == "backward" and outs:
                last_backward = [outs[0]]
        return [env[v] for v in p.outputs]

    def materialise(self, targets: list[int], env: dict[int, Any], host: dict[int, Any],
                    cache: dict[int, Any], tie: list[Any]) -> None:
        if not targets:
            return
        fetch = [v for v in targets if v in self.offload]
        redo = [v for v in targets if v not in self.offload]
        nodes, anchors = self.chain(redo, cache) if redo else ([], [])
        anchors = [a for a in anchors if not self.p.values[a].is_const]
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
                cache[v] = jax.device_put(x, _jax.device_space())
        for i in nodes:
            n = self.p.nodes[i]
            ins = [local[v] if v in local else env[v] for v in n.inputs]
            with _jax.user_context(n.eqn.source_info.traceback, n.stack):
                outs = _jax.bind(n.eqn, *ins)
            for o, x in zip(n.outputs, outs, strict=True):
                local[o] = x
        for v in redo:
            cache[v] = local[v]


def rewrite(program: Program, recompute: frozenset[int] = frozenset(),
            offload: frozenset[int] = frozenset(),
            residuals: frozenset[int] | None = None) -> Callable[..., list[Any]]:
    """A function of the program's flat inputs that recomputes / offloads as told.

    Args:
      program: the traced program (see :func:`jaxmem.program.trace`).
      recompute: value ids to drop after the forward pass and re-create in the backward.
      offload: value ids to park in host memory between their forward and backward uses.
      residuals: all residual value ids (those not in ``recompute``/``offload`` are kept
        and may anchor chains). Defaults to the program's residuals.
    """
    if residuals is None:
        from jaxmem.analysis import find_residuals

        residuals = frozenset(r.value for r in find_residuals(program))
    bad = [v for v in recompute | offload if program.values[v].producer is None]
    if bad:
        raise ValueError(f"values {bad} are program inputs or constants: nothing to recompute "
                         "or offload")
    replay = _Replay(program, frozenset(recompute), frozenset(offload), frozenset(residuals))
    return replay.run
