"""The streamed update's layout: its groups, what each fetch waits for, what is fetched per use.

Part of the memory box (``jaxmem.memory``, layer 6), behind
:mod:`~jaxmem.memory.state_offload` (its module docstring says why the order matters). The
update's equations are split into groups, one per set of offloaded leaves read together
(adam's two moments of a parameter), put in backward order; each group's *external* inputs
(the gradients) are what its fetch is tied to. :func:`_layout` adds what the forward and
backward passes fetch per use when the parameters are offloaded too
(:mod:`jaxmem.memory.param_offload`), and the bytes of the largest group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxmem.memory import param_offload
from jaxmem.tracing.program import Program


@dataclasses.dataclass(frozen=True)
class _Group:
    inputs: tuple[int, ...]    # offloaded input value ids
    nodes: tuple[int, ...]     # node indices, program order
    outputs: tuple[int, ...]   # value ids written back to host
    after: int                 # node index of the last non-group value the group reads


def _groups(program: Program, state: frozenset[int], written: frozenset[int],
            params: frozenset[int] = frozenset()) -> list[_Group]:
    """The update split into groups (see the module docstring), in backward order. The
    ``params`` (state the model reads too) join a group only through the equations after
    the backward pass; their forward and backward reads are fetched per use."""
    start = param_offload.update_start(program) if params else 0
    parent: dict[int, int] = {s: s for s in state}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    root_of: dict[int, int] = {s: s for s in state}    # value id -> a state input it derives from
    node_root: dict[int, int] = {}
    for n in program.nodes:
        roots = {find(root_of[v]) for v in n.inputs
                 if v in root_of and (n.index >= start or v not in params)}
        if not roots:
            continue
        r, *rest = roots
        for o in rest:
            parent[find(o)] = find(r)
        r = find(r)
        node_root[n.index] = r
        for o in n.outputs:
            root_of[o] = r
    members: dict[int, list[int]] = {}
    for i, r in node_root.items():
        members.setdefault(find(r), []).append(i)
    out = []
    outputs = frozenset(program.outputs)
    for r, nodes in members.items():
        _absorb_feeders(program, nodes, node_root, outputs)
        nodes.sort()
        inside = {o for i in nodes for o in program.nodes[i].outputs}
        ins = tuple(s for s in sorted(state) if find(s) == r)
        after = -1
        for i in nodes:
            for v in program.nodes[i].inputs:
                u = program.values[v].producer
                if v not in inside and u is not None:
                    after = max(after, u)
        outs = tuple(v for v in sorted(written) if v in inside)
        out.append(_Group(ins, tuple(nodes), outs, after))
    out.sort(key=lambda g: (g.after, g.nodes[0]))
    return out


def _absorb_feeders(program: Program, nodes: list[int], taken: dict[int, int],
                    outputs: frozenset[int]) -> None:
    """Add to ``nodes`` the update equations only this group reads (adam's ``(1 - b1) * g``
    and ``(1 - b2) * g ** 2``): the group's fetch is then tied to the gradient itself, and
    XLA fuses them into the group's update instead of materialising each as a buffer."""
    mine = set(nodes)
    changed = True
    while changed:
        changed = False
        for i in list(mine):
            for v in program.nodes[i].inputs:
                u = program.values[v].producer
                if u is None or u in mine or u in taken:
                    continue
                n = program.nodes[u]
                if n.phase != "other" or any(o in outputs for o in n.outputs):
                    continue
                if all(set(program.users.get(o, ())) <= mine for o in n.outputs):
                    mine.add(u)
                    taken[u] = -1
                    changed = True
    nodes[:] = sorted(mine)


def _layout(program: Program, inputs: Sequence[int], outputs: Sequence[int],
            fractions: dict[int, float] | None = None
            ) -> tuple[frozenset[int], list[_Group], int, int, dict[int, int]]:
    """``(params, groups, largest group's bytes, bytes fetched per use, reused)``: the state
    the model reads too, the update's groups, what the forward and backward fetch, and the
    nodes that take an earlier node's outputs instead (:func:`param_offload.reuse`).
    ``fractions`` (flat position -> share of the leaf on one device) makes the byte counts
    per device for sharded state."""
    frac = {program.inputs[i]: f for i, f in (fractions or {}).items()}
    state = frozenset(program.inputs[i] for i in inputs)
    params = state & param_offload.model_reads(program)
    groups = _groups(program, state, frozenset(program.outputs[j] for j in outputs), params)
    in_group = {i for g in groups for i in g.nodes}

    def size(v: int) -> int:
        return int(program.values[v].nbytes * frac.get(v, 1.0))

    largest = max((sum(size(s) for s in g.inputs) for g in groups), default=0)
    params = param_offload.through_barriers(program, params) if params else params
    for n in program.nodes:  # a barrier's output is its input's (same sharding)
        if n.primitive == "optimization_barrier":
            frac.update((o, frac[v]) for v, o in zip(n.inputs, n.outputs, strict=False)
                        if v in frac)
    again = {i: j for i, j in param_offload.reuse(program, params).items()
             if i not in in_group and j not in in_group} if params else {}
    per_use = sum(size(v) for n in program.nodes
                  if n.index not in in_group and n.index not in again
                  for v in param_offload.reads(program, n.index, params))
    return params, groups, largest, per_use, again


def _last_gradient(program: Program, groups: list[_Group]) -> int | None:
    """The value made last among those the groups wait for (the last gradient)."""
    if not groups or groups[-1].after < 0:
        return None
    made = program.nodes[groups[-1].after].outputs
    ext = {v for g in groups for v in _external(program, g)}
    return next((v for v in made if v in ext), made[0] if made else None)


def _external(program: Program, g: _Group) -> list[int]:
    """Values made outside the group (by the forward, backward, or shared update
    equations) that the group reads: the gradients its fetch waits for."""
    inside = {o for i in g.nodes for o in program.nodes[i].outputs}
    out = []
    for i in g.nodes:
        for v in program.nodes[i].inputs:
            val = program.values[v]
            if v not in inside and val.producer is not None and v not in program.constant_derived:
                out.append(v)
    return list(dict.fromkeys(out))
