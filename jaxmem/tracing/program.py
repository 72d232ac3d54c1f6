"""Trace a function into a :class:`Program`: its jaxpr flattened into annotated nodes.

This is the first box of jaxmem's data flow (DESIGN.md): ``fn + args -> Program``. Nested
``jit`` calls are inlined, so the analysis sees through ``jax.nn`` helpers and user jits;
control flow (``scan``, ``while``, ``cond``) and custom-derivative calls stay whole, as
*units* whose inputs, outputs, bytes and FLOPs (times the trip count) are known.

Each node records its primitive, avals, bytes, estimated FLOPs and bytes moved, the layer
path from the name stack (``MLP/Dense_0``, ``ResNetBlock_3/Conv_1``) and its phase:
``forward`` (under ``jvp``), ``backward`` (under ``transpose``) or ``other`` (optimizer
update, loss glue outside the differentiated function).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from jaxmem import _jax
from jaxmem.tracing import primitives as P

Phase = Literal["forward", "backward", "other"]


class TraceError(ValueError):
    """The function could not be traced into a jaxpr for the given arguments."""


@dataclasses.dataclass(frozen=True)
class Value:
    """One array in the program: an input, a constant, or a node's output."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: int | None  # index of the node that makes it; None for inputs and constants
    input_index: int | None = None  # position among the program's flat inputs
    memory_space: str | None = None
    aval: Any = dataclasses.field(default=None, repr=False, compare=False)
    const: Any = dataclasses.field(default=None, repr=False, compare=False)
    is_const: bool = False

    @property
    def is_input(self) -> bool:
        return self.input_index is not None


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One primitive application (or one control-flow unit) in program order."""

    index: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    kind: P.Kind
    phase: Phase
    layer: str
    flops: float
    bytes_moved: float
    name_stack: str
    trip_count: int = 1
    eqn: Any = dataclasses.field(default=None, repr=False)
    stack: Any = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A flattened, annotated jaxpr. Plain data: build it with :func:`trace`."""

    nodes: tuple[Node, ...]
    values: tuple[Value, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    in_tree: Any = dataclasses.field(repr=False)
    out_tree: Any = dataclasses.field(repr=False)
    jaxpr: Any = dataclasses.field(default=None, repr=False)
    unknown_primitives: tuple[str, ...] = ()

    @functools.cached_property
    def users(self) -> dict[int, tuple[int, ...]]:
        """Value id -> indices of the nodes that read it, in program order."""
        out: dict[int, list[int]] = {}
        for n in self.nodes:
            for v in dict.fromkeys(n.inputs):
                out.setdefault(v, []).append(n.index)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def constant_derived(self) -> frozenset[int]:
        """Ids of values made by cheap, effect-free equations from constants alone (a
        broadcast zero, an iota).

        XLA re-derives such a value inside every fusion that reads it, so it is never a
        stored residual; holding it anywhere (a barrier operand) would only materialise it.
        """
        out: set[int] = set()
        for n in self.nodes:
            if n.kind not in P.CHEAP or getattr(n.eqn, "effects", None):
                continue
            if all(self.values[v].is_const or v in out for v in n.inputs):
                out.update(n.outputs)
        return frozenset(out)

    def crossing(self, phase: Phase, depth: int | None = None) -> frozenset[int]:
        """Ids of values made by ``phase`` nodes of one region and read by ``phase`` nodes of
        another (regions: layer paths cut to ``depth`` parts, :func:`region_of`); values made
        from constants alone are left out."""
        out: set[int] = set()
        for n in self.nodes:
            if n.phase != phase:
                continue
            here = region_of(n, depth)
            for v in n.inputs:
                u = self.values[v].producer
                if u is not None and self.nodes[u].phase == phase and \
                        region_of(self.nodes[u], depth) != here and \
                        v not in self.constant_derived:
                    out.add(v)
        return frozenset(out)

    @property
    def has_backward(self) -> bool:
        return any(n.phase == "backward" for n in self.nodes)

    @property
    def flops(self) -> float:
        return float(sum(n.flops for n in self.nodes))

    def __str__(self) -> str:
        phases = {p: sum(n.phase == p for n in self.nodes)
                  for p in ("forward", "backward", "other")}
        return (f"Program({len(self.nodes)} nodes: {phases['forward']} forward, "
                f"{phases['backward']} backward, {phases['other']} other; "
                f"{len(self.inputs)} inputs, {len(self.outputs)} outputs, "
                f"{self.flops / 1e9:.3f} GFLOP)")


def region_of(node: Node, depth: int | None = None) -> tuple[str, str]:
    """A node's region key, (phase, layer path cut to ``depth`` parts): the rewrite replays
    chains once per run of backward nodes with one key, and the planner's cost model counts
    them the same way."""
    if depth is None:
        return (node.phase, node.layer)
    return (node.phase, "/".join(node.layer.split("/")[:depth]))


def phase_of(stack: Any) -> Phase:
    t = _jax.transforms_of(stack)
    if "transpose" in t:
        return "backward"
    if "jvp" in t:
        return "forward"
    return "other"


def layer_of(stack: Any) -> str:
    return "/".join(_jax.scopes_of(stack))


# --- costs of nested jaxprs ---------------------------------------------------------------

def _unit_kind_and_flops(eqn: Any) -> tuple[P.Kind, float, int]:
    """Kind, FLOPs (trip count included) and trip count of a control-flow unit."""
    name = eqn.primitive.name
    subs = _jax.sub_jaxprs(eqn)
    costs = [_jaxpr_cost(j) for j in subs]
    kinds = {k for k, _ in costs}
    trips = 1
    if name == "scan":
        trips = int(eqn.params.get("length", 1))
        total = sum(f for _, f in costs) * trips
    elif name == "cond":
        total = max((f for _, f in costs), default=0.0)
    else:
        total = sum(f for _, f in costs)
    if P.Kind.HEAVY in kinds:
        kind = P.Kind.HEAVY
    elif P.Kind.UNKNOWN in kinds or P.Kind.CONTROL in kinds:
        kind = P.Kind.CONTROL
    elif name in ("scan", "while"):
        kind = P.Kind.CONTROL  # loops are kept whole; their bodies are remat'd by the policy
    else:
        kind = P.Kind.UTILITY
    return kind, total, trips


@functools.lru_cache(maxsize=4096)
def _jaxpr_cost_cached(jaxpr: Any) -> tuple[P.Kind, float]:
    kinds: set[P.Kind] = set()
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if _jax.sub_jaxprs(eqn):
            k, f, _ = _unit_kind_and_flops(eqn)
        else:
            k = P.classify(name)
            f = P.flops(name, [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars],
                        eqn.params)
        kinds.add(k)
        total += f
    if P.Kind.HEAVY in kinds:
        return P.Kind.HEAVY, total
    if P.Kind.UNKNOWN in kinds or P.Kind.CONTROL in kinds:
        return P.Kind.CONTROL, total
    return P.Kind.UTILITY, total


def _jaxpr_cost(jaxpr: Any) -> tuple[P.Kind, float]:
    try:
        return _jaxpr_cost_cached(jaxpr)
    except TypeError:  # unhashable
        return _jaxpr_cost_cached.__wrapped__(jaxpr)


# --- flattening ---------------------------------------------------------------------------

#: ``str`` of each dtype met (numpy's ``dtype.__str__`` is slow: it was a sixth of
#: :func:`from_jaxpr`'s time on the rewritten steps ``verify`` analyses).
_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = str(dtype)
        return name
    except TypeError:  # unhashable
        return str(dtype)


def _figures(aval: Any) -> tuple[tuple[int, ...], str, int, str | None]:
    """A value's shape, dtype's name, bytes (per device) and memory space, from its type."""
    space = _jax.aval_memory_space(aval)
    return (tuple(getattr(aval, "shape", ())), _dtype_name(getattr(aval, "dtype", "")),
            P.nbytes(aval), None if space is None else str(space))


class _Builder:
    def __init__(self) -> None:
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.unknown: dict[str, None] = {}
        self._typed: dict[Any, tuple[Any, ...]] = {}   # aval -> its value's figures

    def value(self, aval: Any, producer: int | None, **kw: Any) -> int:
        vid = len(self.values)
        try:   # worked out once per type (a program has few; it makes many values)
            shape, dtype, nbytes, space = self._typed[aval]
        except KeyError:
            shape, dtype, nbytes, space = self._typed[aval] = _figures(aval)
        except TypeError:   # an unhashable aval
            shape, dtype, nbytes, space = _figures(aval)
        self.values.append(Value(id=vid, shape=shape, dtype=dtype, nbytes=nbytes,
                                 producer=producer, aval=aval, memory_space=space, **kw))
        return vid

    def literal(self, lit: Any) -> int:
        return self.value(lit.aval, None, const=lit.val, is_const=True)

    def read(self, env: dict[Any, int], x: Any) -> int:
        return self.literal(x) if _jax.is_literal(x) else env[x]

    def walk(self, jaxpr: Any, consts: Sequence[Any], env: dict[Any, int],
             outer: Any | None) -> None:
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = self.value(v.aval, None, const=c, is_const=True)
        for eqn in jaxpr.eqns:
            stack = eqn.source_info.name_stack
            if outer is not None:
                stack = _jax.concat_name_stack(outer, stack)
            ins = [self.read(env, x) for x in eqn.invars]
            name = eqn.primitive.name
            if name in _jax.JIT_NAMES and _jax.jit_inlinable(eqn):
                inner = _jax.call_jaxpr(eqn)
                sub_env = dict(zip(inner.jaxpr.invars, ins, strict=True))
                self.walk(inner.jaxpr, inner.consts, sub_env, stack)
                for o, io in zip(eqn.outvars, inner.jaxpr.outvars, strict=True):
                    env[o] = self.read(sub_env, io)
                continue
            self.node(eqn, ins, stack, env)

    def node(self, eqn: Any, ins: list[int], stack: Any, env: dict[Any, int]) -> None:
        index = len(self.nodes)
        outs = [self.value(v.aval, index) for v in eqn.outvars]
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not _jax.is_dropvar(v):
                env[v] = o
        name = eqn.primitive.name
        in_avals = [self.values[i].aval for i in ins]
        out_avals = [v.aval for v in eqn.outvars]
        trips = 1
        if _jax.sub_jaxprs(eqn):
            kind, fl, trips = _unit_kind_and_flops(eqn)
        else:
            kind = P.classify(name)
            fl = P.flops(name, in_avals, out_avals, eqn.params)
            if kind is P.Kind.UNKNOWN:
                self.unknown[name] = None
        # each value's bytes were worked out with it (P.nbytes of its aval)
        moved = (sum(self.values[i].nbytes for i in ins)
                 + sum(self.values[o].nbytes for o in outs))
        self.nodes.append(Node(
            index=index, primitive=name, inputs=tuple(ins), outputs=tuple(outs), kind=kind,
            phase=phase_of(stack), layer=layer_of(stack), flops=float(fl),
            bytes_moved=float(moved), name_stack=str(stack), trip_count=trips, eqn=eqn,
            stack=stack))


def _describe_leaf(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _is_traceable_leaf(x: Any) -> bool:
    if isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
        return True
    return hasattr(x, "shape") and hasattr(x, "dtype")  # ShapeDtypeStruct and friends


def check_leaves(args: Sequence[Any], kwargs: dict[str, Any], what: str = "argument") -> None:
    """Raise ``TypeError`` naming the first leaf that JAX cannot trace."""
    leaves, _ = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs))
    for path, leaf in leaves:
        if not _is_traceable_leaf(leaf):
            where = jax.tree_util.keystr(path)
            raise TypeError(
                f"{what} leaf {where} is a {_describe_leaf(leaf)} ({leaf!r:.60}), not an array. "
                "jaxmem traces every leaf of every argument; pass non-array configuration "
                "through functools.partial or mark the argument static "
                "(jaxmem.optimize(..., static_argnums=...)).")


def backward_in_units(program: Program) -> tuple[str, ...]:
    """Primitives of the control-flow units (``scan``, ``while``, ``cond``, ``pjit``...) whose
    bodies hold backward equations: a ``jax.grad`` taken inside a loop body, which the joint
    rewrite keeps whole (so a step can have a backward pass that no top-level plan reaches).

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> def step(ws):
      ...     body = lambda c, w: (c + jax.grad(lambda w: jnp.sum(jnp.sin(w)))(w).sum(), None)
      ...     return jax.lax.scan(body, 0.0, ws)[0]
      >>> backward_in_units(trace(step, jnp.ones((2, 3))))
      ('scan',)
    """
    found: dict[str, None] = {}
    for n in program.nodes:
        if n.phase != "backward" and any(_has_backward(s) for s in _jax.sub_jaxprs(n.eqn)):
            found[n.primitive] = None
    return tuple(found)


def _has_backward(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or a body nested in it) holds a backward equation."""
    return any(_jax.is_backward(e) or any(_has_backward(s) for s in _jax.sub_jaxprs(e))
               for e in jaxpr.eqns)


def trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Program:
    """Trace ``fn(*args, **kwargs)`` into a :class:`Program`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
      >>> prog = jaxmem.program.trace(jax.value_and_grad(loss), jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> prog.has_backward
      True
    """
    check_leaves(args, kwargs)
    flat, in_tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))

    def flat_fn(*leaves: Any) -> Any:
        a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
        return fn(*a, **k)

    try:
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat)
    except (TypeError, ValueError) as e:
        fname = getattr(fn, "__name__", repr(fn))
        hint = ""
        errs = jax.errors
        if isinstance(e, errs.ConcretizationTypeError | errs.TracerIntegerConversionError
                      | errs.TracerBoolConversionError):
            hint = ("\nAn argument used as a Python value (a loop count, a shape, an if) is "
                    "traced like every array: mark it static, as for jax.jit "
                    "(jaxmem.optimize(step, static_argnums=... or static_argnames=...)), or "
                    "bind it with functools.partial.\n")
        raise TraceError(f"jaxmem could not trace {fname}: {hint}{type(e).__name__}: {e}") from e
    return from_jaxpr(closed, in_tree, jax.tree_util.tree_structure(out_shape))


def from_jaxpr(closed: Any, in_tree: Any = None, out_tree: Any = None) -> Program:
    """Flatten a ``ClosedJaxpr`` into a :class:`Program`."""
    b = _Builder()
    env: dict[Any, int] = {}
    inputs = []
    for i, v in enumerate(closed.jaxpr.invars):
        env[v] = b.value(v.aval, None, input_index=i)
        inputs.append(env[v])
    b.walk(closed.jaxpr, closed.consts, env, None)
    outputs = tuple(b.read(env, v) for v in closed.jaxpr.outvars)
    return Program(nodes=tuple(b.nodes), values=tuple(b.values), inputs=tuple(inputs),
                   outputs=outputs, in_tree=in_tree, out_tree=out_tree, jaxpr=closed,
                   unknown_primitives=tuple(b.unknown))


def flat_donated(args: Sequence[Any], donate_argnums: int | Sequence[int]) -> tuple[int, ...]:
    """Positions among the flat inputs of the leaves of the donated positional arguments."""
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    nums = {a % len(args) for a in nums if -len(args) <= a < len(args)}
    out, k = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        if i in nums:
            out.extend(range(k, k + n))
        k += n
    return tuple(out)
