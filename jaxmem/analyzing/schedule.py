"""The order XLA's scheduler runs a program in, as the liveness model sees it.

Part of the liveness model (:mod:`jaxmem.analyzing.liveness`, second box of the data flow). A jaxpr
lists a train step as forward, backward, then the optimizer update; XLA's memory-minimising
schedulers (list, DFS and post-order on CPU; the GPU scheduler alike) do not keep that order.
Most visibly, the update of a parameter runs as soon as its gradient exists, writing the
new parameter into the donated buffer, so the gradient dies there instead of living to the
end of the backward pass.

The model: only nodes that make a buffer are scheduled (a fused elementwise node is part of
each of its readers). Going through them in program order, after each one any node that is
*ready* (every buffer it reads exists) and does not grow memory (the buffers it allocates
are at most those it frees, up to :data:`SLACK` bytes: a scalar or per-feature reduction
never holds a large buffer back) is run at once. That is the greedy rule of XLA's list
scheduler (``ListMemoryScheduler``: the ready node freeing the most bytes first), applied
only where it cannot raise the peak.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from jaxmem.tracing.program import Node, Program

__all__ = ["SLACK", "Schedule", "schedule"]

#: Bytes a hoisted node may allocate beyond what it frees (scalars, small vectors).
SLACK = 4096


class Schedule:
    """A run order and, per buffer, the position of its last reader in that order.

    Attributes:
      order: node indices that make a buffer, in run order.
      position: node index -> position in :attr:`order` (fused nodes take their first
        reader's position).
      reads: node index -> the buffers (value ids) it reads, directly or through fused values.
    """

    def __init__(self, order: list[int], position: dict[int, int],
                 reads: dict[int, frozenset[int]]) -> None:
        self.order, self.position, self.reads = order, position, reads

    def last_use(self, program: Program) -> dict[int, int]:
        """Buffer value id -> position of its last reader (outputs: the end)."""
        last: dict[int, int] = {}
        for n, ins in self.reads.items():
            p = self.position[n]
            for v in ins:
                if last.get(v, -1) < p:
                    last[v] = p
        end = len(self.order)
        for v in program.outputs:
            last[v] = end
        return last

    def made_at(self, values: frozenset[int]) -> dict[int, int]:
        """Value id -> the position of its first reader, for ``values`` (those made right
        before they are read: late values) that are read."""
        first: dict[int, int] = {}
        for n, ins in self.reads.items():
            p = self.position[n]
            for v in ins & values:
                if first.get(v, p + 1) > p:
                    first[v] = p
        return first


def _is_barrier(node: Node) -> bool:
    return (node.primitive == "optimization_barrier"
            and len(node.inputs) == len(node.outputs))


def _sources(node: Node, v: int) -> Sequence[int]:
    """The inputs of ``node`` that its output ``v`` is computed from: all of them, but for
    ``optimization_barrier``, whose ``k``-th output is its ``k``-th operand (XLA's tuple
    of the operands' own buffers: each lives as long as its own readers, not as long as
    the latest reader of any operand bundled with it)."""
    if _is_barrier(node):
        return (node.inputs[node.outputs.index(v)],)
    return node.inputs


def _reads(program: Program, mat: Sequence[bool], late: frozenset[int] = frozenset(),
           whole: bool = False) -> dict[int, frozenset[int]]:
    """Per buffer-making node, the buffers it reads (through fused values). A *late*
    value (:func:`jaxmem.analyzing.liveness.buffers`) is read as a buffer only through the
    barrier that holds it, whose readers also read what it is made from (it is made right
    before them); its other readers fuse it. ``whole``: what each node waits for instead,
    every operand of a barrier whose output it reads (no output of a barrier exists
    before all its operands do: the ordering the rewrite's barriers exist for)."""
    walk = _Reads(program, mat, late, whole)
    out_set = set(program.outputs)
    reads = {}
    for n in program.nodes:
        if any(mat[o] or o in out_set for o in n.outputs) or not n.outputs:
            reads[n.index] = frozenset().union(*map(walk.expand, n.inputs))
    return reads


class _Reads:
    """:func:`_reads`' walk through fused values, memoised. (Methods, not two closures
    calling each other: those are a reference cycle, which held the memo and the program
    until the collector ran.)"""

    def __init__(self, program: Program, mat: Sequence[bool], late: frozenset[int],
                 whole: bool) -> None:
        self.memo: dict[int, frozenset[int]] = {}
        self.values, self.nodes = program.values, program.nodes
        self.mat, self.late, self.whole = mat, late, whole

    def inputs(self, v: int) -> frozenset[int]:
        node = self.nodes[self.values[v].producer]
        src = node.inputs if self.whole else _sources(node, v)
        if len(src) == 1:   # most fused chains: the set itself (immutable), not a copy
            return self.expand(src[0])
        return frozenset().union(*map(self.expand, src))

    def expand(self, v: int) -> frozenset[int]:
        got = self.memo.get(v)
        if got is not None:
            return got
        val = self.values[v]
        if v in self.late:
            got = self.inputs(v)
        elif val.producer is None or self.mat[v]:
            got = frozenset((v,))
        else:
            node = self.nodes[val.producer]
            src = _sources(node, v)[0] if _is_barrier(node) else None
            got = (frozenset((src,)) | self.inputs(src) if src in self.late
                   else self.inputs(v))
            if self.whole and src is not None:
                got |= self.inputs(v)
        self.memo[v] = got
        return got


def schedule(program: Program, mat: Sequence[bool], aliased: frozenset[int] = frozenset(),
             late: frozenset[int] = frozenset()) -> Schedule:
    """The run order of ``program``'s buffer-making nodes (see the module docstring).

    ``mat``: per value, whether it has a buffer (:func:`jaxmem.analyzing.liveness.materialised`);
    ``aliased``: outputs written into donated inputs (they allocate nothing); ``late``:
    values made right before the readers of the barrier that holds them
    (:func:`jaxmem.analyzing.liveness.buffers`, :meth:`Schedule.made_at`).
    """
    values, nodes = program.values, program.nodes
    reads = _reads(program, mat, late)
    deps = (_reads(program, mat, late, whole=True)
            if any(_is_barrier(n) for n in nodes) else reads)
    out_set = set(program.outputs)
    readers: dict[int, list[int]] = defaultdict(list)  # buffer -> nodes reading it
    waiters: dict[int, list[int]] = defaultdict(list)  # buffer -> nodes waiting for it
    waiting: dict[int, int] = {}
    for n, ins in reads.items():
        for v in ins:
            if values[v].producer is not None:
                readers[v].append(n)
    for n, ins in deps.items():
        made = [v for v in ins | reads[n] if values[v].producer is not None]
        waiting[n] = len({values[v].producer for v in made})
        for v in made:
            waiters[v].append(n)
    remaining = {v: len(r) for v, r in readers.items()}
    alloc = {n: sum(values[o].nbytes for o in nodes[n].outputs
                    if mat[o] and o not in aliased) for n in reads}
    placed: set[int] = set()
    order: list[int] = []

    def net(n: int) -> int:
        freed = sum(values[v].nbytes for v in reads[n]
                    if values[v].producer is not None and remaining[v] == 1
                    and v not in out_set)
        return alloc[n] - freed

    def place(n: int) -> None:
        stack = [n]
        while stack:
            k = stack.pop()
            if k in placed or waiting[k]:
                continue
            placed.add(k)
            order.append(k)
            cand: list[int] = []
            for v in reads[k]:
                if v in remaining:
                    remaining[v] -= 1
                    if remaining[v] == 1:
                        cand.extend(readers[v])
            # each node waits once per producer, however many of its outputs it reads
            for r in dict.fromkeys(r for o in nodes[k].outputs for r in waiters.get(o, ())):
                waiting[r] -= 1
                cand.append(r)
            for r in dict.fromkeys(cand):
                if r not in placed and not waiting[r] and net(r) <= SLACK:
                    stack.append(r)

    for n in sorted(reads):
        if n not in placed:
            place(n)
    position = {n: i for i, n in enumerate(order)}
    # a fused node sits with its first reader
    for n in nodes:
        if n.index not in position:
            position[n.index] = len(order)
    return Schedule(order, position, reads)
