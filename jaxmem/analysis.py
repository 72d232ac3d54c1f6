"""Backward data-dependency analysis: which forward values does the backward pass read?

Second box of the data flow: ``Program -> Analysis``. A *residual* is a value made outside
the backward pass (forward, loss glue, or a program input) that a backward node reads. For
each one jaxmem records its producer layer and primitive, its kind (MEDL's heavy / utility /
free), the backward nodes that read it, and what it would cost to recompute: the FLOPs and
bytes of the chain of cheap nodes that re-creates it from *anchors* (program inputs and the
outputs of heavy layers, control-flow units, unknown or effectful primitives).

A liveness pass over program order gives a memory timeline and a predicted peak. It models
XLA's fusion coarsely: an elementwise or layout-only value whose every reader is another
elementwise/layout node in the same phase is assumed fused away (never materialised).
"""

from __future__ import annotations

import dataclasses
import functools
import html
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from jaxmem import _jax
from jaxmem.measure import fmt_bytes
from jaxmem.program import Node, Program, TraceError, trace

ResidualKind = Literal["heavy", "utility", "free", "control", "unknown", "argument", "constant"]
_FUSIBLE = ("utility", "free")
_REDUCTIONS = ("reduce_", "argm", "cum", "reduce_window", "select_and")


@dataclasses.dataclass(frozen=True)
class Residual:
    """A forward value the backward pass reads.

    Attributes:
      name: readable id, ``"<layer>/<primitive>#<value id>"``.
      value: the value's id in the :class:`~jaxmem.program.Program`.
      shape, dtype, nbytes: the array it is.
      layer: producing layer path from the name stack (``""`` at top level).
      primitive: producing primitive, ``"argument"`` or ``"constant"``.
      kind: the producer's kind (``heavy``, ``utility``, ``free``, ``control``, ``unknown``)
        or ``argument`` / ``constant``.
      readers: indices of the backward nodes that read it.
      recompute_flops, recompute_bytes: cost of re-creating it from anchors.
      chain: indices of the nodes that re-create it, in program order.
      produced_at: index of the producing node (-1 for arguments and constants).
    """

    name: str
    value: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    layer: str
    primitive: str
    kind: ResidualKind
    readers: tuple[int, ...]
    recompute_flops: float
    recompute_bytes: float
    chain: tuple[int, ...] = dataclasses.field(repr=False)
    produced_at: int = -1

    @property
    def recomputable(self) -> bool:
        """Whether jaxmem can drop it and re-create it from anchors (MEDL's utility outputs)."""
        return self.kind in ("utility", "free")

    @property
    def is_activation(self) -> bool:
        """Made by the program (not an argument or a constant)."""
        return self.kind not in ("argument", "constant")


@dataclasses.dataclass(frozen=True)
class Bottleneck:
    """One layer whose own working set is a large share of the peak (MEDL's bottleneck).

    Attributes:
      layer: the layer path (``""`` for top-level code such as a loss head).
      primitive: the primitive making the largest value.
      shape, dtype, nbytes: that value.
      share: ``nbytes / predicted peak``.
      suggestion: what to do, with the predicted saving at 16 chunks.
    """

    layer: str
    primitive: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    share: float
    suggestion: str


@dataclasses.dataclass(frozen=True, eq=False)
class Analysis:
    """What the backward pass keeps, by layer, and the predicted memory timeline.

    Build it with :func:`analyze`. Print it for a table grouped by layer; in a notebook it
    renders as HTML.
    """

    program: Program = dataclasses.field(repr=False)
    residuals: tuple[Residual, ...]
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    live_bytes: tuple[int, ...] = dataclasses.field(repr=False)
    mode: Literal["step", "loss", "forward"] = "step"
    notes: tuple[str, ...] = ()

    @property
    def has_backward(self) -> bool:
        return self.program.has_backward

    @property
    def residual_bytes(self) -> int:
        """Bytes of every residual, arguments included (what JAX's ``saved_residuals`` lists)."""
        return sum(r.nbytes for r in self.residuals)

    @property
    def activation_bytes(self) -> int:
        """Bytes of the residuals the program makes (arguments and constants excluded)."""
        return sum(r.nbytes for r in self.residuals if r.is_activation)

    @property
    def recomputable_bytes(self) -> int:
        """Bytes MEDL's rule would drop: residuals made by utility or free layers."""
        return sum(r.nbytes for r in self.residuals if r.recomputable)

    @property
    def unknown_primitives(self) -> tuple[str, ...]:
        return self.program.unknown_primitives

    def bottlenecks(self, threshold: float = 0.25, chunks: int = 16) -> list[Bottleneck]:
        """Layers making one value of at least ``threshold`` of the predicted peak.

        Chunking such a layer along its batch or token axis (:func:`jaxmem.chunked`, or
        :func:`jaxmem.chunked_cross_entropy` for a logits + cross-entropy head) holds about
        two chunks of it at a time; the suggestion quotes ``nbytes * (1 - 2 / chunks)``.
        """
        if not self.peak_bytes:
            return []
        best: dict[str, tuple[int, Node, Any]] = {}
        for n in self.program.nodes:
            if n.phase == "backward":
                continue
            for o in n.outputs:
                v = self.program.values[o]
                if v.nbytes > best.get(n.layer, (0, None, None))[0]:
                    best[n.layer] = (v.nbytes, n, v)
        out = []
        for layer, (nbytes, node, v) in best.items():
            share = nbytes / self.peak_bytes
            if share < threshold:
                continue
            saving = fmt_bytes(nbytes * (1 - 2 / chunks))
            readers = {self.program.nodes[i].primitive for i in self.program.users.get(v.id, ())}
            if node.primitive == "dot_general" and readers & {"reduce_max", "exp", "sub"}:
                hint = (f"logits feeding a softmax: jaxmem.chunked_cross_entropy(..., "
                        f"token_chunks={chunks}) never materialises them (saves ~{saving})")
            else:
                hint = (f"run it with jaxmem.chunked(..., chunks={chunks}) along its batch or "
                        f"token axis (saves ~{saving})")
            out.append(Bottleneck(layer=layer, primitive=node.primitive, shape=v.shape,
                                  dtype=v.dtype, nbytes=nbytes, share=share, suggestion=hint))
        return sorted(out, key=lambda b: -b.nbytes)

    def by_layer(self) -> list[tuple[str, int, int, int]]:
        """Rows ``(layer, count, bytes, recomputable bytes)``, largest first."""
        acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.residuals:
            key = r.layer or ("<arguments>" if r.kind in ("argument", "constant") else "<top>")
            row = acc[key]
            row[0] += 1
            row[1] += r.nbytes
            row[2] += r.nbytes if r.recomputable else 0
        rows = [(k, c, b, u) for k, (c, b, u) in acc.items()]
        return sorted(rows, key=lambda t: -t[2])

    def timeline(self) -> list[tuple[int, str, int]]:
        """``(node index, phase, predicted live bytes after it)`` in program order."""
        return [(n.index, n.phase, b) for n, b in zip(self.program.nodes, self.live_bytes,
                                                      strict=True)]

    def plot(self, ax: Any = None, title: str | None = None) -> Any:
        """Memory over program order, forward/backward shaded, peak annotated (matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("Analysis.plot needs matplotlib: pip install 'jaxmem[plot]'") from e
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3))
        xs = np.arange(len(self.live_bytes))
        ys = np.asarray(self.live_bytes, dtype=float) / 2**20
        ax.plot(xs, ys, lw=1.2, color="C0")
        colors = {"forward": "C2", "backward": "C3", "other": "C7"}
        start = 0
        phases = [n.phase for n in self.program.nodes]
        for i in range(1, len(phases) + 1):
            if i == len(phases) or phases[i] != phases[start]:
                ax.axvspan(start, i, color=colors[phases[start]], alpha=0.08, lw=0)
                start = i
        if len(ys):
            k = int(np.argmax(ys))
            ax.annotate(f"peak {fmt_bytes(self.peak_bytes)}", (k, ys[k]),
                        textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel("program order (node)")
        ax.set_ylabel("live MiB (predicted)")
        ax.set_title(title or "jaxmem memory timeline (green: forward, red: backward)")
        return ax

    def summary(self) -> str:
        return (f"{len(self.residuals)} residuals, {fmt_bytes(self.residual_bytes)} "
                f"({fmt_bytes(self.activation_bytes)} made by the program, "
                f"{fmt_bytes(self.recomputable_bytes)} recomputable); predicted peak "
                f"{fmt_bytes(self.peak_bytes)}")

    def __str__(self) -> str:
        lines = [f"jaxmem.Analysis of a {self.mode}: {self.program}", self.summary()]
        lines += [f"note: {n}" for n in self.notes]
        for b in self.bottlenecks():
            lines.append(f"bottleneck: {b.layer or '<top>'} makes {b.dtype}{list(b.shape)} "
                         f"({fmt_bytes(b.nbytes)}, {100 * b.share:.0f}% of the peak): "
                         f"{b.suggestion}")
        if self.unknown_primitives:
            lines.append("unknown primitives (kept): " + ", ".join(self.unknown_primitives))
        if self.residuals:
            lines.append(f"{'layer':<40} {'n':>4} {'bytes':>12} {'recomputable':>13}")
            for layer, n, b, u in self.by_layer():
                lines.append(f"{layer[:40]:<40} {n:>4} {fmt_bytes(b):>12} {fmt_bytes(u):>13}")
            lines.append(f"{'total':<40} {len(self.residuals):>4} "
                         f"{fmt_bytes(self.residual_bytes):>12} "
                         f"{fmt_bytes(self.recomputable_bytes):>13}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(layer)}</td><td>{n}</td><td>{fmt_bytes(b)}</td>"
            f"<td>{fmt_bytes(u)}</td></tr>" for layer, n, b, u in self.by_layer())
        notes = "".join(f"<p><i>{html.escape(n)}</i></p>" for n in self.notes)
        return (f"<div><b>jaxmem.Analysis</b> ({html.escape(self.mode)}): "
                f"{html.escape(self.summary())}{notes}<table><thead><tr><th>layer</th>"
                f"<th>n</th><th>bytes</th><th>recomputable</th></tr></thead><tbody>{rows}"
                f"</tbody></table></div>")


# --- residuals and recompute chains -------------------------------------------------------

def is_anchor(program: Program, vid: int) -> bool:
    """Values recompute chains start from: inputs, constants, heavy/unit/unknown outputs."""
    v = program.values[vid]
    if v.producer is None:
        return True
    node = program.nodes[v.producer]
    if node.kind not in _FUSIBLE or node.phase == "backward":
        return True
    return bool(getattr(node.eqn, "effects", None))


def storable(program: Program, residual_ids: Iterable[int]) -> tuple[frozenset[int],
                                                                   frozenset[int]]:
    """Forward values the rewrite keeps unless told otherwise: ``(droppable, fixed)``.

    Residuals and chain anchors made outside the backward pass. ``fixed`` are those a plan
    may not drop: outputs of control-flow units, unknown primitives and effectful equations.
    """
    residual_ids = frozenset(residual_ids)
    cand: set[int] = set()
    fixed: set[int] = set()
    for v in program.values:
        if v.producer is None or v.nbytes == 0 or v.id in program.constant_derived:
            continue
        node = program.nodes[v.producer]
        if node.phase == "backward":
            continue
        if not (v.id in residual_ids or is_anchor(program, v.id)):
            continue
        if node.kind in ("control", "unknown") or getattr(node.eqn, "effects", None):
            fixed.add(v.id)
        else:
            cand.add(v.id)
    return frozenset(cand), frozenset(fixed)


def recompute_chain(program: Program, vid: int | Iterable[int],
                    anchor: Callable[[int], bool] | None = None) -> tuple[int, ...]:
    """Indices of the nodes that re-create value(s) ``vid`` from anchors, in program order."""
    anchor = anchor or functools.partial(is_anchor, program)
    seen: set[int] = set()
    stack = [vid] if isinstance(vid, int) else list(vid)
    while stack:
        v = stack.pop()
        if anchor(v):
            continue
        n = program.values[v].producer
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(program.nodes[n].inputs)
    return tuple(sorted(seen))


def replay_chain(program: Program, targets: Sequence[int], kept: Callable[[int], bool],
                 available: Iterable[int] = ()) -> tuple[list[int], list[int]]:
    """What re-creating ``targets`` replays, given which values are kept.

    Returns ``(nodes, starts)``: the indices of the nodes to replay, in program order, and the
    values they start from (kept values, and the program inputs or constants reached), in
    discovery order. Values in ``available`` (re-created earlier) are neither walked nor
    returned. The rewrite and the budget cost model both replay chains through this.
    """
    nodes: set[int] = set()
    starts: dict[int, None] = {}
    tset, done = set(targets), set(available)
    stack = list(targets)
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in done:
            continue
        if v not in tset and kept(v):
            starts[v] = None
            continue
        prod = program.values[v].producer
        if prod is None:
            starts[v] = None
            continue
        nodes.add(prod)
        stack.extend(program.nodes[prod].inputs)
    return sorted(nodes), list(starts)


def find_residuals(program: Program) -> tuple[Residual, ...]:
    """Every value made outside the backward pass that a backward node reads."""
    nodes = program.nodes
    readers: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        if n.phase != "backward":
            continue
        for v in dict.fromkeys(n.inputs):
            p = program.values[v].producer
            if p is None or nodes[p].phase != "backward":
                readers[v].append(n.index)
    out = []
    anchor = functools.partial(is_anchor, program)
    for vid, rd in readers.items():
        v = program.values[vid]
        if v.nbytes == 0 or vid in program.constant_derived:
            continue  # XLA re-derives a broadcast constant in place: nothing is stored
        if v.producer is None:
            kind: ResidualKind = "argument" if v.is_input else "constant"
            layer, prim, chain = "", kind, ()
            if kind == "constant" and not v.shape:
                continue  # scalar literals are inlined into the code
        else:
            node = nodes[v.producer]
            kind, layer, prim = node.kind, node.layer, node.primitive
            chain = recompute_chain(program, vid, anchor) if kind in _FUSIBLE else ()
        flops = sum(nodes[i].flops for i in chain)
        moved = sum(nodes[i].bytes_moved for i in chain)
        name = f"{layer + '/' if layer else ''}{prim}#{vid}"
        out.append(Residual(
            name=name, value=vid, shape=v.shape, dtype=v.dtype, nbytes=v.nbytes, layer=layer,
            primitive=prim, kind=kind, readers=tuple(rd), recompute_flops=float(flops),
            recompute_bytes=float(moved), chain=chain,
            produced_at=-1 if v.producer is None else v.producer))
    return tuple(sorted(out, key=lambda r: (r.produced_at, r.value)))


# --- liveness -----------------------------------------------------------------------------

def _is_reduction(name: str) -> bool:
    return name.startswith(_REDUCTIONS)


# XLA's fusion duplicates cheap elementwise producers into every consumer, backward ones
# included, but refuses to duplicate "expensive" ones (InstructionFusion::IsExpensive).
_EXPENSIVE = frozenset({
    "div", "rem", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "expm1", "log", "log1p", "pow",
    "tanh", "logistic", "erf", "erfc", "erf_inv", "atan2", "sin", "cos", "tan", "lgamma",
    "digamma", "random_bits", "threefry2x32",
})


def materialised(program: Program) -> list[bool]:
    """Per value: whether XLA is expected to give it a buffer of its own (fusion model).

    Non-fusible outputs (matmuls, convolutions, units), reductions and program outputs get a
    buffer. An elementwise or layout value read only by elementwise nodes is fused into its
    readers. If a reader sits in another phase (a residual), XLA duplicates the producer there
    when that needs no extra buffer (every operand is stored, or is itself duplicable) and it
    is not expensive (a transcendental); otherwise the value is stored.
    """
    out_set = set(program.outputs)
    users = program.users
    values = program.values
    mat = [False] * len(values)
    dup = [False] * len(values)  # fused, and re-creatable from stored values alone
    for v in values:
        if v.producer is None or v.nbytes == 0:
            dup[v.id] = v.producer is None
            continue
        node = program.nodes[v.producer]
        rd = users.get(v.id, ())
        if not rd:
            mat[v.id] = v.id in out_set
            continue
        if v.id in out_set or node.kind not in _FUSIBLE or _is_reduction(node.primitive):
            mat[v.id] = True
            continue
        if node.primitive == "device_put" and any(
                str(values[u].memory_space) != str(v.memory_space) for u in node.inputs):
            mat[v.id] = True  # a copy to (or from) host memory is a buffer of its own
            continue
        avail = node.primitive not in _EXPENSIVE and all(mat[a] or dup[a] for a in node.inputs)
        for i in rd:
            u = program.nodes[i]
            if (u.kind not in _FUSIBLE or _is_reduction(u.primitive)
                    or (u.phase != node.phase and not avail)):
                mat[v.id] = True
                break
        dup[v.id] = not mat[v.id] and avail
    return mat


def last_uses(program: Program, mat: Sequence[bool]) -> dict[int, int]:
    """Value id -> index of the last node that needs it alive (fused readers included)."""
    last: dict[int, int] = {}
    for n in program.nodes:
        for v in n.inputs:
            last[v] = n.index
    end = len(program.nodes)
    for v in program.outputs:
        last[v] = end
    # A fused value is recomputed inside each reader, so its own inputs must live as long.
    for v in reversed(program.values):
        if v.producer is None or mat[v.id] or v.id not in last:
            continue
        for u in program.nodes[v.producer].inputs:
            last[u] = max(last.get(u, -1), last[v.id])
    return last


def _unit_transient(node: Node) -> int:
    """Working set inside a control-flow unit beyond its inputs and outputs."""
    from jaxmem.program import from_jaxpr

    best = 0
    for j in _jax.sub_jaxprs(node.eqn):
        closed = jax.extend.core.ClosedJaxpr(j, [None] * len(j.constvars))
        try:
            sub = from_jaxpr(closed)
        except Exception:  # noqa: BLE001 - an estimate; never fail the analysis on it
            continue
        _, live, _ = liveness(sub, count_inputs=False)
        best = max(best, max(live, default=0))
    return best


def liveness(program: Program, *, count_inputs: bool = True,
             donated: Iterable[int] = (), device_only: bool = False
             ) -> tuple[int, tuple[int, ...], int]:
    """Predicted ``(peak, live bytes after each node, output bytes)``.

    The peak is comparable with XLA's ``argument + output + temp - alias``: inputs are live
    throughout, outputs from their producer to the end, intermediates from producer to last
    reader. Outputs that alias a ``donated`` input index are not counted twice.
    ``device_only``: values placed in host memory keep their lifetimes but are not counted.
    """
    nodes, values = program.nodes, program.values
    mat = materialised(program)
    end = len(nodes)
    last = last_uses(program, mat)
    arg_bytes = sum(values[i].nbytes for i in program.inputs) if count_inputs else 0
    # Outputs that are inputs or constants get an output buffer of their own (a copy).
    out_bytes = sum(values[v].nbytes for v in dict.fromkeys(program.outputs))
    passthrough = sum(values[v].nbytes for v in dict.fromkeys(program.outputs)
                      if values[v].producer is None)
    donated_in = [values[program.inputs[i]] for i in donated]
    alias = min(sum(v.nbytes for v in donated_in), out_bytes)
    delta = np.zeros(end + 2, dtype=np.int64)
    for v in values:
        if v.producer is None or not mat[v.id]:
            continue
        if device_only and "Host" in str(v.memory_space):
            continue
        delta[v.producer] += v.nbytes
        delta[last.get(v.id, v.producer) + 1] -= v.nbytes
    live = np.cumsum(delta)[:end]
    transient = np.zeros(end, dtype=np.int64)
    for n in nodes:
        if n.kind in ("control", "heavy") and _jax.sub_jaxprs(n.eqn):
            transient[n.index] = _unit_transient(n)
    base = arg_bytes + passthrough - alias
    series = live + transient + base
    peak = int(series.max()) if end else base
    return peak, tuple(int(x) for x in series), out_bytes


# --- entry point --------------------------------------------------------------------------

def _is_scalar_float(x: Any) -> bool:
    return (getattr(x, "shape", None) == () and
            np.issubdtype(np.dtype(getattr(x, "dtype", np.int32)), np.floating))


def analyze(fn: Callable[..., Any], *args: Any, argnums: int | Sequence[int] | None = None,
            has_aux: bool = False, **kwargs: Any) -> Analysis:
    """Analyse which forward values ``fn``'s backward pass keeps, and predict its peak.

    Args:
      fn: a train step (it already takes a gradient inside) or a scalar loss. A loss is
        analysed under ``jax.value_and_grad`` with respect to ``argnums`` (default 0).
      *args, **kwargs: example arguments (arrays, or ``jax.ShapeDtypeStruct``).
      argnums: for a loss, the arguments to differentiate; forces loss mode.
      has_aux: for a loss returning ``(loss, aux)``; forces loss mode.

    Returns:
      An :class:`Analysis`. For a function with no backward pass that is not a scalar loss,
      the Analysis has no residuals and a note saying so.

    Example:
      >>> import jax.numpy as jnp, jaxmem
      >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
      >>> a = jaxmem.analyze(loss, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> [r.primitive for r in a.residuals if r.is_activation]
      ['tanh']
    """
    if not callable(fn):
        raise TypeError(f"analyze expects a callable, got {type(fn).__name__}")
    forced_loss = argnums is not None or has_aux
    notes: list[str] = []
    mode: Literal["step", "loss", "forward"] = "step"
    if forced_loss:
        program, mode = _trace_loss(fn, args, kwargs, argnums or 0, has_aux), "loss"
    else:
        program = trace(fn, *args, **kwargs)
        if not program.has_backward:
            out = jax.eval_shape(fn, *args, **kwargs)
            if _is_scalar_float(out):
                program, mode = _trace_loss(fn, args, kwargs, 0, False), "loss"
            elif isinstance(out, jax.ShapeDtypeStruct) and out.shape:
                raise ValueError(
                    f"analyze: {getattr(fn, '__name__', 'fn')} has no backward pass and "
                    f"returns {out.dtype}{list(out.shape)}, not a scalar loss. Pass a train "
                    "step that calls jax.grad, or a loss returning a scalar (reduce with "
                    ".mean() or .sum()); use has_aux=True for (loss, aux).")
            else:
                mode = "forward"
                notes.append("the program has no backward pass (no transposed equations): "
                             "there is nothing to recompute or offload")
    return _analysis(program, mode, tuple(notes))


def _trace_loss(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                argnums: int | Sequence[int], has_aux: bool) -> Program:
    n = len(args)
    for a in (argnums,) if isinstance(argnums, int) else argnums:
        if not -n <= a < n:
            raise ValueError(f"argnums={argnums!r} but fn was given {n} positional arguments")
    try:
        out = jax.eval_shape(fn, *args, **kwargs)
    except (TypeError, ValueError) as e:
        raise TraceError(f"jaxmem could not trace {getattr(fn, '__name__', fn)}: {e}") from e
    loss_out = out[0] if has_aux else out
    if not _is_scalar_float(loss_out):
        shape = getattr(loss_out, "shape", None)
        raise ValueError(
            f"analyze: the loss must return a real scalar to be differentiated, got "
            f"{getattr(loss_out, 'dtype', type(loss_out).__name__)}{list(shape or [])}. "
            "Reduce it (.mean() / .sum()), or set has_aux=True if it returns (loss, aux).")
    vg = jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux)
    return trace(vg, *args, **kwargs)


def _analysis(program: Program, mode: Any, notes: tuple[str, ...]) -> Analysis:
    residuals = find_residuals(program)
    peak, live, out_bytes = liveness(program)
    arg_bytes = sum(program.values[i].nbytes for i in program.inputs)
    if program.unknown_primitives:
        notes = notes + (f"{len(program.unknown_primitives)} unknown primitive(s) treated as "
                         "heavy (outputs kept): " + ", ".join(program.unknown_primitives),)
    return Analysis(program=program, residuals=residuals, peak_bytes=peak,
                    argument_bytes=arg_bytes, output_bytes=out_bytes, live_bytes=live,
                    mode=mode, notes=notes)


def from_program(program: Program) -> Analysis:
    """Analyse an already traced :class:`Program`."""
    mode = "step" if program.has_backward else "forward"
    return _analysis(program, mode, ())
