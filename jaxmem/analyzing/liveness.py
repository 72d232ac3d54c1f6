"""Liveness: which values XLA gives a buffer, how long each lives, the predicted peak.

Part of the second box of the data flow (``Program -> Analysis``): the memory timeline and
predicted peak of :class:`~jaxmem.analyzing.analysis.Analysis`, and the cost model's and the
offload estimate's view of what is stored. It models the target compiler: an elementwise or
layout-only value whose every reader is another elementwise/layout node in the same phase is
fused away (never materialised), across phases as the backend's fusion duplicates it, with
the conversions and expansions it adds (:mod:`jaxmem.analyzing.fusion`); nodes run in a scheduler's
order (:mod:`jaxmem.analyzing.schedule`), and outputs written into donated inputs cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import numpy as np

from jaxmem import _jax
from jaxmem.analyzing.fusion import (
    COPIES_OPERANDS,
    aligned_bytes,
    conv_operand_copies,
    expansion_bytes,
    folds_into_conv,
    folds_into_dot,
    fuses_into_gemm,
    is_expensive,
    makes_buffer,
    padded_bytes,
    pooled_in_kernel,
    split_k_bytes,
    upcast_bytes,
)
from jaxmem.analyzing.schedule import schedule
from jaxmem.tracing.primitives import CHEAP, Kind
from jaxmem.tracing.program import Node, Program, from_jaxpr

__all__ = ["aliased_outputs", "buffers", "last_uses", "liveness", "materialised"]

_REDUCTIONS = ("reduce_", "argm", "cum", "reduce_window", "select_and")


def _held(program: Program, v: int, barrier: Node) -> bool:
    """Whether ``optimization_barrier`` node ``barrier`` passes value ``v`` on to a reader
    (its output for ``v`` is read)."""
    return any(program.users.get(o) for a, o in
               zip(barrier.inputs, barrier.outputs, strict=False) if a == v)


def _is_reduction(name: str) -> bool:
    return name.startswith(_REDUCTIONS)


def materialised(program: Program, platform: str = "cpu", *, fold_dots: bool = True
                 ) -> list[bool]:
    """Per value: whether XLA is expected to give it a buffer of its own (fusion model);
    :func:`buffers`' first half."""
    return buffers(program, platform, fold_dots=fold_dots)[0]


def buffers(program: Program, platform: str = "cpu", *, fold_dots: bool = True
            ) -> tuple[list[bool], frozenset[int]]:
    """Per value: whether XLA is expected to give it a buffer of its own (fusion model);
    and the values whose buffer is made late (see below).

    ``fold_dots``: a value the target folds into the matmuls reading it
    (:func:`~jaxmem.analyzing.fusion.folds_into_dot`) gets none (False: counted as stored,
    the cost model's view of the residuals).

    Non-fusible outputs (matmuls, convolutions, units), reductions and program outputs get a
    buffer. An elementwise or layout value read only by elementwise nodes is fused into its
    readers; so is one read only by max-pooling on XLA:GPU
    (:func:`~jaxmem.analyzing.fusion.pooled_in_kernel`; a ``concatenate`` excepted, which
    XLA:GPU stores). If a reader sits in another phase (a residual), XLA duplicates the
    producer there when that needs no extra buffer (every operand is stored, or is itself
    duplicable) and it is not expensive (a transcendental); otherwise the value is stored.
    A matmul whose operands XLA:GPU pads to split its contraction
    (:func:`~jaxmem.analyzing.fusion.split_k_bytes`) reads such a value through the pad,
    which computes it (a ``tanh`` of a matmul's operand is never stored there).

    ``optimization_barrier`` (the rewrite's and ``jax.checkpoint``'s) passes its operands'
    buffers on, and XLA keeps it through fusion (XLA:GPU until after scheduling, XLA:CPU
    with the barrier flag): its outputs are no buffers of their own, an operand whose
    output is read is a buffer (an unread one holds nothing). Where that operand is cheap
    and made from buffers alone, and nothing else needs it stored, XLA computes it in a
    fusion of its own right before the barrier's readers need it (its other readers fuse
    it): such values are *late*, their buffer made where the barrier's readers are.
    """
    out_set = set(program.outputs)
    users = program.users
    values = program.values
    padded: dict[int, bool] = {}  # dot node -> whether XLA:GPU pads its operands (split-K)
    mat = [False] * len(values)
    dup = [False] * len(values)  # fused, and re-creatable from stored values alone
    late: set[int] = set()
    for v in values:
        if v.producer is None or v.nbytes == 0:
            dup[v.id] = v.producer is None
            continue
        node = program.nodes[v.producer]
        rd = users.get(v.id, ())
        if node.primitive == "optimization_barrier" and v.id not in out_set:
            # the operand's own buffer, passed on (its readers read that buffer: schedule)
            dup[v.id] = True
            continue
        if not rd:
            mat[v.id] = v.id in out_set
            continue
        if (v.id in out_set or node.kind not in CHEAP or _is_reduction(node.primitive)
                or makes_buffer(node.primitive, tuple(values[u].dtype for u in node.inputs),
                                platform)):
            mat[v.id] = True
            continue
        if node.primitive == "device_put" and any(
                str(values[u].memory_space) != str(v.memory_space) for u in node.inputs):
            mat[v.id] = True  # a copy to (or from) host memory is a buffer of its own
            continue
        avail = (not is_expensive(node.primitive, v.dtype, platform)
                 and all(mat[a] or dup[a] for a in node.inputs))
        gemm = (fuses_into_gemm(node.primitive, v.dtype,
                                tuple(values[a].producer is None for a in node.inputs),
                                platform)
                or (fold_dots and folds_into_dot(node.primitive, platform)))
        # read by max-pooling alone, which computes it in its kernels (fusion.pooled_in_kernel)
        pooled = node.primitive != "concatenate" and pooled_in_kernel(
            tuple(program.nodes[i].primitive for i in rd), platform)
        held = False
        for i in rd:
            u = program.nodes[i]
            if (gemm and u.primitive == "dot_general") or (  # fusion.folds_into_conv:
                    u.primitive == "conv_general_dilated" and u.inputs[1:2] == (v.id,)
                    and folds_into_conv(node.primitive, platform)):  # the kernel itself
                continue
            if avail and u.primitive == "dot_general" and _pads(program, u, platform, padded):
                continue  # computed in the fusion that pads it (split_k_bytes)
            if u.primitive == "optimization_barrier":
                held = held or _held(program, v.id, u)
                continue
            if (u.kind not in CHEAP or (_is_reduction(u.primitive) and not pooled)
                    or (u.phase != node.phase and not avail)):
                mat[v.id] = True
                break
        if held and not mat[v.id]:
            mat[v.id] = True
            if avail and all(mat[a] or values[a].producer is None for a in node.inputs):
                late.add(v.id)
        dup[v.id] = not mat[v.id] and avail
    return mat, frozenset(late)


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


def aliased_outputs(program: Program, donated: Iterable[int]) -> frozenset[int]:
    """Output value ids that XLA writes into a donated input's buffer.

    ``donated``: positions among the program's flat inputs. As JAX does, each output takes
    the first unused donated input of its shape and dtype, in order.
    """
    free: dict[tuple, list[int]] = {}
    for k in sorted(set(donated)):
        v = program.values[program.inputs[k]]
        free.setdefault((v.shape, str(v.dtype)), []).append(k)
    out: set[int] = set()
    for o in dict.fromkeys(program.outputs):
        v = program.values[o]
        slot = free.get((v.shape, str(v.dtype)))
        if slot and v.nbytes:
            slot.pop(0)
            out.add(o)
    return frozenset(out)


def _unit_transient(node: Node, platform: str = "cpu") -> int:
    """Working set inside a control-flow unit beyond its inputs and outputs."""
    best = 0
    for j in _jax.sub_jaxprs(node.eqn):
        closed = jax.extend.core.ClosedJaxpr(j, [None] * len(j.constvars))
        try:
            sub = from_jaxpr(closed)
        except Exception:  # noqa: BLE001 - an estimate; never fail the analysis on it
            continue
        # a scan writes each iteration's stacked outputs (ys) into the stacked buffers, which
        # are counted outside it; its new carry needs buffers of its own
        ys = range(node.eqn.params["num_carry"], len(sub.outputs)) \
            if node.primitive == "scan" and len(_jax.sub_jaxprs(node.eqn)) == 1 else ()
        _, live, _ = liveness(sub, count_inputs=False, platform=platform, in_place=ys)
        best = max(best, max(live, default=0))
    return best


def _upcasts(program: Program, position: dict[int, int], delta: np.ndarray,
             platform: str) -> None:
    """Add the operand copies XLA makes: f32 copies of half-precision matmul operands
    (:func:`jaxmem.analyzing.fusion.upcast_bytes`) and padded convolution inputs
    (:func:`jaxmem.analyzing.fusion.padded_bytes`), each live from the first reader to the last."""
    span: dict[tuple[int, str], list[int]] = {}
    size: dict[tuple[int, str], int] = {}
    for n in program.nodes:
        if n.primitive not in COPIES_OPERANDS:
            continue
        for k, v in enumerate(dict.fromkeys(n.inputs)):
            val = program.values[v]
            extras = [("f32", upcast_bytes(n.primitive, val.dtype, val.nbytes, platform))]
            if k == 0 and n.eqn is not None:
                item = val.nbytes // max(1, int(np.prod(val.shape)))
                extras.append((f"pad{n.eqn.params.get('padding')}", padded_bytes(
                    n.primitive, n.eqn.params, val.shape, item, platform)))
            for kind, extra in extras:
                if not extra:
                    continue
                p = position[n.index]
                s = span.setdefault((v, kind), [p, p])
                s[0], s[1] = min(s[0], p), max(s[1], p)
                size[(v, kind)] = extra
    for v, (a, b) in span.items():
        delta[a] += size[v]
        delta[b + 1] -= size[v]


def _layout_copies(program: Program, position: dict[int, int], last: dict[int, int],
                   delta: np.ndarray, platform: str) -> None:
    """Add the copies XLA makes of arguments read by convolutions in another layout
    (:func:`jaxmem.analyzing.fusion.conv_operand_copies`): one per argument, read through
    ``rev`` too (the input gradient's convolution reads the reversed kernel, which XLA's
    cuDNN rewrite folds into the copy), live from its first convolution to the argument's
    last reader (the optimizer's update reads the parameter through the copy)."""
    span: dict[int, list[int]] = {}
    for n in program.nodes:
        if n.primitive != "conv_general_dilated" or n.eqn is None or len(n.inputs) < 2:
            continue
        for v, copied in zip(n.inputs[:2], conv_operand_copies(n.eqn.params, platform),
                             strict=True):
            producer = program.values[v].producer
            if producer is not None and folds_into_conv(program.nodes[producer].primitive,
                                                        platform):
                v = program.nodes[producer].inputs[0]
            if not copied or program.values[v].producer is not None:
                continue
            p = position[n.index]
            s = span.setdefault(v, [p, p])
            s[0], s[1] = min(s[0], p), max(s[1], p)
    for v, (a, b) in span.items():
        size = aligned_bytes(program.values[v].nbytes, platform)
        delta[a] += size
        delta[max(b, last.get(v, b)) + 1] -= size


_LAYOUT = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim"})

#: One-operand elementwise primitives (one-operand elementwise HLO ops too): XLA:GPU's
#: split-K rewrite reads an operand's width from the start of such a chain.
_UNARY = frozenset({
    "convert_element_type", "neg", "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic",
    "abs", "sqrt", "rsqrt", "cbrt", "sin", "cos", "tan", "sign", "floor", "ceil", "round",
    "erf", "erfc", "erf_inv", "not", "reduce_precision", "copy", "copy_p", "real", "imag",
})


def _width(program: Program, v: int) -> int:
    """Bits of ``v``'s elements at the start of its chain of one-operand elementwise
    producers (``GetDotDimensions``' ``get_side_size``: a bf16 operand converted from f32
    counts 32 bits)."""
    while True:
        val = program.values[v]
        node = program.nodes[val.producer] if val.producer is not None else None
        if node is None or node.primitive not in _UNARY or len(node.inputs) != 1:
            return 8 * np.dtype(val.dtype).itemsize
        v = node.inputs[0]


def _pads(program: Program, node: Node, platform: str, memo: dict[int, bool]) -> bool:
    """Whether XLA:GPU pads matmul ``node``'s operands to split its contraction (memoised
    per node in ``memo``)."""
    if node.index not in memo:
        memo[node.index] = _split_k(program, node, platform)[0] > 0
    return memo[node.index]


def _split_k_transient(program: Program, node: Node, platform: str) -> int:
    """Bytes XLA:GPU holds at a matmul beyond its operands and result when it splits the
    contraction (:func:`jaxmem.analyzing.fusion.split_k_bytes`): the f32 partial products,
    and the padded operand copies where they outlast the result's buffer (the pads are read
    by the GEMM, its partials by the reduction that writes the result)."""
    pads, partials = _split_k(program, node, platform)
    out = program.values[node.outputs[0]].nbytes
    return partials + max(0, pads - out) if partials else 0


def _split_k(program: Program, node: Node, platform: str) -> tuple[int, int]:
    """:func:`jaxmem.analyzing.fusion.split_k_bytes` of matmul ``node``: ``(operand pads,
    partial products)``; ``(0, 0)`` for any other node."""
    if node.primitive != "dot_general" or node.eqn is None or len(node.inputs) != 2:
        return 0, 0
    (lc, rc), (lb, rb) = node.eqn.params["dimension_numbers"]
    if not lc:
        return 0, 0
    lhs, rhs = (program.values[v] for v in node.inputs)
    if "int32" in (str(lhs.dtype), str(rhs.dtype)):  # neither cuBLAS nor Triton: not split
        return 0, 0
    lfree = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
    b = int(np.prod([lhs.shape[d] for d in lb], dtype=np.int64))
    m = int(np.prod([lhs.shape[d] for d in lfree], dtype=np.int64))
    n = int(np.prod([rhs.shape[d] for d in rfree], dtype=np.int64))
    out = program.values[node.outputs[0]]
    # XLA merges several contracting dimensions into one before it splits (the weight
    # gradient of a dense layer over [batch, tokens, features] contracts batch and tokens)
    k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    return split_k_bytes(b, m, n, k, _width(program, node.inputs[0]),
                         _width(program, node.inputs[1]), 8 * np.dtype(out.dtype).itemsize,
                         platform)


def _scan_upcasts(node: Node, platform: str) -> int:
    """f32 copies XLA makes of a scan's half-precision operands that feed matmuls inside
    its body: the conversion does not depend on the iteration, so XLA hoists it out of the
    loop and converts the whole stacked operand (:func:`jaxmem.analyzing.fusion.upcast_bytes`)."""
    if node.primitive != "scan" or not upcast_bytes("dot_general", "bfloat16", 1, platform):
        return 0
    body = node.eqn.params["jaxpr"].jaxpr
    skip = range(node.eqn.params["num_consts"],
                 node.eqn.params["num_consts"] + node.eqn.params["num_carry"])
    total = 0
    for k, (inner, outer) in enumerate(zip(body.invars, node.eqn.invars, strict=False)):
        if k in skip:
            continue
        seen, frontier, hit = {inner}, [inner], None
        while frontier and hit is None:
            var = frontier.pop()
            for e in body.eqns:
                if not any(x is var for x in e.invars):
                    continue
                if e.primitive.name in ("dot_general", "conv_general_dilated"):
                    hit = e.primitive.name
                    break
                if e.primitive.name in _LAYOUT:
                    frontier.extend(o for o in e.outvars if o not in seen)
                    seen.update(e.outvars)
        if hit:
            aval = outer.aval
            nbytes = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
            total += upcast_bytes(hit, str(aval.dtype), nbytes, platform)
    return total


def liveness(program: Program, *, count_inputs: bool = True,
             donated: Iterable[int] = (), device_only: bool = False,
             platform: str = "cpu", in_place: Iterable[int] = (), fold_dots: bool = True
             ) -> tuple[int, tuple[int, ...], int]:
    """Predicted ``(peak, live bytes after each node, output bytes)``.

    The peak is comparable with XLA's ``argument + output + temp - alias``: inputs are live
    throughout, outputs from their producer to the end, intermediates from producer to last
    reader. Outputs that alias a ``donated`` input index are not counted twice.
    ``device_only``: values placed in host memory keep their lifetimes but are not counted.
    ``platform``: the compiler's fusion rules and conversions (:mod:`jaxmem.analyzing.fusion`);
    ``in_place``: positions among the outputs written into buffers counted elsewhere.
    ``fold_dots``: :func:`materialised`'s.
    Nodes run in :func:`jaxmem.analyzing.schedule.schedule`'s order.
    """
    nodes, values = program.nodes, program.values
    mat, late = buffers(program, platform, fold_dots=fold_dots)
    end = len(nodes)
    arg_bytes = sum(values[i].nbytes for i in program.inputs) if count_inputs else 0
    # Outputs that are inputs or constants get an output buffer of their own (a copy).
    out_bytes = sum(values[v].nbytes for v in dict.fromkeys(program.outputs))
    passthrough = sum(values[v].nbytes for v in dict.fromkeys(program.outputs)
                      if values[v].producer is None)
    aliased = aliased_outputs(program, donated)
    if in_place:
        aliased = aliased | {program.outputs[k] for k in in_place}
    # An output that aliases a donated input is written into that input's buffer: it costs
    # nothing beyond the arguments (XLA's ``alias``); a returned input needs no copy then.
    passthrough -= sum(values[v].nbytes for v in aliased if values[v].producer is None)
    order = schedule(program, mat, aliased, late)
    last = order.last_use(program)
    made = order.made_at(late)
    steps = len(order.order)
    delta = np.zeros(steps + 2, dtype=np.int64)
    outs = set(program.outputs)
    for v in values:
        if v.producer is None or not mat[v.id] or v.id in aliased:
            continue
        if device_only and "Host" in str(v.memory_space):
            continue
        start = made.get(v.id, order.position[v.producer])
        # A temporary is placed at an aligned offset of XLA's temp allocation; an output
        # has a buffer of its own.
        size = v.nbytes if v.id in outs else aligned_bytes(v.nbytes, platform)
        delta[min(start, steps)] += size
        delta[max(last.get(v.id, start), start) + 1] -= size
    _upcasts(program, order.position, delta, platform)
    _layout_copies(program, order.position, last, delta, platform)
    live = np.cumsum(delta)[:max(steps, 1)]
    for n in nodes:
        at = min(order.position[n.index], len(live) - 1)
        if n.kind in (Kind.CONTROL, Kind.HEAVY) and _jax.sub_jaxprs(n.eqn):
            live[at] += _unit_transient(n, platform) + _scan_upcasts(n, platform)
        elif n.primitive == "dot_general":
            live[at] += _split_k_transient(program, n, platform)
        elif n.primitive == "select_and_scatter_add" and len(n.inputs) >= 2:
            src, operand = (values[v].shape for v in n.inputs[:2])
            live[at] += expansion_bytes(
                n.primitive, operand, src, platform, n.eqn.params.get("padding", ()),
                np.dtype(values[n.inputs[1]].dtype).itemsize, mat[n.outputs[0]])
    base = arg_bytes + passthrough
    # per node, in program order: the live bytes at its place in the run order
    series = np.asarray([live[min(order.position[n.index], len(live) - 1)] for n in nodes],
                        dtype=np.int64) + base
    peak = int(live.max()) + base if end else base
    return peak, tuple(int(x) for x in series), out_bytes
