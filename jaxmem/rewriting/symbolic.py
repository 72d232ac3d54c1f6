"""A plan's rewritten program built without tracing it (fourth box, for the analysis).

``verify`` ranks candidate plans by the liveness of each one's rewritten step
(:func:`jaxmem.compiling.choose.rewritten_liveness`). Tracing a rewrite with JAX (every
equation bound again under its name stack, then flattened by
:func:`jaxmem.tracing.program.from_jaxpr`) cost about half a second a candidate on a
ResNet18 or GPT-2 train step, and a crowd of a dozen candidates was analysed before the
first compile could start. The rewrite's replay (:mod:`jaxmem.rewriting.rewrite`) emits
through a small set of operations; :class:`Symbolic` implements them on a
:class:`~jaxmem.tracing.program.Program` under construction instead of on JAX tracers:

- a re-bound equation becomes a node with the traced equation's primitive, params and
  output types, under the name stack the replay binds it under (so its phase and layer
  are the ones a trace would give);
- an ``optimization_barrier`` becomes one node over the tree's leaves;
- a substitute (:mod:`jaxmem.rewriting.substitutes`) is traced on its operands' types
  alone (``jax.make_jaxpr``, a few equations) and its equations inlined under the node's
  name stack, as :func:`~jaxmem.tracing.program.from_jaxpr` inlines a ``jit``.

The program so built has the nodes, values and order of the traced rewrite's
(``tests/test_symbolic.py`` checks node for node on the zoo's plans). Host offload
(``jax.device_put`` between memory spaces) is not built: :class:`Unsupported` is raised,
and the caller traces the rewrite as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxmem import _jax
from jaxmem.analyzing.chains import chain_start, replay_nodes
from jaxmem.planning.plan import Plan
from jaxmem.rewriting.rewrite import kept_by, replay
from jaxmem.tracing.primitives import Kind
from jaxmem.tracing.program import Node, Program, Value, _Builder

__all__ = ["Symbolic", "Unsupported", "rewritten_program"]


class Unsupported(NotImplementedError):
    """The rewrite emits something :class:`Symbolic` does not build (a host copy)."""


class TooLarge(Exception):  # noqa: N818 - a signal to the caller, not an error
    """The rewritten program passed the ``limit`` of nodes it was built with: it was not
    finished (its size is known to be over the limit, not what it is)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit:,} nodes")
        self.limit = limit


class _Var:
    """A barrier's operand or result: its type (hashed by identity, as a jaxpr's
    ``Var``)."""

    __slots__ = ("aval",)

    def __init__(self, aval: Any):
        self.aval = aval


class _Eqn:
    """An equation as the program's nodes and JAX's staging rules read one: primitive,
    params, effects and typed operands and results."""

    __slots__ = ("effects", "invars", "outvars", "params", "primitive")

    def __init__(self, primitive: Any, params: dict[str, Any], in_avals: list[Any],
                 out_avals: list[Any]):
        self.primitive, self.params, self.effects = primitive, params, frozenset()
        self.invars = [_Var(a) for a in in_avals]
        self.outvars = [_Var(a) for a in out_avals]


class _Const:
    """A constant as JAX's trace holds it: read as a literal of each equation (a scalar),
    or as one constant variable of the jaxpr (an array; :func:`_jax.inlined_as_literal`)."""

    __slots__ = ("aval", "const", "literal")

    def __init__(self, aval: Any, const: Any):
        self.aval, self.const = aval, const
        self.literal = _jax.inlined_as_literal(const)


@dataclasses.dataclass
class _Shared:
    """What every build from one program works out alike: its constants, each node's
    forwarding, each substitute's jaxpr (by node index)."""

    consts: dict[int, _Const] = dataclasses.field(default_factory=dict)
    forwards: dict[int, tuple[Any, bool]] = dataclasses.field(default_factory=dict)
    substitutes: dict[int, Any] = dataclasses.field(default_factory=dict)


_SHARED: weakref.WeakKeyDictionary[Program, _Shared] = weakref.WeakKeyDictionary()


def _shared(program: Program) -> _Shared:
    if program not in _SHARED:
        _SHARED[program] = _Shared()
    return _SHARED[program]


class Symbolic:
    """The replay's operations (:class:`jaxmem.rewriting.emitters.Traced`'s) on a program
    under construction: values are the new program's value ids, constants
    :class:`_Const`\\ s (a value is made for each where it is read, as
    :func:`~jaxmem.tracing.program.from_jaxpr` makes one for each literal)."""

    def __init__(self, program: Program, limit: int | None = None):
        self.p = program
        self.limit = limit   # the most nodes to build (TooLarge past it); None: no limit
        self.b = _Builder()
        self.ambient = _jax.current_name_stack()  # what a barrier outside a node gets
        self.at: list[Node | None] = [None]  # the node being emitted (context)
        self.inputs = [self.b.value(program.values[v].aval, None, input_index=i)
                       for i, v in enumerate(program.inputs)]
        self.constvars: dict[int, int] = {}   # id(_Const) -> its value, for the arrays
        self.shared = _shared(program)

    def read(self, x: Any) -> int:
        """The value an equation reads for ``x`` (a constant's value made here)."""
        if not isinstance(x, _Const):
            return x
        if x.literal:
            return self.b.value(x.aval, None, const=x.const, is_const=True)
        if id(x) not in self.constvars:
            self.constvars[id(x)] = self.b.value(x.aval, None, const=x.const, is_const=True)
        return self.constvars[id(x)]

    def aval(self, x: Any) -> Any:
        return x.aval if isinstance(x, _Const) else self.b.values[x].aval

    def bind(self, eqn: Any, ins: list[Any]) -> list[Any]:
        # what JAX's jaxpr trace does on binding, in its order: fold constants, then
        # forward an output that is an input (no equation where every output is)
        fold, forward = _jax.staging_rules(eqn.primitive)
        if fold is not None and any(isinstance(x, _Const) for x in ins):
            out_avals = [v.aval for v in eqn.outvars]
            consts = fold([x.const if isinstance(x, _Const) else None for x in ins],
                          eqn.params, out_avals)
            if consts is not None:
                return [_Const(a, c) for c, a in zip(consts, out_avals, strict=True)]
        n = self.at[-1]
        again = n is not None and eqn is n.eqn   # a node of the program re-bound
        fwd: Any = None
        if forward is not None and not eqn.effects:
            # a node's decision rests on its types and params alone: made once a program
            if again and n.index in self.shared.forwards:
                fwd, whole = self.shared.forwards[n.index]
            else:
                fwd, kept = forward(_Eqn(eqn.primitive, eqn.params,
                                         [self.aval(x) for x in ins], []))
                whole = kept is None
                if again:
                    self.shared.forwards[n.index] = (fwd, whole)
            if whole:
                return [ins[k] for k in fwd]
        read = [self.read(x) for x in ins]
        if again:
            self._copy(n, read)   # the traced node's figures
        else:
            self.b.node(eqn, read, self.stack(), {})
        if self.limit is not None and len(self.b.nodes) > self.limit:
            raise TooLarge(self.limit)
        outs = self.b.nodes[-1].outputs
        if fwd is None:
            return list(outs)
        return [o if k is None else ins[k] for o, k in zip(outs, fwd, strict=True)]

    def _copy(self, n: Node, ins: list[int]) -> None:
        """Node ``n`` of the program, made again on ``ins``: what
        :meth:`~jaxmem.tracing.program._Builder.node` would make of its equation under its
        name stack (the same primitive, params, types and stack), without working it out
        again."""
        b, index = self.b, len(self.b.nodes)
        outs = []
        for o in n.outputs:
            v = self.p.values[o]
            outs.append(len(b.values))
            b.values.append(Value(id=outs[-1], shape=v.shape, dtype=v.dtype, nbytes=v.nbytes,
                                  producer=index, memory_space=v.memory_space, aval=v.aval))
        if n.kind is Kind.UNKNOWN:
            b.unknown[n.primitive] = None
        b.nodes.append(Node(
            index=index, primitive=n.primitive, inputs=tuple(ins), outputs=tuple(outs),
            kind=n.kind, phase=n.phase, layer=n.layer, flops=n.flops,
            bytes_moved=n.bytes_moved, name_stack=n.name_stack, trip_count=n.trip_count,
            eqn=n.eqn, stack=n.stack))

    def substitute(self, fn: Callable[..., list[Any]], ins: list[Any]) -> list[Any]:
        # a substitute is a function of its node's equation: traced once a program
        n = self.at[-1]
        closed = self.shared.substitutes.get(n.index) if n is not None else None
        if closed is None:
            avals = [self.aval(x) for x in ins]
            closed = jax.make_jaxpr(fn)(
                *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
            if n is not None:
                self.shared.substitutes[n.index] = closed
        env = dict(zip(closed.jaxpr.invars, map(self.read, ins), strict=True))
        self.b.walk(closed.jaxpr, closed.consts, env, self.stack())
        return [self.b.read(env, v) for v in closed.jaxpr.outvars]

    def barrier(self, tree: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(
            tree, is_leaf=lambda x: isinstance(x, _Const))
        avals = [self.aval(x) for x in leaves]
        eqn = _Eqn(_jax.optimization_barrier_p, {}, avals, avals)
        return jax.tree_util.tree_unflatten(treedef, self.bind(eqn, leaves))

    def to_host(self, x: Any) -> Any:
        raise Unsupported("host offload is traced, not built")

    to_device = to_host

    def stack(self) -> Any:
        """The name stack the replay binds under now: the node's being emitted, or the
        trace's own outside any."""
        n = self.at[-1]
        return self.ambient if n is None else n.stack

    @contextlib.contextmanager
    def context(self, n: Node) -> Iterator[None]:
        self.at.append(n)
        try:
            yield
        finally:
            self.at.pop()

    def const(self, v: Value) -> _Const:
        if v.id not in self.shared.consts:
            self.shared.consts[v.id] = _Const(v.aval, v.const)
        return self.shared.consts[v.id]

    def program(self, outs: list[Any]) -> Program:
        """The program built, returning ``outs``: numbered as
        :func:`~jaxmem.tracing.program.from_jaxpr` numbers a trace's (the jaxpr's constant
        variables right after its inputs)."""
        outputs = [self.read(x) for x in outs]
        b = self.b
        nodes, values = b.nodes, b.values
        if self.constvars:
            nodes, values, outputs = _constvars_first(
                nodes, values, len(self.inputs), set(self.constvars.values()), outputs)
        return Program(nodes=tuple(nodes), values=tuple(values), inputs=tuple(self.inputs),
                       outputs=tuple(outputs), in_tree=self.p.in_tree,
                       out_tree=self.p.out_tree, unknown_primitives=tuple(b.unknown))


def _constvars_first(nodes: list[Node], values: list[Value], n_inputs: int,
                     constvars: set[int], outputs: list[int]
                     ) -> tuple[list[Node], list[Value], list[int]]:
    """``nodes`` and ``values`` numbered again with the ``constvars`` right after the
    inputs, in the order they are first read, the rest in the order made."""
    order = list(range(n_inputs))
    seen = set(order)
    for n in nodes:
        for v in n.inputs:
            if v in constvars and v not in seen:
                order.append(v)
                seen.add(v)
    order += [v for v in outputs if v in constvars and v not in seen]
    seen.update(order)
    order += [v.id for v in values if v.id not in seen]
    new = {old: k for k, old in enumerate(order)}
    values = [dataclasses.replace(values[old], id=k) for k, old in enumerate(order)]
    nodes = [dataclasses.replace(n, inputs=tuple(new[v] for v in n.inputs),
                                 outputs=tuple(new[v] for v in n.outputs)) for n in nodes]
    return nodes, values, [new[v] for v in outputs]


#: How far past the ``limit`` of :func:`rewritten_program` a rewrite's size estimated from
#: its replay chains (:func:`~jaxmem.analyzing.chains.replay_nodes`, plus the step's own
#: nodes) must be for it not to be built at all: the estimate leaves out the barriers (it
#: errs low) and counts constants the build folds (it may err a little high;
#: ``tests/test_symbolic.py::test_a_rewrite_estimated_far_past_its_limit_is_not_built``
#: holds it within 5% above and 30% below the built program on the zoo GPT's candidates).
#: MEDL's per-layer plan of GPT-2 small, past the limit, was built to it before it was
#: found too large.
ESTIMATE_MARGIN = 1.2


def _replayed(program: Program, plan: Plan) -> int:
    """The nodes the rewrite of ``plan`` replays, its chains starting where the replay's
    do (:func:`jaxmem.rewriting.rewrite.kept_by`)."""
    return replay_nodes(program, plan.recompute,
                        chain_start(program, dropped=plan.recompute, kept=kept_by(plan)),
                        plan.region_depth)


def rewritten_program(program: Program, plan: Plan, limit: int | None = None,
                      **options: Any) -> Program:
    """The program :func:`jaxmem.rewriting.rewrite.apply` ``(program, plan, **options)``
    traces to, built by replaying the plan symbolically (:class:`Symbolic`). Raises
    :class:`Unsupported` for a plan that offloads, :class:`TooLarge` where it passes
    ``limit`` nodes (not built further), or where its replay chains put it past
    :data:`ESTIMATE_MARGIN` times ``limit`` (not built at all)."""
    if plan.offload:
        raise Unsupported("host offload is traced, not built")
    if limit is not None and len(program.nodes) + _replayed(program, plan) > \
            ESTIMATE_MARGIN * limit:
        raise TooLarge(limit)   # past it by more than the estimate errs: not built at all
    ops = Symbolic(program, limit)
    return ops.program(replay(program, plan, ops=ops, **options).run(*ops.inputs))

