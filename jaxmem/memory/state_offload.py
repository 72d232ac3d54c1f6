"""Optimizer state in host memory, streamed through the update one layer at a time.

A step of the rewrite box (DESIGN.md), applied after the residual plan: the train state's
optimizer leaves (adam's two moments: twice the parameters' bytes) live in ``pinned_host``
memory between steps. Inside the step each leaf is fetched to the device just before the
optimizer update that reads it, and its new value is written back to host memory, so the
device holds about one layer's slice of the state (plus the next one, prefetched) instead
of all of it. The user's optax update is unchanged: the step is traced, and the update's
equations are replayed grouped by layer.

How the order is enforced (XLA schedules by data flow alone):

- the update's equations are split into *groups*: the equations that read one offloaded leaf
  or values made from it, merged where one equation reads two leaves (adam's parameter update
  reads both moments of a parameter). A small or scalar leaf (adam's step count) stays on the
  device: it is read by every group and would merge them all;
- groups run in the order their other inputs (the gradients) are made, i.e. backward order;
- group ``k``'s leaves are fetched behind an ``optimization_barrier`` tied to its gradients
  and to the written-back state of group ``k - 2``: the fetch cannot start before the
  gradient exists nor before the group two back has left the device, so at most two groups'
  slices are on the device at once (one updated, the next one arriving).

With ``offload_state="all"`` the parameters (leaves the model reads too) join the groups
through the update's equations only; their forward and backward reads are fetched per use
by :mod:`jaxmem.memory.param_offload`.

On CPU, XLA strips host placement: the program runs the same equations (results are
identical) but the compiled figures do not show the saving; compile for a GPU target
(``jaxmem.targets.get("h100")``) to measure it. See docs/state_offload.md.

The update's groups and what each fetch waits for are worked out in
:mod:`~jaxmem.memory.state_layout`; the leaves' bytes per device and their pairing with the
step's outputs in :mod:`~jaxmem.memory.state_leaves`. This module holds the selection, the
streamed step and its placement, and the weighing against the budget.

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxmem
  >>> tx = optax.adam(1e-3)
  >>> def step(w, opt_state, x):
  ...     g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
  ...     updates, opt_state = tx.update(g, opt_state)
  ...     return optax.apply_updates(w, updates), opt_state
  >>> w = jnp.ones((32, 32))
  >>> fast = jaxmem.optimize(step, offload_state=True, strategy="none")
  >>> w, opt_state = fast(w, tx.init(w), jnp.ones((4, 32)))
  >>> opt_state[0].mu.sharding.memory_kind
  'pinned_host'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from jaxmem import _jax
from jaxmem.memory import param_offload
from jaxmem.memory.state_layout import _external, _last_gradient, _layout
from jaxmem.memory.state_leaves import (
    _fractions,
    _nbytes,
    _pair_outputs,
    _param_bytes,
    _shard_bytes,
)
from jaxmem.tracing.program import Program, from_jaxpr
from jaxmem.xla.measure import fmt_bytes

__all__ = ["StateOffload", "place", "preview", "select", "stream", "to_host", "with_budget",
           "wrap"]

MODES = (True, False, "opt", "auto", "all")

#: Leaves smaller than this stay on the device (adam's count, schedules' scalars): every
#: group reads them, so offloading them would merge all groups into one.
MIN_BYTES = 1024

#: Groups in flight: group ``k`` is fetched once group ``k - WINDOW`` is written back. 2: one
#: group updated while the next one arrives (prefetch); 1: one group at a time.
WINDOW = 2

Predicate = Callable[[tuple[Any, ...], Any], bool]


@dataclasses.dataclass(frozen=True)
class StateOffload:
    """Which leaves of the train state live in host memory, and what that moves per step.

    Attributes:
      inputs: flat argument positions held in ``pinned_host`` between steps.
      outputs: flat output positions written back to ``pinned_host`` (their new values).
      names: the leaves' pytree paths (``keystr``), in ``inputs`` order.
      nbytes: bytes of the offloaded state (what leaves the device); like every byte count
        here, per device: a sharded (FSDP) leaf counts its shard.
      largest_group: bytes of the largest group fetched at once (one layer's slice, the two
        moments of one parameter).
      groups: how many groups the update was split into.
      param_bytes: bytes of those leaves the model reads too (the parameters, with
        ``offload_state="all"``; part of ``nbytes``).
      fetch_bytes: bytes fetched per step for the forward and backward passes' reads of the
        parameters (one fetch per reading equation; :mod:`jaxmem.memory.param_offload`).
    """

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    names: tuple[str, ...]
    nbytes: int
    largest_group: int = 0
    groups: int = 0
    param_bytes: int = 0
    fetch_bytes: int = 0

    @property
    def link_bytes(self) -> int:
        """Bytes over the host link per step: every leaf fetched for the update and written
        back once, and the parameters fetched again for each forward or backward read."""
        return 2 * self.nbytes + self.fetch_bytes

    def transfer_time(self, profile: Any = "h100") -> float:
        """Predicted seconds the host link needs per step on ``profile``
        (:class:`jaxmem.DeviceProfile` or a preset name), both directions in turn."""
        from jaxmem.analyzing.costmodel import DeviceProfile
        return DeviceProfile.get(profile).transfer_time(self.link_bytes)

    def describe(self, profile: Any = "h100") -> str:
        """One line for a plan's notes: what moves and what it costs."""
        from jaxmem.analyzing.costmodel import DeviceProfile
        prof = DeviceProfile.get(profile)
        params = (f" (parameters {fmt_bytes(self.param_bytes)}, fetched again before each "
                  f"forward and backward use: {fmt_bytes(self.fetch_bytes)})"
                  if self.param_bytes else "")
        return (f"optimizer state in host memory: {len(self.inputs)} leaves, "
                f"{fmt_bytes(self.nbytes)} off the device{params}, streamed in "
                f"{self.groups} groups "
                f"(largest {fmt_bytes(self.largest_group)}); {fmt_bytes(self.link_bytes)} "
                f"over the host link per step, {1e3 * self.transfer_time(prof):.1f} ms at "
                f"{prof.host_bw / 1e9:.0f} GB/s ({prof.name})")


def select(program: Program, args: Any, outs: Any, mode: bool | str | Predicate
           ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    """The flat input positions to keep in host memory, their outputs, and their names.

    Args:
      program: the step's traced program (its phases say which inputs the forward and
        backward passes read).
      args: the step's ``(dyn_args, kwargs)``, as traced.
      outs: the step's output pytree (shapes suffice), to pair each leaf with its new value.
      mode: ``True`` / ``"opt"`` / ``"auto"``: floating leaves of at least
        :data:`MIN_BYTES` that only the optimizer update reads (neither the forward nor the
        backward pass does): the optimizer state. ``"all"``: those and the parameters (leaves
        the model reads that the update reads too and gives a new value;
        :mod:`jaxmem.memory.param_offload`). A callable ``mode(path, leaf) -> bool``
        picks leaves by pytree path instead (only leaves the forward and backward do not
        read).

    Returns:
      ``(inputs, outputs, names)``; an input whose new value cannot be found among the
      outputs (same path after the argument index, or the one output of its shape made
      from it alone) is left on the device.
    """
    in_leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    out_leaves = jax.tree_util.tree_flatten_with_path(outs)[0]
    read_by_model = param_offload.model_reads(program)
    start = param_offload.update_start(program)
    by_update = {v for n in program.nodes[start:] for v in n.inputs}
    chosen = []
    for pos, (path, leaf) in enumerate(in_leaves):
        vid = program.inputs[pos]
        if callable(mode):
            if not mode(path, leaf):
                continue
            if vid in read_by_model:
                raise ValueError(
                    f"jaxmem.optimize(offload_state=...): the leaf {jax.tree_util.keystr(path)}"
                    f" {getattr(leaf, 'shape', '')} is read by the forward or backward pass; "
                    "only optimizer state (read by the update alone) can live in host memory. "
                    "Narrow the predicate (e.g. to paths under 'opt_state').")
        elif not (_jax.is_floating(leaf) and _nbytes(leaf) >= MIN_BYTES and vid in program.users
                  and (vid not in read_by_model or (mode == "all" and vid in by_update))):
            continue
        chosen.append(pos)
    pairs = _pair_outputs(program, in_leaves, out_leaves, chosen)
    inputs = tuple(p for p in chosen if p in pairs)
    return (inputs, tuple(pairs[p] for p in inputs),
            tuple(jax.tree_util.keystr(in_leaves[p][0]) for p in inputs))


def stream(fn: Callable[..., list[Any]], avals: Sequence[Any], inputs: Sequence[int],
           outputs: Sequence[int], window: int | None = None
           ) -> tuple[Callable[..., list[Any]], int, int, int]:
    """``fn`` (flat inputs -> flat outputs) with the state at ``inputs`` read from host
    memory and its new values (``outputs``) written back there, streamed group by group;
    state the forward or backward pass reads (parameters) is also fetched before each of
    those reads (:mod:`jaxmem.memory.param_offload`).

    Returns ``(new_fn, groups, largest_group_bytes, per_use_fetch_bytes)``.
    """
    window = WINDOW if window is None else max(1, int(window))
    fractions = _fractions(avals, inputs)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             if hasattr(a, "shape") and hasattr(a, "dtype") else a for a in avals]
    program = from_jaxpr(jax.make_jaxpr(fn)(*avals))
    state = frozenset(program.inputs[i] for i in inputs)
    written = [program.outputs[j] for j in outputs]
    params, groups, largest, per_use, again = _layout(program, inputs, outputs, fractions)
    in_group = {i for g in groups for i in g.nodes}
    last = _last_gradient(program, groups)

    def run(*flat: Any) -> list[Any]:
        env: dict[int, Any] = dict(zip(program.inputs, flat, strict=True))
        for v in program.values:
            if v.is_const:
                env[v.id] = v.const
        host_in = {s: env[s] for s in state}
        for n in program.nodes:
            if n.index in again:
                env.update(zip(n.outputs, (env[o] for o in program.nodes[again[n.index]].outputs),
                               strict=True))
            elif n.index not in in_group:
                _emit(n, env, param_offload.fetched(program, n.index, params, env)
                      if params else None)
        back: dict[int, Any] = {}         # written value id -> its host copy
        done: list[list[Any]] = []        # per group, the host copies it wrote
        for k, g in enumerate(groups):
            tie = [env[v] for v in _external(program, g) if v in env]
            if k >= window:
                tie += done[k - window]
            elif last is not None and last in env:
                tie.append(env[last])  # the first groups wait for the backward pass's end
            leaves = [host_in[s] for s in g.inputs]
            if tie:
                leaves, _ = lax.optimization_barrier((leaves, tie))
            for s, x in zip(g.inputs, leaves, strict=True):
                env[s] = jax.device_put(x, _jax.device_space())
            for i in g.nodes:
                _emit(program.nodes[i], env)
            mine = []
            for v in g.outputs:
                back[v] = jax.device_put(env[v], _jax.host_space())
                mine.append(back[v])
            done.append(mine)
        outs = []
        for j, v in enumerate(program.outputs):
            if v in back:
                outs.append(back[v])
            elif v in state:  # the state passed through unchanged
                outs.append(host_in[v] if program.outputs[j] in written
                            else jax.device_put(host_in[v], _jax.device_space()))
            else:
                outs.append(env[v])
        return outs

    return run, len(groups), largest, per_use


def _emit(n: Any, env: dict[int, Any], subs: dict[int, Any] | None = None) -> None:
    """Bind node ``n`` on ``env``'s values (``subs`` overriding some: fetched parameters)."""
    subs = subs or {}
    with _jax.user_context(n.eqn.source_info.traceback, n.stack):
        outs = _jax.bind(n.eqn, *[subs[v] if v in subs else env[v] for v in n.inputs])
    for o, x in zip(n.outputs, outs, strict=True):
        env[o] = x


def to_host(tree: Any) -> Any:
    """``tree``'s arrays moved to ``pinned_host`` memory on the devices they are on (abstract
    ``jax.ShapeDtypeStruct`` leaves and non-arrays pass through). ``optimize(...,
    offload_state=True)`` does this itself for the state it keeps there."""
    def move(x: Any) -> Any:
        s = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and s is not None and s.memory_kind != "pinned_host":
            return jax.device_put(x, s.with_memory_kind("pinned_host"))
        return x
    return jax.tree.map(move, tree)


def place(flat: Sequence[Any], positions: Sequence[int]) -> list[Any]:
    """``flat`` with the leaves at ``positions`` in ``pinned_host`` memory: arrays are moved
    (a no-op once a step has returned them there); abstract leaves get a ``pinned_host``
    sharding where their device has host memory kinds (a compile-only GPU topology device has
    none: there the donated state is placed in host memory by aliasing its host output)."""
    out = list(flat)
    for i in positions:
        x = out[i]
        s = getattr(x, "sharding", None)
        if s is None or getattr(s, "memory_kind", None) == "pinned_host":
            continue
        if isinstance(x, jax.Array):
            out[i] = jax.device_put(x, s.with_memory_kind("pinned_host"))
        elif isinstance(x, jax.ShapeDtypeStruct):
            hs = s.with_memory_kind("pinned_host")
            if hs.memory_kind == "pinned_host":
                out[i] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=hs,
                                              weak_type=x.weak_type)
    return out


def device_view(x: Any) -> Any:
    """``x`` as if on the device: a leaf in ``pinned_host`` memory becomes a
    ``jax.ShapeDtypeStruct`` with the device memory kind (what the step is traced, keyed
    and compared against jax.jit with), anything else passes through. A state leaf the step
    returned in host memory thus hits the cache entry its first (device) call made."""
    s = getattr(x, "sharding", None)
    if getattr(s, "memory_kind", None) == "pinned_host":
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.with_memory_kind("device"),
                                    weak_type=getattr(x, "weak_type", False))
    return x


def wrap(jitted: Any, program: Program, args: Any, flat: Sequence[Any],
         donate_flat: Sequence[int], mode: bool | str | Predicate, device: Any,
         jit_kwargs: dict[str, Any], window: int | None = None
         ) -> tuple[Any, StateOffload | None]:
    """``jitted`` (a ``jax.jit`` of a flat step) with the optimizer state streamed from host
    memory, ``window`` groups in flight (default :data:`WINDOW`): the jit of
    :func:`stream`'s function and the :class:`StateOffload` it carries out (None, and
    ``jitted`` unchanged, when no leaf qualifies)."""
    kinds = _jax.memory_kinds(device)
    if "pinned_host" not in kinds:
        platform = getattr(device, "platform", "this backend")
        raise ValueError(
            f"jaxmem.optimize(offload_state=...): the optimizer state needs a 'pinned_host' "
            f"memory kind to live in, but the {platform} device has "
            f"{sorted(kinds) or 'none'}; pass offload_state=False, or compile for a target "
            "with host memory (GPU, TPU, CPU)")
    inputs, outputs, names = select(program, args, _out_shapes(program), mode)
    if not inputs:
        return jitted, None
    fn, groups, largest, per_use = stream(jitted.__wrapped__, flat, inputs, outputs, window)
    info = StateOffload(inputs, outputs, names, sum(_shard_bytes(flat[i]) for i in inputs),
                        largest, groups, _param_bytes(program, inputs, flat), per_use)
    return jax.jit(fn, donate_argnums=tuple(donate_flat),
                   out_shardings=_out_shardings(program, flat, inputs, outputs),
                   **jit_kwargs), info


def _out_shardings(program: Program, flat: Sequence[Any], inputs: Sequence[int],
                   outputs: Sequence[int]) -> list[Any] | None:
    """``out_shardings`` for the streamed step: each written-back state leaf keeps its
    input's sharding in ``pinned_host`` memory, everything else is left to the compiler
    (None).

    jax aliases a donated input to its output (``tf.aliasing_output``) only when the output's
    sharding is given; otherwise it leaves the donation to XLA (``jax.buffer_donor``), which
    does not alias across memory kinds. With the alias, XLA places the donated state in the
    host memory its new value is written to, also on a compile-only topology (whose
    shardings carry no memory kind): without it, a sharded (FSDP) state would stay on the
    device. None when no input has a sharding (the defaults apply)."""
    out: list[Any] = [None] * len(program.outputs)
    for i, j in zip(inputs, outputs, strict=True):
        s = getattr(flat[i], "sharding", None)
        try:
            out[j] = s.with_memory_kind("pinned_host")
        except (AttributeError, NotImplementedError, ValueError):
            return None  # no sharding to keep (or none that takes a memory kind)
    return out


def _out_shapes(program: Program) -> Any:
    """The step's outputs as ``ShapeDtypeStruct`` s, in their pytree."""
    return jax.tree_util.tree_unflatten(program.out_tree, [
        jax.ShapeDtypeStruct(v.shape, v.aval.dtype if v.aval is not None else v.dtype)
        for v in (program.values[o] for o in program.outputs)])


def preview(program: Program, args: Any, mode: bool | str | Predicate,
            flat: Sequence[Any]) -> StateOffload | None:
    """What offloading the state would move, from the step's own program (before any
    rewrite): the :class:`StateOffload` :func:`wrap` would carry out, or None."""
    inputs, outputs, names = select(program, args, _out_shapes(program), mode)
    if not inputs:
        return None
    _, groups, largest, per_use, _ = _layout(program, inputs, outputs,
                                             _fractions(flat, inputs))
    return StateOffload(inputs, outputs, names, sum(_shard_bytes(flat[i]) for i in inputs),
                        largest, len(groups), _param_bytes(program, inputs, flat), per_use)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms/step"


def with_budget(search: Callable[[Any, int], Any], budget: Any, mode: bool | str | Predicate,
                info: StateOffload | None, plain_peak: Callable[[], int],
                profile: Any = "h100") -> tuple[Any, int]:
    """The budget search, weighing the state's offload against residual recompute/offload.

    ``search(budget, window) -> Plan`` is the residual planner
    (:func:`jaxmem.plan_with_budget`): ``window`` 0 plans the step as it is; a positive
    ``window`` plans the step with the state streamed from host memory, ``window`` groups
    in flight (:func:`stream`), each candidate checked by that step's compiled peak. With
    ``mode="auto"``, when the residual plan alone meets the budget its recompute time (its
    FLOPs at the profile's rate) is weighed against the state's time on the host link
    (:meth:`StateOffload.transfer_time`, none of it assumed hidden): the state stays on the
    device unless moving it costs less, and then the residuals are planned again on the
    streamed step and the cheaper of the two runs. When the residual plan cannot meet the
    budget, and always with ``mode=True``, the state goes to host memory: :data:`WINDOW`
    groups in flight, or one at a time when only that fits (the update then waits for each
    group's fetch).

    Returns ``(plan, window)``: ``window`` is the number of state groups in flight while
    the state streams from host memory, 0 where it stays on the device; the plan's notes
    say what moves and its cost.
    """
    from jaxmem.analyzing.costmodel import DeviceProfile
    from jaxmem.planning.budget.units import BudgetError, resolve_budget
    if not mode or info is None:
        return search(budget, 0), 0
    prof = DeviceProfile.get(profile)
    link = info.transfer_time(prof)
    cost = f"{1e3 * link:.1f} ms/step over the host link ({prof.name})"
    if mode == "auto":
        try:
            plan = search(budget, 0)
        except BudgetError as e:
            why = f"residuals alone reach {fmt_bytes(e.minimum_bytes)}"
        else:
            recompute = plan.recompute_flops / prof.flops_per_s
            kept = (f"optimizer state kept on the device: the budget is met without moving "
                    f"its {fmt_bytes(info.nbytes)} ({_ms(recompute)} of recompute; "
                    f"offloading it would cost {cost})")
            if recompute <= link:
                return dataclasses.replace(plan, notes=plan.notes + (kept,)), 0
            b = resolve_budget(budget, plain_peak())
            try:
                moved = search(b, WINDOW)
            except BudgetError:
                return dataclasses.replace(plan, notes=plan.notes + (kept,)), 0
            other = moved.recompute_flops / prof.flops_per_s
            if other + link >= recompute:
                return dataclasses.replace(plan, notes=plan.notes + (kept,)), 0
            note = (f"budget {fmt_bytes(b)}: optimizer state to host memory ({cost}) with "
                    f"{_ms(other)} of recompute, against {_ms(recompute)} of recompute "
                    f"with the state on the device; {STREAMED_PEAKS}")
            return dataclasses.replace(moved, budget=b, notes=moved.notes + (note,)), WINDOW
    else:
        why = "offload_state=True"
    b = resolve_budget(budget, plain_peak())
    window = WINDOW
    try:
        plan = search(b, window)
    except BudgetError:
        # One group in flight keeps one group's bytes fewer on the device (a scanned
        # model's stacked moments are one group per parameter: 14 GiB each at 8B), at the
        # cost of the prefetch: each group's fetch waits for the previous group's write-back.
        if info.groups <= 1:
            raise
        window = 1
        plan = search(b, window)
    inflight = ("" if window == WINDOW else
                "; one group in flight (no prefetch): with two nothing fitted")
    note = (f"budget {fmt_bytes(b)} ({why}): optimizer state to host memory "
            f"({fmt_bytes(info.nbytes)} off the device) for {cost}; {STREAMED_PEAKS}"
            f"{inflight}")
    return dataclasses.replace(plan, budget=b, notes=plan.notes + (note,)), window


#: How a plan searched with the state streamed says what its peaks are.
STREAMED_PEAKS = ("residuals searched on the streamed step's compiled peaks (in the "
                  "search's figures above, each plus the state's bytes it takes off the "
                  "device, against the budget plus the same)")
