"""Plans inside scan bodies: per value of a scanned layer, keep it, recompute it, or offload it.

Third box of the data flow (``Analysis -> Plan``) for the layers a ``lax.scan`` stacks
(``nn.scan``, ``nnx.scan``, haiku's ``layer_stack``, a hand-written scan over layers). The
joint-jaxpr rewrite keeps a scan whole, so what a scanned layer keeps for the backward pass
is decided the only way JAX allows from outside: a ``jax.checkpoint`` policy on the body
(applied while tracing by :func:`jaxmem._jax.checkpointed_scan_bodies`). A
:class:`BodyPolicy` is such a policy that says, per *body value*, whether it is kept, offloaded
or recomputed:

- in a body that tags its tensors with ``jax.ad_checkpoint.checkpoint_name`` (MaxText's
  names: ``decoder_layer_input``, ``query_proj``, ..., ``mlpwo``; or any others), a body
  value is a name;
- in an untagged body, a body value is one matmul *signature* (primitive, input shapes and
  dtypes, dimension numbers): what a policy can see of an equation. Equations with the same
  signature (the key and value projections of grouped-query attention) are one value.

:func:`body_values` lists them from the traced step, with their bytes and FLOPs per step
(times the scan's length); :func:`candidates` builds the candidate space: keep everything,
MEDL's rule (:func:`jaxmem.policies.utility`), keep nothing (re-run the layer from its
input), MaxText's ``remat_policy`` presets where their names are present (:data:`MAXTEXT`),
and finer mixes: the ladder of the values with the most recompute FLOPs per byte kept. The
budget search that picks the cheapest one that fits, compile-checked, is
:func:`jaxmem.compiling.scan_budget.choose`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.ad_checkpoint import checkpoint_name
  >>> p = BodyPolicy("save_q", save=(("name", "q"),))
  >>> layer = lambda x: jnp.sin(checkpoint_name(x @ x, "q")) @ x
  >>> f = jax.checkpoint(layer, policy=p)
  >>> jax.grad(lambda x: f(x).sum())(jnp.eye(2)).shape
  (2, 2)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from jaxmem import _jax
from jaxmem.tracing import primitives as P
from jaxmem.tracing.program import Program

__all__ = [
    "LAYER_INPUT", "MAXTEXT", "BodyPolicy", "BodyValue", "body_values", "candidates", "dot_key",
    "preset_policy",
    "TrainBodies", "bodies_only", "loop_plan",
]

#: A body value's key: ``("name", tag)`` or ``("dot", signature)``.
Key = tuple[str, Any]

_QKV = ("query_proj", "key_proj", "value_proj")
_PROJ = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")

#: MaxText's ``remat_policy`` presets (``Decoder.get_remat_policy``) as (save, offload) name
#: lists; ``full`` saves nothing. ``decoder_layer_input_offloaded`` is MaxText's ``custom``
#: setting with ``decoder_layer_input: offload``.
MAXTEXT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "minimal_with_context": ((*_PROJ, "context"), ()),
    "minimal": (_PROJ, ()),
    "save_dot_with_context_except_mlp": ((*_QKV, "context", "out_proj"), ()),
    "save_dot_except_mlpwi": ((*_QKV, "out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": ((*_QKV, "out_proj"), ()),
    "save_qkv_proj": (_QKV, ()),
    "qkv_proj_offloaded": ((), _QKV),
    "minimal_offloaded": ((), _PROJ),
    "save_out_proj": (("out_proj",), ()),
    "full": ((), ()),
    "decoder_layer_input_offloaded": ((), ("decoder_layer_input",)),
}

_OFFLOAD = Offloadable(src="device", dst="pinned_host")

#: The name jaxmem gives a scanned layer's input (the carry the body receives) in a body
#: that tags nothing: a policy can then offload it, as MaxText offloads its tagged
#: ``decoder_layer_input`` (:func:`jaxmem._jax.checkpointed_scan_bodies` names it, only for
#: a policy that refers to it: :attr:`BodyPolicy.layer_input_name`).
LAYER_INPUT = "jaxmem_layer_input"
LAYER_KEY: Key = ("name", LAYER_INPUT)


def dot_key(avals: Sequence[Any], params: dict[str, Any]) -> tuple[Any, ...]:
    """A matmul's signature as a policy sees it: input shapes and dtypes, dimension numbers."""
    return (tuple((tuple(a.shape), str(a.dtype)) for a in avals),
            str(params.get("dimension_numbers")))


@dataclasses.dataclass(frozen=True)
class BodyPolicy:
    """A ``jax.checkpoint`` policy over body values: keep ``save``, offload ``offload``.

    Attributes:
      name: what the candidate is called in plans and tables (``"minimal"``,
        ``"ladder-3"``, ``"utility"``...).
      save, offload: body-value keys (``("name", tag)`` or ``("dot", signature)``).
      base: ``"none"`` (keep only ``save``), ``"utility"`` (MEDL's rule: keep every heavy
        output too) or ``"everything"`` (keep everything: no recompute in the body).
    """

    name: str
    save: tuple[Key, ...] = ()
    offload: tuple[Key, ...] = ()
    base: str = "none"

    @property
    def layer_input_name(self) -> str | None:
        """:data:`LAYER_INPUT` when the policy keeps or offloads it (the body's input must
        then be named so: :func:`jaxmem._jax.checkpointed_scan_bodies` asks), else None."""
        return LAYER_INPUT if LAYER_KEY in self.save or LAYER_KEY in self.offload else None

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        key = self._key(prim, avals, params)
        if key is not None and key in self.offload:
            return _OFFLOAD
        if key is not None and key in self.save:
            return Saveable
        if self.base == "everything":
            return Saveable
        if self.base == "utility":
            from jaxmem.rewriting.policies import utility  # policies imports the planners; lazily

            return utility(prim, *avals, **params)
        return Recompute

    @staticmethod
    def _key(prim: Any, avals: Sequence[Any], params: dict[str, Any]) -> Key | None:
        if prim is _jax.name_p:
            return ("name", params.get("name"))
        if prim.name == "dot_general":
            return ("dot", dot_key(avals, params))
        return None

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class BodyValue:
    """One value inside a scanned layer a policy can keep, offload or recompute.

    Attributes:
      key: ``("name", tag)`` or ``("dot", signature)``.
      label: printable (the tag, or ``dot f32[4,16]x[16,32]``).
      nbytes: bytes kept per step if saved (per layer times the scan length, all equations
        with the key).
      flops: FLOPs of the equations that make it, per step (a lower bound on what dropping
        it costs: re-creating it also re-runs what it is made from, unless that is kept).
    """

    key: Key
    label: str
    nbytes: int
    flops: float


def _eqn_flops(eqn: Any) -> float:
    if _jax.sub_jaxprs(eqn):
        return 0.0
    return P.flops(eqn.primitive.name, [v.aval for v in eqn.invars],
                   [v.aval for v in eqn.outvars], eqn.params)


def _chain_flops(eqns: Sequence[Any], start: Any, made_by: dict[Any, int],
                 named: set[Any]) -> float:
    """FLOPs of the equations ``start`` is made from, back to named values and body inputs."""
    seen: set[int] = set()
    stack = [start]
    total = 0.0
    while stack:
        v = stack.pop()
        i = made_by.get(v)
        if i is None or i in seen:
            continue
        seen.add(i)
        total += _eqn_flops(eqns[i])
        stack += [x for x in eqns[i].invars if not _jax.is_literal(x) and x not in named]
    return total


def _walk(jaxpr: Any, trips: int, found: dict[Key, list]) -> None:
    eqns = jaxpr.eqns
    made_by = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    named = {o for e in eqns if e.primitive is _jax.name_p for o in e.outvars}
    for eqn in eqns:
        name = eqn.primitive.name
        subs = _jax.sub_jaxprs(eqn)
        if subs:
            inner = trips * (int(eqn.params.get("length", 1)) if name == "scan" else 1)
            for j in subs:
                _walk(getattr(j, "jaxpr", j), inner, found)
            continue
        avals = [v.aval for v in eqn.invars]
        outs = [v.aval for v in eqn.outvars]
        if eqn.primitive is _jax.name_p:
            key: Key = ("name", eqn.params["name"])
            label = str(eqn.params["name"])
            src = eqn.invars[0]
            flops = 0.0 if _jax.is_literal(src) else _chain_flops(eqns, src, made_by, named)
        elif name == "dot_general":
            key = ("dot", dot_key(avals, eqn.params))
            label = "dot " + "x".join(f"{a.dtype}{list(a.shape)}" for a in avals)
            flops = P.flops(name, avals, outs, eqn.params)
        else:
            continue
        row = found.setdefault(key, [label, 0, 0.0])
        row[1] += trips * sum(P.nbytes(a) for a in outs)
        row[2] += trips * flops


def body_values(program: Program) -> list[BodyValue]:
    """The values inside the step's forward scans a body policy chooses for.

    Tagged bodies give their names (and nothing else: a tagged layer says what matters);
    untagged ones their matmul signatures. Empty when the step scans no differentiated
    layer.
    """
    found: dict[Key, list] = {}
    carries = 0
    for node in program.nodes:
        if node.primitive == "scan" and node.phase == "forward" and node.eqn is not None:
            trips = int(node.eqn.params.get("length", 1))
            _walk(node.eqn.params["jaxpr"].jaxpr, trips, found)
            carries += trips * _carry_bytes(node.eqn)
    names = {k: v for k, v in found.items() if k[0] == "name" and k != LAYER_KEY}
    if names:
        return [BodyValue(k, label, int(b), float(f)) for k, (label, b, f) in names.items()]
    out = [BodyValue(k, label, int(b), float(f)) for k, (label, b, f) in found.items()
           if k != LAYER_KEY]
    if out and carries:  # an untagged body: its input can be offloaded under LAYER_INPUT
        out.append(BodyValue(LAYER_KEY, "layer input", carries, 0.0))
    return out


def _carry_bytes(eqn: Any) -> int:
    """Bytes of the floating carry a scan's body receives (a scanned layer's input)."""
    n, k = int(eqn.params.get("num_consts", 0)), int(eqn.params.get("num_carry", 0))
    avals = [v.aval for v in eqn.invars[n:n + k]]
    return sum(P.nbytes(a) for a in avals if _jax.is_floating(a))


def _maxtext(values: Iterable[BodyValue], offload: bool) -> list[BodyPolicy]:
    present = {v.key[1] for v in values if v.key[0] == "name"}
    out = []
    for name, (save, off) in MAXTEXT.items():
        if not set(save) | set(off) <= present or (off and not offload):
            continue
        if name == "full" or not present:
            continue
        out.append(BodyPolicy(f"maxtext:{name}", tuple(("name", n) for n in save),
                              tuple(("name", n) for n in off)))
    return out


def candidates(values: Sequence[BodyValue], *, offload: bool = False) -> list[BodyPolicy]:
    """The candidate body policies, from most memory (no recompute) to least.

    ``everything`` and ``utility`` (MEDL's rule), the ladder ``ladder-k`` (keep the ``k``
    values with the most FLOPs per byte; ``k = 0`` is ``full``, re-running the layer from
    its input), the mixes (the value sets that keep the most FLOPs for their bytes), MaxText's
    presets whose names the body has, and with ``offload`` the ladder's
    rungs with every other value (the layer input included) offloaded instead of
    recomputed.
    """
    if not values:
        return []
    layer = tuple(v.key for v in values if v.key == LAYER_KEY)  # an untagged body's input
    values = [v for v in values if v.key != LAYER_KEY]
    order = sorted(values, key=lambda v: (-(v.flops / max(v.nbytes, 1)), v.nbytes, v.label))
    out = [BodyPolicy("everything", base="everything"), BodyPolicy("utility", base="utility")]
    for k in range(len(order), -1, -1):
        keep = tuple(v.key for v in order[:k])
        rung = "full" if k == 0 else f"ladder-{k}"
        out.append(BodyPolicy(rung, save=keep))
        if offload and layer:  # the rung re-run from its input, parked in host memory
            out.append(BodyPolicy(f"{rung}+input offloaded", save=keep, offload=layer))
        if offload and k < len(order):
            rest = tuple(v.key for v in order[k:]) + layer
            out.append(BodyPolicy(f"ladder-{k}+offload", save=keep, offload=rest))
    out += _mixes(order)
    out += _maxtext(values, offload)
    seen: set[Any] = set()
    unique = []
    for p in out:
        sig = (p.base, frozenset(p.save), frozenset(p.offload))
        if sig not in seen:
            seen.add(sig)
            unique.append(p)
    return unique


def _mixes(order: Sequence[BodyValue], most: int = 12, points: int = 16) -> list[BodyPolicy]:
    """Finer mixes than the ladder: the sets of values that keep the most FLOPs for their
    bytes (the Pareto front of an exact 0/1 knapsack over the subsets, FLOPs and bytes taken
    as additive; the trace that follows gives the exact ones), thinned to ``points``. The
    ladder is greedy by FLOPs per byte: a mix can keep one large expensive value in place of
    several cheap ones at the same bytes. ``[]`` above ``most`` values (2**most subsets)."""
    if len(order) > most:
        return []
    subsets = []
    for mask in range(1 << len(order)):
        kept = [v for i, v in enumerate(order) if mask >> i & 1]
        subsets.append((sum(v.nbytes for v in kept), -sum(v.flops for v in kept), kept))
    front: list[tuple[int, float, list[BodyValue]]] = []
    for nbytes, neg, kept in sorted(subsets, key=lambda t: (t[0], t[1])):
        if not front or neg < front[-1][1]:  # more FLOPs kept than any smaller set
            front.append((nbytes, neg, kept))
    step = max(1, -(-len(front) // points))
    return [BodyPolicy(f"mix-{nbytes}", save=tuple(v.key for v in kept))
            for nbytes, _, kept in front[::step]]


def preset_policy(name: str) -> BodyPolicy:
    """MaxText's preset ``name`` (a :data:`MAXTEXT` key) as a :class:`BodyPolicy`."""
    save, off = MAXTEXT[name]
    return BodyPolicy(f"maxtext:{name}", tuple(("name", n) for n in save),
                      tuple(("name", n) for n in off))


def bodies_only(analysis: Any, donated: tuple[int, ...] = ()) -> list[Any]:
    """The step as traced (scan bodies under their policy), nothing dropped outside the
    scans: a candidate for ``optimize``'s automatic mode when the step scans its layers.

    Outside a scan the auto plans re-create values behind optimisation barriers (the loss's
    softmax, the final norm); on XLA:GPU that can hold a logits-sized buffer more than
    keeping them (the zoo ``transformer_scan`` on the H100 target: 106.24 MiB against
    102.35 MiB with the same body policy and nothing dropped outside, which is per-layer
    ``dots_saveable``'s peak). ``[]`` when no differentiated layer is scanned.
    """
    from jaxmem.planning.strategies import plan_none

    if not body_values(analysis.program):
        return []
    return [dataclasses.replace(plan_none(analysis), donated=donated,
                                strategy="scan bodies only (nothing dropped outside)")]


# --- gradient-accumulation scans: a body that is a train step of its own --------------------


def _abstract(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x


def _scan_operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    init = args[0] if args else kwargs.get("init")
    xs = args[1] if len(args) > 1 else kwargs.get("xs")
    return init, xs


class TrainBodies:
    """Plans scan bodies that hold their own forward and backward pass.

    A gradient-accumulation loop (``lax.scan`` or ``fori_loop`` over micro-batches, each
    iteration a ``value_and_grad`` whose gradients are summed in the carry) is a train step
    inside a loop: the joint rewrite of the outer step sees no backward at all. Passed as
    ``plan_body`` to :func:`jaxmem._jax.checkpointed_scan_bodies`, an instance traces each
    scan body met outside differentiation; when the body has a backward pass it is planned
    as a step of its own (``jaxmem.optimize`` on the body: MEDL's auto plan and its
    per-block variants, compiled against the plain body) and its rewrite becomes the body.
    Values the body closes over (the parameters) become explicit inputs
    (``jax.closure_convert``). Scans inside the body
    are treated as in any step (their bodies under the policy). ``plans`` lists what was
    planned, for the outer plan's notes.
    """

    def __init__(self, optimizer: Callable[[Callable[..., Any]], Any]) -> None:
        # ``optimizer(step)``: the Optimized that plans a body (jaxmem.optimize's settings).
        self.optimizer = optimizer
        self.plans: list[Any] = []

    def __call__(self, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from jaxmem.tracing.program import TraceError, trace

        init, xs = _scan_operands(args, kwargs)
        carry = jax.tree.map(_abstract, init)
        x0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)
        try:
            converted, consts = jax.closure_convert(f, carry, x0)
            example = (carry, x0, *map(_abstract, consts))
            if not trace(converted, *example).has_backward:
                return None
        except (TraceError, TypeError, ValueError):
            return None  # not traceable on its own: left to the policy
        # The body is a train step: plan it as one (verified against its own plain jit on the
        # arguments' target, so a body plan is never worse than the plain body).
        sub = self.optimizer(converted)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            entry = sub._prepare(example, {})[0]  # noqa: SLF001
        self.plans.append(entry.plan)
        out_tree = entry.analysis.program.out_tree

        def planned(c: Any, x: Any) -> Any:
            outs = entry.jitted(*jax.tree.leaves(((c, x, *consts), {})))
            return jax.tree.unflatten(out_tree, outs)

        return planned


def loop_plan(analysis: Any, inner: Sequence[Any]) -> Any:
    """The outer step's plan when its backward passes are all inside loop bodies: keep
    everything outside, and say what each body's own plan does."""
    from jaxmem.planning.strategies import plan_none

    def note(i: int, p: Any) -> str:
        per = "per device" if p.strategy.startswith("shard_map") else "per iteration"
        return (f"{'body' if per == 'per device' else 'loop body'} {i} planned as a train "
                f"step: {p.strategy}, {len(p.recompute)} of {len(p.choices)} residuals "
                f"recomputed {per}, {p.recompute_flops / 1e9:.4f} GFLOP {per}")

    notes = tuple(note(i, p) for i, p in enumerate(inner))
    return dataclasses.replace(plan_none(analysis), strategy="auto: inside loops",
                               notes=notes, inner=tuple(inner))
