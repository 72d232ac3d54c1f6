"""Layers and blocks from a program's structure, for programs whose name stacks say little.

Part of the first box (``fn + args -> Program``): :func:`label` gives each forward and
backward node a layer path made from the dataflow, so that the regions and blocks the
planners and the rewrite cut by layer path (:func:`jaxmem.program.region_of`,
:func:`jaxmem.planning.strategies.block_depths`) exist for haiku, equinox and plain ``jax.numpy``
models as they do for flax ones.

- A *residual add* is a forward ``add`` of two same-shape floating values that share an
  ancestor and lie at different heavy depths (the number of matmuls/convolutions on the
  longest path from the inputs): a block's output added to the running value it was computed
  from (ResNet shortcuts, a transformer's residual stream). A bias, a mask or a normalisation
  offset shares no ancestor with what it is added to; the inner adds of GELU or RoPE sit at
  one depth.
- A *block* is the run of forward nodes up to and including one residual add
  (``res3``); a *layer* starts at each heavy node (``res3/layer1``). Without residual adds,
  each layer is its own block (``layer7``). Where the names put runs of residual blocks
  under one module (penzai's ``TransformerBlock`` around its attention and MLP residuals),
  the module is a level above them (``blk1/res3/layer1``: :func:`_named_groups`).
- A backward node takes the layer of the forward values it reads (the latest of them in
  forward order; a parameter belongs to the layer that first reads it), else the layer of
  the backward node before it: JAX's transpose runs layer by layer in reverse.

Names, where present, only label: the original layer path is kept after the structural one
(``res3/layer1[multi_head_attention_1.query]``) and in :attr:`Node.name_stack`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from jaxmem.tracing import primitives as P
from jaxmem.tracing.program import Node, Program

__all__ = ["label", "names_informative", "residual_adds"]

_ADDS = frozenset({"add", "add_any"})
#: Above this many forward nodes the ancestor sets (one bitset per value) are not built and
#: no residual add is reported: names, or no blocks, as before this module.
_MAX_FORWARD = 20_000


def _heavy_depths(program: Program) -> dict[int, int]:
    """Value id -> heavy nodes on the longest path from the program's inputs to it."""
    depth: dict[int, int] = {}
    for n in program.nodes:
        d = max((depth.get(v, 0) for v in n.inputs), default=0)
        d += n.kind == P.Kind.HEAVY
        for o in n.outputs:
            depth[o] = d
    return depth


def _ancestors(program: Program, upto: int) -> dict[int, int]:
    """Value id -> bitset (a Python int over value ids) of its ancestors, for the values of
    the first ``upto`` nodes and the inputs."""
    anc: dict[int, int] = {}
    for n in program.nodes[:upto]:
        a = 0
        for v in n.inputs:
            if not program.values[v].is_const:
                a |= anc.get(v, 0) | (1 << v)
        for o in n.outputs:
            anc[o] = a
    return anc


def _is_float(program: Program, v: int) -> bool:
    dt = program.values[v].dtype
    return dt.startswith(("float", "bfloat", "complex"))


def residual_adds(program: Program) -> tuple[int, ...]:
    """Indices of the forward nodes that add a block's output to the value it came from."""
    forward = [n for n in program.nodes if n.phase == "forward"]
    if not forward or len(forward) > _MAX_FORWARD:
        return ()
    depth = _heavy_depths(program)
    anc = _ancestors(program, forward[-1].index + 1)
    out = []
    for n in forward:
        if n.primitive not in _ADDS or len(n.inputs) != 2:
            continue
        a, b = n.inputs
        va, vb = program.values[a], program.values[b]
        if va.shape != vb.shape or not va.shape or int(np.prod(va.shape)) < 2:
            continue
        if not (_is_float(program, a) and _is_float(program, b)):
            continue
        if depth.get(a, 0) == depth.get(b, 0):
            continue
        fa = anc.get(a, 0) | (1 << a)
        fb = anc.get(b, 0) | (1 << b)
        if fa & fb:
            out.append(n.index)
    return tuple(out)


def names_informative(program: Program) -> bool:
    """Whether the name stacks already give the forward pass layers and blocks: every heavy
    forward node has a layer path of its own, and no residual add is left at the top level
    (outside every named module, as in a haiku or plain ``jax.numpy`` model written as one
    function)."""
    heavy = [n.layer for n in program.nodes if n.phase == "forward" and n.kind == P.Kind.HEAVY]
    if len(heavy) < 3:
        return True  # too small to have blocks either way
    counts = Counter(heavy)
    if "" in counts or max(counts.values()) > 1:
        return False
    return all(program.nodes[i].layer for i in residual_adds(program))


def _forward_labels(program: Program) -> dict[int, str]:
    adds = set(residual_adds(program))
    labels: dict[int, str] = {}
    res_of: dict[int, int] = {}
    block, layer = 0, -1
    for n in program.nodes:
        if n.phase != "forward":
            continue
        if n.kind == P.Kind.HEAVY or layer < 0:
            layer += 1
            if not adds:
                block = layer
        labels[n.index] = (f"res{block}/layer{layer}" if adds else f"layer{layer}")
        res_of[n.index] = block
        if n.index in adds:
            block, layer = block + 1, -1
    group = _named_groups(program, res_of) if adds else None
    if group is None:
        return labels
    return {i: f"blk{group[res_of[i]]}/{lab}" for i, lab in labels.items()}


def _named_groups(program: Program, res_of: dict[int, int]) -> dict[int, int] | None:
    """Residual block -> group, where the names put runs of consecutive residual blocks
    under one module (a transformer block's attention and MLP residuals, each its own
    residual add, under one ``TransformerBlock``); None where they do not.

    A residual block's name is the part of its first heavy node's name path after what
    every such path shares (none without names or a heavy node: a group of its own).
    Groups only where they are clean and add a level: every name is one run of
    consecutive blocks, at least three groups, and one group holds two blocks or more.
    The group is then the block of the coarsest depth (``blk2/res5/layer1``): a block
    plan at depth 1 keeps one value per transformer block, as ``jax.checkpoint`` around
    each block does, where per residual it keeps two."""
    path: dict[int, list[str]] = {}
    for n in program.nodes:
        if n.index in res_of and n.kind == P.Kind.HEAVY and res_of[n.index] not in path:
            path[res_of[n.index]] = n.layer.split("/") if n.layer else []
    named = [p for p in path.values() if p]
    common = 0  # parts every name shares (an outer module around the whole model)
    while named and all(len(p) > common + 1 and p[common] == named[0][common]
                        for p in named):
        common += 1
    key = {b: p[common] if len(p) > common else None for b, p in path.items()}
    group: dict[int, int] = {}
    seen: set[str] = set()
    g, prev = -1, None
    for b in sorted(set(res_of.values())):
        k = key.get(b)
        if k is None or k != prev:
            if k is not None and k in seen:
                return None  # a name split into runs: not a module around blocks
            g += 1
            if k is not None:
                seen.add(k)
        group[b], prev = g, k
    sizes = Counter(group.values())
    if g + 1 < 3 or max(sizes.values()) < 2:
        return None
    return group


def _with_name(structural: str, node: Node) -> str:
    return f"{structural}[{node.layer.replace('/', '.')}]" if node.layer else structural


def label(program: Program, *, force: bool = False) -> Program:
    """``program`` with structural layer paths where its names do not tell layers apart.

    Returns ``program`` itself when :func:`names_informative` (flax's module paths) and not
    ``force``, or when it has no backward pass.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.tracing import program, structure
      >>> def loss(ws, x):
      ...     for w in ws:
      ...         x = x + jnp.tanh(x @ w)
      ...     return jnp.sum(x ** 2)
      >>> p = program.trace(jax.grad(loss), [jnp.eye(4)] * 3, jnp.ones((2, 4)))
      >>> len(structure.residual_adds(p))
      3
      >>> sorted({n.layer for n in structure.label(p).nodes if n.phase == "forward"})[:2]
      ['res0/layer0', 'res1/layer0']
    """
    if not program.has_backward or (not force and names_informative(program)):
        return program
    fwd = _forward_labels(program)
    # Layer of each value for the backward pass: a forward output -> its node's layer; an
    # input -> the layer of its first forward reader (parameters belong to their layer).
    order = {lab: i for i, lab in enumerate(dict.fromkeys(fwd.values()))}
    of_value: dict[int, str] = {}
    for n in program.nodes:
        if n.index in fwd:
            for v in n.inputs:
                if program.values[v].producer is None and not program.values[v].is_const:
                    of_value.setdefault(v, fwd[n.index])
            for o in n.outputs:
                of_value[o] = fwd[n.index]
    nodes = list(program.nodes)
    current: str | None = None
    for n in program.nodes:
        if n.index in fwd:
            nodes[n.index] = dataclasses.replace(n, layer=_with_name(fwd[n.index], n))
            continue
        if n.phase != "backward":
            continue
        read = [of_value[v] for v in n.inputs
                if v in of_value and (program.values[v].producer is None
                                      or program.values[v].producer in fwd)]
        if read:
            current = max(read, key=order.__getitem__)
        if current is not None:
            nodes[n.index] = dataclasses.replace(n, layer=_with_name(current, n))
    return dataclasses.replace(program, nodes=tuple(nodes))
