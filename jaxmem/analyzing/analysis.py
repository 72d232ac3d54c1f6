"""Backward data-dependency analysis: which forward values does the backward pass read?

Second box of the data flow: ``Program -> Analysis``. A *residual* is a value made outside
the backward pass (forward, loss glue, or a program input) that a backward node reads. For
each one jaxmem records its producer layer and primitive, its kind (MEDL's heavy / utility /
free), the backward nodes that read it, and what it would cost to recompute: the FLOPs and
bytes of the chain of cheap nodes that re-creates it from *anchors* (program inputs and the
outputs of heavy layers, control-flow units, unknown or effectful primitives; see
:mod:`jaxmem.analyzing.chains`).

A liveness pass over program order (:mod:`jaxmem.analyzing.liveness`) gives a memory timeline and a
predicted peak.
"""

from __future__ import annotations

import dataclasses
import html
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from jaxmem.analyzing.chains import chain_start, is_anchor, replay_chain
from jaxmem.analyzing.liveness import liveness
from jaxmem.tracing.primitives import CHEAP, Kind
from jaxmem.tracing.program import Node, Program, TraceError, flat_donated, trace
from jaxmem.xla.measure import fmt_bytes


@dataclasses.dataclass(frozen=True)
class Residual:
    """A forward value the backward pass reads.

    Attributes:
      name: readable id, ``"<layer>/<primitive>#<value id>"``.
      value: the value's id in the :class:`~jaxmem.program.Program`.
      shape, dtype, nbytes: the array it is.
      layer: producing layer path from the name stack (``""`` at top level).
      primitive: producing primitive, ``"argument"`` or ``"constant"``.
      kind: the producer's :class:`~jaxmem.primitives.Kind` (``heavy``, ``utility``,
        ``free``, ``control``, ``unknown``) or ``argument`` / ``constant``.
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
    kind: Kind
    readers: tuple[int, ...]
    recompute_flops: float
    recompute_bytes: float
    chain: tuple[int, ...] = dataclasses.field(repr=False)
    produced_at: int = -1

    @property
    def is_utility(self) -> bool:
        """Made by a utility or free primitive: what MEDL's rule recomputes (budget plans
        may recompute heavy outputs too)."""
        return self.kind in CHEAP

    @property
    def recomputable(self) -> bool:
        """Deprecated: :attr:`is_utility` (budget plans recompute heavy outputs too)."""
        warnings.warn("Residual.recomputable is deprecated; use Residual.is_utility",
                      DeprecationWarning, stacklevel=2)
        return self.is_utility

    @property
    def is_activation(self) -> bool:
        """Made by the program (not an argument or a constant)."""
        return self.kind not in (Kind.ARGUMENT, Kind.CONSTANT)


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
    renders as HTML. ``peak_bytes`` is predicted for the compiler named by ``platform``
    (``"cpu"``, ``"cuda"``, ``"tpu"``; TPU uses the CPU rules).
    """

    program: Program = dataclasses.field(repr=False)
    residuals: tuple[Residual, ...]
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    live_bytes: tuple[int, ...] = dataclasses.field(repr=False)
    mode: Literal["step", "loss", "forward"] = "step"
    notes: tuple[str, ...] = ()
    platform: str = "cpu"

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
    def utility_bytes(self) -> int:
        """Bytes MEDL's rule would drop: residuals made by utility or free layers."""
        return sum(r.nbytes for r in self.residuals if r.is_utility)

    @property
    def recomputable_bytes(self) -> int:
        """Deprecated: :attr:`utility_bytes`."""
        warnings.warn("Analysis.recomputable_bytes is deprecated; use Analysis.utility_bytes",
                      DeprecationWarning, stacklevel=2)
        return self.utility_bytes

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
        """Rows ``(layer, count, bytes, utility bytes)``, largest first."""
        acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.residuals:
            key = r.layer or ("<arguments>" if not r.is_activation else "<top>")
            row = acc[key]
            row[0] += 1
            row[1] += r.nbytes
            row[2] += r.nbytes if r.is_utility else 0
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
                f"{fmt_bytes(self.utility_bytes)} recomputable); predicted peak "
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
                         f"{fmt_bytes(self.utility_bytes):>13}")
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


# --- residuals ---------------------------------------------------------------------------

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
    from_anchors = chain_start(program)
    for vid, rd in readers.items():
        v = program.values[vid]
        if v.nbytes == 0 or vid in program.constant_derived:
            continue  # XLA re-derives a broadcast constant in place: nothing is stored
        if v.producer is None:
            kind = Kind.ARGUMENT if v.is_input else Kind.CONSTANT
            layer, prim, chain = "", str(kind), ()
            if kind is Kind.CONSTANT and not v.shape:
                continue  # scalar literals are inlined into the code
        else:
            node = nodes[v.producer]
            kind, layer, prim = node.kind, node.layer, node.primitive
            cheap = kind in CHEAP and not is_anchor(program, vid)
            chain = tuple(replay_chain(program, [vid], from_anchors)[0]) if cheap else ()
        flops = sum(nodes[i].flops for i in chain)
        moved = sum(nodes[i].bytes_moved for i in chain)
        name = f"{layer + '/' if layer else ''}{prim}#{vid}"
        out.append(Residual(
            name=name, value=vid, shape=v.shape, dtype=v.dtype, nbytes=v.nbytes, layer=layer,
            primitive=prim, kind=kind, readers=tuple(rd), recompute_flops=float(flops),
            recompute_bytes=float(moved), chain=chain,
            produced_at=-1 if v.producer is None else v.producer))
    return tuple(sorted(out, key=lambda r: (r.produced_at, r.value)))


# --- entry point --------------------------------------------------------------------------

def _is_scalar_float(x: Any) -> bool:
    return (getattr(x, "shape", None) == () and
            np.issubdtype(np.dtype(getattr(x, "dtype", np.int32)), np.floating))


def analyze(fn: Callable[..., Any], *args: Any, argnums: int | Sequence[int] | None = None,
            has_aux: bool = False, donate_argnums: int | Sequence[int] = (),
            target: Any = None, **kwargs: Any) -> Analysis:
    """Analyse which forward values ``fn``'s backward pass keeps, and predict its peak.

    Args:
      fn: a train step (it already takes a gradient inside) or a scalar loss. A loss is
        analysed under ``jax.value_and_grad`` with respect to ``argnums`` (default 0).
      *args, **kwargs: example arguments (arrays, or ``jax.ShapeDtypeStruct``).
      argnums: for a loss, the arguments to differentiate; forces loss mode.
      has_aux: for a loss returning ``(loss, aux)``; forces loss mode.
      donate_argnums: positional arguments donated to the compiled step (as for
        ``jax.jit``; a train step's state is ``0``): outputs written into them cost nothing.
      target: the compiler the peak is predicted for: a :mod:`jaxmem.targets` name or
        :class:`~jaxmem.targets.Target` (``"h100"``, ``"cpu"``, ...); by default where the
        arguments live (:func:`jaxmem.targets.platform_of`), else the default backend.
        XLA:GPU and XLA:CPU fuse, convert and schedule differently (:mod:`jaxmem.analyzing.fusion`).

    Returns:
      An :class:`Analysis`. For a function with no backward pass that is not a scalar loss,
      the Analysis has no residuals and a note saying so.

    Example:
      >>> import jax.numpy as jnp, jaxmem
      >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
      >>> a = jaxmem.analyze(loss, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> "tanh" in [r.primitive for r in a.residuals if r.is_activation]
      True
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
    donated = flat_donated(args, donate_argnums)
    return _analysis(program, mode, tuple(notes), donated, _platform(target, args, kwargs))


def _platform(target: Any, args: Any, kwargs: Any) -> str:
    """The compiler the prediction is for: ``target`` (a name or :class:`~jaxmem.targets.Target`)
    or where the arguments live (the default backend when they do not say)."""
    from jaxmem.xla import targets

    if target is None:
        found = targets.platform_of((args, kwargs)) or jax.default_backend()
        return "cuda" if found in ("gpu", "cuda") else found
    return target.platform if isinstance(target, targets.Target) else targets.get(target).platform


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


def _analysis(program: Program, mode: Any, notes: tuple[str, ...],
              donated: Sequence[int] = (), platform: str = "cpu") -> Analysis:
    residuals = find_residuals(program)
    peak, live, out_bytes = liveness(program, donated=donated, platform=platform)
    arg_bytes = sum(program.values[i].nbytes for i in program.inputs)
    if program.unknown_primitives:
        notes = notes + (f"{len(program.unknown_primitives)} unknown primitive(s) treated as "
                         "heavy (outputs kept): " + ", ".join(program.unknown_primitives),)
    return Analysis(program=program, residuals=residuals, peak_bytes=peak,
                    argument_bytes=arg_bytes, output_bytes=out_bytes, live_bytes=live,
                    mode=mode, notes=notes, platform=platform)


def from_program(program: Program, *, donated: Sequence[int] = (),
                 platform: str = "cpu") -> Analysis:
    """Analyse an already traced :class:`Program`. ``donated``: positions among its flat
    inputs that are donated; ``platform``: the compiler the peak is predicted for
    (``"cpu"``, ``"cuda"``, ``"tpu"``)."""
    mode = "step" if program.has_backward else "forward"
    return _analysis(program, mode, (), donated, platform)
