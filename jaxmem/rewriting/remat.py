"""``jaxmem.checkpoint``: jaxmem's planning for a function that is differentiated later.

:func:`jaxmem.optimize` rewrites a whole train step (the gradient is already inside it).
A loss, a block, or the body of a ``lax.scan`` / ``nn.scan`` is differentiated *later*, by
the caller; for those, this module runs the whole data flow and applies its plan through
``jax.checkpoint`` (the fourth box as a policy):

1. trace ``fn`` for the given argument shapes into a :class:`jaxmem.program.Program`;
2. tag every value it computes (outputs of heavy, utility and control-flow equations) with
   ``checkpoint_name("jaxmem#<value id>")``;
3. ask JAX which tagged values the backward pass would keep with no remat at all (the
   *residuals*) and plan them: MEDL's rule (:func:`jaxmem.planning.strategies.medl_keeps`: keep
   heavy outputs, recompute utility ones; chains as :mod:`jaxmem.analyzing.chains` defines them),
   or,
   under a per-call ``budget``, a greedy choice of the values that are most expensive to
   recompute per byte;
4. run the tagged function under ``jax.checkpoint(policy=jaxmem.policies.from_plan(plan))``.

Plans are cached per argument structure, shapes and dtypes. The wrapped function composes
with ``jax.grad``, ``jax.vjp``, ``jax.vmap``, ``jax.jit`` and ``lax.scan`` like
``jax.checkpoint`` does, and is the way to get per-layer remat *inside* a scanned stack.

The budget planner here is a simple local greedy (bytes kept per call against recompute
FLOPs per byte); the full budget planner for train steps lives with ``jaxmem.optimize``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxmem import _jax
from jaxmem.analyzing import chains
from jaxmem.analyzing.analysis import Residual
from jaxmem.planning.budget.units import parse_budget
from jaxmem.planning.plan import Choice, Decision, Plan
from jaxmem.planning.strategies import medl_keeps
from jaxmem.rewriting import policies
from jaxmem.tracing import program as _program
from jaxmem.tracing.primitives import Kind
from jaxmem.xla.measure import fmt_bytes

__all__ = ["Checkpointed", "checkpoint", "parse_bytes"]

STRATEGIES = ("auto", "none", "full")
_TAG_RE = re.compile(re.escape(policies.TAG_PREFIX) + r"(\d+)")


def parse_bytes(spec: int | str) -> int:
    """``"6GiB"``, ``"500MB"``, ``"1.5 MiB"`` or an int -> bytes (``jaxmem.planning.budget``'s
    parser).

    Example:
      >>> parse_bytes("1.5 KiB")
      1536
    """
    if isinstance(spec, float):
        raise TypeError(f"jaxmem.checkpoint's budget is bytes per call (an int or a string like "
                        f"'6GiB'), got the float {spec!r}; fractions need a whole step, see "
                        "jaxmem.optimize(budget=...)")
    kind, value = parse_budget(spec)
    return int(value)


# --- arguments -----------------------------------------------------------------------------

def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) or _jax.is_tracer(x) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type))


def _aval_key(x: Any) -> tuple[Any, ...]:
    aval = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))


def _static_key(x: Any, where: str) -> Any:
    try:
        hash(x)
    except TypeError as e:
        raise TypeError(
            f"jaxmem.checkpoint: argument leaf {where} is a {type(x).__name__} that is neither "
            "an array nor hashable; non-array leaves are treated as static configuration and "
            "must be hashable (use a tuple instead of a list, or close over it with "
            "functools.partial)") from e
    return x


class _Split:
    """``(args, kwargs)`` split into array leaves (traced) and other leaves (static)."""

    def __init__(self, args: Sequence[Any], kwargs: dict[str, Any]):
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))
        self.is_dyn = tuple(_is_array(x) for _, x in leaves)
        self.dyn = [x for (_, x), d in zip(leaves, self.is_dyn, strict=True) if d]
        self.static = tuple(_static_key(x, jax.tree_util.keystr(p))
                            for (p, x), d in zip(leaves, self.is_dyn, strict=True) if not d)
        self.key = (self.treedef, self.is_dyn, self.static,
                    tuple(_aval_key(x) for x in self.dyn))

    def rebuild(self, dyn: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        it_d, it_s = iter(dyn), iter(self.static)
        leaves = [next(it_d) if d else next(it_s) for d in self.is_dyn]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


# --- the tagged interpreter ----------------------------------------------------------------

def _taggable(prog: _program.Program, node: _program.Node, vid: int) -> bool:
    if node.kind == Kind.FREE or node.primitive == "name":
        return False
    v = prog.values[vid]
    try:
        dtype = np.dtype(v.aval.dtype)
    except TypeError:  # PRNG keys and other extended dtypes
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact)) and v.nbytes > 0


def _tags(prog: _program.Program) -> frozenset[int]:
    return frozenset(vid for n in prog.nodes for vid in n.outputs
                     if _taggable(prog, n, vid))


def _run(prog: _program.Program, tags: frozenset[int], dyn: Sequence[Any]) -> list[Any]:
    """Evaluate ``prog`` on ``dyn``, naming each value in ``tags`` with ``checkpoint_name``."""
    prefix = _jax.current_name_stack()
    env: dict[int, Any] = dict(zip(prog.inputs, dyn, strict=True))

    def read(i: int) -> Any:
        return env[i] if i in env else prog.values[i].const

    for node in prog.nodes:
        ins = [read(i) for i in node.inputs]
        stack = _jax.concat_name_stack(prefix, node.stack)
        with _jax.user_context(node.eqn.source_info.traceback, stack):
            outs = _jax.bind(node.eqn, *ins)
            for vid, o in zip(node.outputs, outs, strict=True):
                env[vid] = checkpoint_name(o, policies.tag(vid)) if vid in tags else o
    return [read(i) for i in prog.outputs]


# --- planning ------------------------------------------------------------------------------

def _chain_flops(prog: _program.Program, vid: int, saved: frozenset[int]) -> tuple[float, tuple]:
    """FLOPs to re-create ``vid`` under ``jax.checkpoint`` (chains start at the ``saved``
    values and the inputs: no anchors), and the chain's nodes."""
    starts = chains.chain_start(prog, kept=saved, anchors=False)
    nodes = chains.replay_chain(prog, [vid], starts)[0]
    return float(sum(prog.nodes[i].flops for i in nodes)), tuple(nodes)


def _anchors(prog: _program.Program, vids: Sequence[int]) -> set[int]:
    """Values the program makes that re-creating ``vids`` from anchors starts from.

    MEDL: utility outputs are recomputed *from the outputs of the expensive layers*; those
    outputs must be kept even when the backward pass does not read them directly.
    """
    inputs = chains.replay_chain(prog, list(vids), chains.chain_start(prog))[1]
    return {v for v in inputs if prog.values[v].producer is not None}


def _residual(prog: _program.Program, vid: int, stop: frozenset[int]) -> Residual:
    v = prog.values[vid]
    node = prog.nodes[v.producer] if v.producer is not None else None
    flops, chain = _chain_flops(prog, vid, stop - {vid})
    prim = node.primitive if node else "argument"
    layer = node.layer if node else ""
    return Residual(
        name=f"{layer or '<top>'}/{prim}#{vid}", value=vid, shape=v.shape, dtype=v.dtype,
        nbytes=v.nbytes, layer=layer, primitive=prim,
        kind=node.kind if node else Kind.ARGUMENT,
        readers=(), recompute_flops=flops, recompute_bytes=0.0, chain=chain,
        produced_at=node.index if node else -1)


def _residual_tags(fn_tagged: Callable[..., Any], dyn: Sequence[Any]) -> tuple[list[int], int]:
    """Tagged values the backward would keep with every tag saveable, and untagged bytes."""
    keep_all = jax.checkpoint_policies.save_any_names_but_these()
    f = jax.checkpoint(fn_tagged, policy=keep_all)
    ids, other = [], 0
    for aval, desc in _jax.saved_residuals(f, *dyn):
        m = _TAG_RE.search(desc)
        if m:
            ids.append(int(m.group(1)))
        elif "from the argument" not in desc:
            other += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    return sorted(set(ids)), other


def _resolve_budget(budget: Any, all_bytes: int) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget={budget!r}: a float budget is a fraction in (0, 1] of the "
                             "bytes the backward would keep with no remat; give bytes as an "
                             "int or a string like '64MiB'")
        return int(budget * all_bytes)
    return parse_bytes(budget)


def _decide(prog: _program.Program, residual_ids: Sequence[int], strategy: str,
            budget: int | None, offload: bool, argument_bytes: int) -> Plan:
    """The :class:`~jaxmem.planning.plan.Plan` for the tagged residuals: MEDL's rule
    (:func:`jaxmem.planning.strategies.medl_keeps`), or with a budget a greedy choice within it."""
    ids = tuple(residual_ids)
    kind = {i: prog.nodes[prog.values[i].producer].kind for i in ids}
    if strategy == "auto":  # the heavy outputs recompute chains start from are candidates too
        ids = tuple(sorted(set(ids) | _anchors(prog, [i for i in ids if not medl_keeps(kind[i])])))
        kind = {i: prog.nodes[prog.values[i].producer].kind for i in ids}
    heavy_like = frozenset(i for i in ids if medl_keeps(kind[i]))
    decisions: dict[int, tuple[Decision, str]] = {}
    if strategy == "none":
        for i in ids:
            decisions[i] = (Decision.SAVE, "strategy='none': keep everything")
    elif strategy == "full":
        for i in ids:
            decisions[i] = (Decision.RECOMPUTE, "strategy='full': recompute everything")
    elif budget is None:  # MEDL
        for i in ids:
            if i in heavy_like:
                decisions[i] = (Decision.SAVE, f"{kind[i]} output: kept (MEDL)")
            else:
                decisions[i] = (Decision.RECOMPUTE, f"{kind[i]} output: recomputed from kept "
                                "heavy outputs (MEDL)")
    else:  # greedy: most recompute FLOPs per byte first, heavy outputs before utility ones
        stop = frozenset(ids)
        cost = {i: _chain_flops(prog, i, stop - {i})[0] for i in ids}
        order = sorted(ids, key=lambda i: (i not in heavy_like,
                                           -cost[i] / max(prog.values[i].nbytes, 1), i))
        left = budget
        for i in order:
            nb = prog.values[i].nbytes
            if nb <= left:
                left -= nb
                decisions[i] = (Decision.SAVE, f"fits the budget ({fmt_bytes(nb)}; "
                                f"{cost[i]:.3g} FLOPs to recompute)")
            elif offload and i in heavy_like:
                decisions[i] = (Decision.OFFLOAD, "over the budget; heavy: offloaded to host")
            else:
                decisions[i] = (Decision.RECOMPUTE, "over the budget: recomputed")
    saved = frozenset(i for i, (d, _) in decisions.items() if d is Decision.SAVE)
    choices = tuple(Choice(_residual(prog, i, saved | frozenset(prog.inputs)), d, why)
                    for i, (d, why) in ((i, decisions[i]) for i in ids))
    recompute = [c.residual for c in choices if c.decision is Decision.RECOMPUTE]
    nodes = {n for r in recompute for n in r.chain}
    notes = [f"arguments of the function ({fmt_bytes(argument_bytes)}) are always kept by "
             "jax.checkpoint", "residual sizes are per call (per scan iteration inside a scan)"]
    kept = sum(c.residual.nbytes for c in choices if c.decision is Decision.SAVE)
    notes.append(f"kept per call: {fmt_bytes(kept)} of "
                 f"{fmt_bytes(sum(prog.values[i].nbytes for i in ids))}")
    return Plan(choices=choices, strategy=strategy,
                recompute_flops=float(sum(prog.nodes[n].flops for n in nodes)),
                baseline_flops=prog.flops, budget=budget, notes=tuple(notes))


# --- the public wrapper --------------------------------------------------------------------

class Checkpointed:
    """``fn`` under ``jax.checkpoint`` with a jaxmem plan; made by :func:`checkpoint`.

    Call it like ``fn``. ``.plan(*args)`` returns the :class:`jaxmem.Plan` it applies for
    those arguments, ``.policy(*args)`` the ``jax.checkpoint`` policy.
    """

    def __init__(self, fn: Callable[..., Any], *, strategy: str, budget: Any, offload: bool,
                 policy: Callable[..., Any] | None, prevent_cse: bool):
        self.fn = fn
        self.strategy = strategy
        self.budget = budget
        self.offload = offload
        self.extra_policy = policy
        self.prevent_cse = prevent_cse
        self._plans: dict[Any, tuple[Plan, Callable[..., Any]]] = {}
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return (f"jaxmem.checkpoint({getattr(self.fn, '__name__', self.fn)!r}, "
                f"strategy={self.strategy!r}, budget={self.budget!r})")

    def _trace(self, split: _Split) -> tuple[_program.Program, Any]:
        def flat_fn(*dyn: Any) -> Any:
            a, k = split.rebuild(dyn)
            return self.fn(*a, **k)

        try:
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*split.dyn)
        except (TypeError, ValueError) as e:
            name = getattr(self.fn, "__name__", repr(self.fn))
            raise _program.TraceError(
                f"jaxmem.checkpoint could not trace {name}: {type(e).__name__}: {e}") from e
        prog = _program.from_jaxpr(closed)
        return prog, jax.tree_util.tree_structure(out_shape)

    def _get(self, args: Sequence[Any], kwargs: dict[str, Any]):
        split = _Split(args, kwargs)
        prog, out_tree = self._trace(split)
        cached = self._plans.get(split.key)
        if cached is not None and cached[0].notes[-1] == _signature(prog):
            return split, prog, out_tree, cached[0], cached[1]
        tags = _tags(prog)
        ids, _ = _residual_tags(lambda *d: _run(prog, tags, d), split.dyn)
        arg_bytes = sum(prog.values[i].nbytes for i in prog.inputs)
        budget = _resolve_budget(self.budget, sum(prog.values[i].nbytes for i in ids))
        plan = _decide(prog, ids, self.strategy, budget, self.offload, arg_bytes)
        plan = Plan(**{**plan.__dict__, "notes": plan.notes + (_signature(prog),)})
        policy = policies.from_plan(plan, fallback=self.extra_policy)
        if self.strategy == "none" and self.extra_policy is None:
            policy = jax.checkpoint_policies.everything_saveable
        self._plans[split.key] = (plan, policy)
        return split, prog, out_tree, plan, policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        split, prog, out_tree, _, policy = self._get(args, kwargs)
        tags = _tags(prog)
        run = jax.checkpoint(lambda *d: _run(prog, tags, d), policy=policy,
                             prevent_cse=self.prevent_cse)
        return jax.tree_util.tree_unflatten(out_tree, run(*split.dyn))

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The :class:`jaxmem.Plan` applied for these arguments (arrays or ShapeDtypeStructs)."""
        return self._get(args, kwargs)[3]

    def policy(self, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """The ``jax.checkpoint`` policy applied for these arguments."""
        return self._get(args, kwargs)[4]


def _signature(prog: _program.Program) -> str:
    return f"program: {len(prog.nodes)} nodes, {len(prog.values)} values"


def checkpoint(fn: Callable[..., Any] | None = None, *, strategy: str = "auto",
               budget: int | str | float | None = None, offload: bool = False,
               policy: Callable[..., Any] | None = None,
               prevent_cse: bool = True) -> Any:
    """``jax.checkpoint`` with a jaxmem plan, for a function that is differentiated later.

    Use it on a loss, a block, or the body of a ``lax.scan`` (one transformer layer): the
    backward pass keeps what the plan saves and recomputes the rest.

    Args:
      fn: the function. Array leaves of its arguments are traced; other leaves (Python
        numbers, strings, flags) are static and must be hashable. Also usable as a
        decorator, with or without arguments.
      strategy: ``"auto"`` (MEDL: keep outputs of heavy layers, recompute utility-layer
        outputs; with ``budget``, a greedy choice within it), ``"none"`` (keep everything,
        as without remat) or ``"full"`` (keep nothing, like ``nothing_saveable``).
      budget: bytes the backward may keep *per call* (per scan iteration inside a scan):
        an int, a string such as ``"64MiB"``, or a float in (0, 1] meaning that fraction of
        what no remat would keep. Values most expensive to recompute per byte are kept
        first, heavy (matmul, conv) outputs before utility ones. Arguments of ``fn`` are
        always kept by ``jax.checkpoint`` and are not counted.
      offload: with ``budget``, heavy values that do not fit go to host memory
        (``pinned_host``) instead of being recomputed.
      policy: an extra ``jax.checkpoint`` policy; a value is kept if the plan or this policy
        keeps it (e.g. ``jax.checkpoint_policies.save_only_these_names("attn_out")``).
      prevent_cse: as in ``jax.checkpoint``; ``False`` is fine (and recommended) inside
        ``lax.scan``.

    Returns:
      A :class:`Checkpointed` callable (``.plan(*args)`` shows the plan).

    Raises:
      ValueError: unknown ``strategy``, a budget that cannot be read, ``offload`` without a
        budget.
      TypeError: ``fn`` is not callable.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem.rewriting.remat import checkpoint  # exported as jaxmem.checkpoint
      >>> def layer(w, x):
      ...     return jnp.tanh(x @ w) @ w + x
      >>> body = checkpoint(layer, prevent_cse=False)
      >>> def loss(ws, x):
      ...     x, _ = jax.lax.scan(lambda h, w: (body(w, h), None), x, ws)
      ...     return jnp.sum(x ** 2)
      >>> ws, x = jnp.full((4, 8, 8), 0.1), jnp.ones((2, 8))
      >>> g = jax.grad(loss)(ws, x)
      >>> ref = jax.grad(lambda ws, x: jnp.sum(jax.lax.scan(
      ...     lambda h, w: (layer(w, h), None), x, ws)[0] ** 2))(ws, x)
      >>> bool(jnp.allclose(g, ref, rtol=1e-6))
      True
      >>> print(body.plan(ws[0], x).explain())  # doctest: +ELLIPSIS
           save        64 B <top>/dot_general#2: heavy output: kept (MEDL)
      recompute        64 B <top>/tanh#3: utility output: recomputed from kept heavy outputs (MEDL)
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; jaxmem.checkpoint knows {STRATEGIES}")
    if budget is not None and strategy != "auto":
        raise ValueError(f"budget={budget!r} needs strategy='auto', got {strategy!r}")
    if offload and budget is None:
        raise ValueError("offload=True needs a budget (what does not fit is offloaded); "
                         "pass budget=, e.g. budget='64MiB' or budget=0.5")
    if budget is not None:
        _resolve_budget(budget, 1)  # validate early
    if policy is not None and not callable(policy):
        raise TypeError(f"policy must be a jax.checkpoint policy (a callable), got {policy!r}")

    def wrap(f: Callable[..., Any]) -> Checkpointed:
        if not callable(f):
            raise TypeError(f"jaxmem.checkpoint expects a callable, got {type(f).__name__}")
        return Checkpointed(f, strategy=strategy, budget=budget, offload=offload,
                            policy=policy, prevent_cse=prevent_cse)

    return wrap if fn is None else wrap(fn)
