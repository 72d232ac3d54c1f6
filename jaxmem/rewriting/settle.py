"""Orderings the accelerators' schedulers need: gradients fenced, host copies settled.

Part of the fourth box (the rewrite, :mod:`jaxmem.rewriting.rewrite`). XLA:GPU's and
XLA:TPU's schedulers move work that nothing waits for as late as they may, and keep what it
reads live meanwhile. Three kinds of such work matter to a plan, and each is tied behind an
``optimization_barrier`` to a node that comes where the work should:

- :func:`fence_finished`: weight and bias gradients, which only the update at the end of
  the step reads (:func:`finished_values`), tied into the first node of the next backward
  run. Unfenced, XLA:GPU computed a block's gradients blocks later and kept the cotangents
  they read: on the H100 target the zoo GPT's block plan compiled to 64.3 MiB, fenced to
  41.1 MiB (per-block ``jax.checkpoint(policy=nothing_saveable)``: 41.3 MiB).
- :func:`settle_copies`: a host copy of an offloaded value, tied into the first node of a
  later forward region (or of the backward pass). Nothing reads a host copy before the
  backward pass, so XLA:GPU issued the copy just before its copy back: the device buffer
  lived through the forward pass, and XLA kept some offloaded values on the device
  altogether. Measured on the H100 target, eight 32 MiB activations offloaded by hand with
  their copies back prefetched: 288 MiB of temporaries and 64 MiB on the host untied, 64
  MiB and 256 MiB tied.
- :func:`settle_outputs`: the step outputs the forward pass makes (the loss), tied into the
  first backward node. Nothing waits for the loss value either: it was computed half-way
  through the backward pass and kept the logits live.

Inputs XLA would re-derive in place (constants, constant-derived values) are never tied (a
barrier operand is materialised); a node with no other inputs leaves the tie to the next.
For the same reason a rewrite region that reads no cotangent ties its re-created values to
the narrowest values that stand for the last backward value made (:func:`narrowest`): the
loss's seed cotangent broadcast over a 30k vocabulary, tied itself, was a 468.75 MiB
float32 buffer XLA otherwise fuses into its readers (transformers' GPT-2 at flax's lm1b
width, H100 target); a region's cotangent that is a broadcast of a narrower one is tied
through that one (:func:`cotangent_ties`); and a re-created node already ordered after its
region's barrier reads matmul outputs beside it (:func:`beside_barrier`), so that XLA may
write their gradient into their buffer.
:class:`Orderings` applies all three as the rewrite replays a program; the rewrite does so
only where the arguments are not on the CPU (XLA:CPU strips host placement and keeps the
program's order: there the ties change no figure).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax import lax

from jaxmem.analyzing.chains import backward_regions
from jaxmem.tracing.primitives import CHEAP
from jaxmem.tracing.program import Node, Program, region_of

__all__ = ["BESIDE", "EXPANSIONS", "Orderings", "beside_barrier", "cotangent_ties",
           "expanded_from", "fence_finished", "finished_values", "narrowest", "settle_copies",
           "settle_outputs"]


def settle_copies(program: Program, n: Node, ins: list[Any], host: dict[int, Any],
                  pending: list[tuple[int, tuple[str, str]]], depth: int | None,
                  barrier: Callable[[Any], Any] | None = None) -> list[Any]:
    """``ins`` of ``n`` tied to the host copies in ``pending`` (value, region made in) made
    in another region than ``n``'s, or all of them once ``n`` is past the forward pass;
    those leave ``pending`` and ``host`` holds their tied copies."""
    here = region_of(n, depth)
    due = [v for v, r in pending if r != here or n.phase != "forward"]
    ins, tied = _tie(program, n, ins, [host[v] for v in due], barrier)
    if tied is not None:
        host.update(zip(due, tied, strict=True))
        pending[:] = [(v, r) for v, r in pending if v not in set(due)]
    return ins


def settle_outputs(program: Program, n: Node, ins: list[Any], env: dict[int, Any],
                   unsettled: list[int], barrier: Callable[[Any], Any] | None = None
                   ) -> list[Any]:
    """``ins`` of ``n`` (a backward node) tied to the forward-made step outputs in
    ``unsettled``; ``env`` then holds their tied values (what the step returns)."""
    outs = [v for v in unsettled if v in env]
    ins, tied = _tie(program, n, ins, [env[v] for v in outs], barrier)
    if tied is not None:
        env.update(zip(outs, tied, strict=True))
        unsettled.clear()
    return ins


class Orderings:
    """The ties of this module for one program, applied node by node as the rewrite replays
    it (:class:`jaxmem.rewriting.rewrite._Replay`): :meth:`fresh` for each trace, then
    :meth:`_Trace.inputs` before a node is emitted and :meth:`_Trace.made` after."""

    def __init__(self, program: Program, offload: frozenset[int], depth: int | None, *,
                 settle_host: bool, fence_gradients: bool) -> None:
        self.program, self.offload, self.depth = program, offload, depth
        self.settle_host = settle_host
        # step outputs the forward pass makes (the loss): settled before the backward pass
        self.forward_outputs = () if not settle_host else tuple(dict.fromkeys(
            v for v in program.outputs
            if (u := program.values[v].producer) is not None
            and program.nodes[u].phase == "forward" and v not in program.constant_derived))
        self.finished = finished_values(program) if fence_gradients else frozenset()
        self.run_of = {} if not self.finished else {
            i: k for k, r in enumerate(backward_regions(program, None, depth)) for i in r}

    def fresh(self, barrier: Callable[[Any], Any] | None = None) -> _Trace:
        """The state of one trace of the rewrite: nothing pending yet. ``barrier``: what
        the ties are emitted through (``lax.optimization_barrier`` when None)."""
        return _Trace(self, unsettled=list(self.forward_outputs), barrier=barrier)


@dataclasses.dataclass
class _Trace:
    """What one trace has made and not yet tied."""

    orderings: Orderings
    unsettled: list[int]  # step outputs the forward pass makes, not yet settled
    pending: list[tuple[int, tuple[str, str]]] = dataclasses.field(default_factory=list)
    done: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (value, run)
    barrier: Callable[[Any], Any] | None = None

    def inputs(self, n: Node, ins: list[Any], env: dict[int, Any],
               host: dict[int, Any]) -> list[Any]:
        """``n``'s inputs with whatever is due tied to them (``env`` and ``host`` then hold
        the tied step outputs and host copies)."""
        o = self.orderings
        if self.pending:
            ins = settle_copies(o.program, n, ins, host, self.pending, o.depth, self.barrier)
        if n.phase == "backward" and self.unsettled:
            ins = settle_outputs(o.program, n, ins, env, self.unsettled, self.barrier)
        if n.phase == "backward" and self.done:
            ins = fence_finished(o.program, n, ins, env, self.done, o.run_of[n.index],
                                 self.barrier)
        return ins

    def made(self, n: Node) -> None:
        """Note ``n``'s outputs that a later node must be tied to."""
        o = self.orderings
        if o.settle_host:
            self.pending += [(v, region_of(n, o.depth)) for v in n.outputs if v in o.offload]
        if n.phase == "backward" and o.finished:
            self.done += [(v, o.run_of[n.index]) for v in n.outputs if v in o.finished]


def finished_values(program: Program) -> frozenset[int]:
    """Backward values off the backward pass's own path, each where XLA materialises it.

    A backward value is off the path when nothing in the backward pass reads it except
    cheap nodes whose outputs are off the path too: a weight gradient and the reshapes,
    transposes and sums that carry it to the update. Of those, the ones made by a node XLA
    materialises anyway (a matmul or convolution, a reduction: the weight and bias
    gradients themselves) are returned; the cheap tail after them is left out, so that XLA
    can still fuse it into the update (a barrier operand is materialised: tying the tail
    would store every gradient once more).

    Only a gradient smaller than the values it reads is returned. Made late, it keeps its
    operands live; made early, itself until the update. A matmul's weight gradient
    ``x.T @ dy`` is smaller than ``x`` and ``dy`` where the tokens outnumber the layer's
    width (a decoder, a convolution's many pixels), larger in a wide MLP at a small batch:
    there XLA:GPU is right to make it late (the equinox MLP of the corpus, H100 target:
    454.0 MiB unfenced, 517.9 MiB with every gradient fenced).
    """
    off: set[int] = set()
    for n in reversed(program.nodes):
        if n.phase != "backward":
            continue
        for o in n.outputs:
            if o in program.constant_derived:
                continue
            readers = [program.nodes[u] for u in program.users.get(o, ())]
            if all(m.phase != "backward" or (m.kind in CHEAP and all(x in off for x in m.outputs))
                   for m in readers):
                off.add(o)
    def read_bytes(n: Node) -> int:  # what making ``n`` late would keep live
        return sum(program.values[v].nbytes for v in set(n.inputs)
                   if not program.values[v].is_input and not program.values[v].is_const)

    return frozenset(
        o for o in off
        if ((n := program.nodes[program.values[o].producer]).kind not in CHEAP
            or n.primitive.startswith("reduce_"))
        and program.values[o].nbytes < read_bytes(n))


def fence_finished(program: Program, n: Node, ins: list[Any], env: dict[int, Any],
                   done: list[tuple[int, int]], run: int,
                   barrier: Callable[[Any], Any] | None = None) -> list[Any]:
    """``ins`` of ``n`` (a node of backward run ``run``) tied to the finished backward values
    in ``done`` (value, run it was made in) that earlier runs made: values nothing later in
    the backward pass reads (weight gradients on their way to the update). Those leave
    ``done``; a node with nothing to tie them to (a broadcast constant) leaves them to the
    next.

    Work nothing waits for is ready from the moment it can run until the end of the step,
    and XLA:GPU's scheduler places it late. The zoo GPT's block plan (8 layers, batch 16,
    H100 target) compiled to 255.5 MiB unfenced; with one boundary offloaded, to 354.4 MiB,
    the gradients of blocks 3 to 7 computed in the copy's window during block 2's backward
    pass. Tied to the next run's start, each gradient is made within its own run: 123.4
    MiB.
    """
    due = [v for v, r in done if r < run and v in env]
    ins, tied = _tie(program, n, ins, [env[v] for v in due], barrier)
    if tied is not None:
        done[:] = [(v, r) for v, r in done if r >= run]
    return ins


def _tie(program: Program, n: Node, ins: list[Any], extra: list[Any],
         barrier: Callable[[Any], Any] | None = None) -> tuple[list[Any], list[Any] | None]:
    """``n``'s inputs and ``extra`` through one barrier: (new inputs, tied extra), or
    (``ins``, None) when there is nothing to tie or no input to tie it to."""
    keep = [k for k, v in enumerate(n.inputs) if v not in program.constant_derived
            and not program.values[v].is_const]
    if not extra or not keep:
        return ins, None
    tied_ins, tied = (barrier or lax.optimization_barrier)(([ins[k] for k in keep],
                                                            list(extra)))
    out = list(ins)
    for k, x in zip(keep, tied_ins, strict=True):
        out[k] = x
    return out, tied


def cotangent_ties(program: Program, n: Node) -> list[int]:
    """What a barrier before backward node ``n`` ties re-created values to: ``n``'s inputs
    made in the backward pass (its cotangents), each followed through the broadcasts,
    converts and reshapes that made it from one narrower backward value
    (:func:`expanded_from`).

    Forward values are never tied: a barrier operand must be materialised, and a value
    XLA would otherwise re-derive in place (a broadcast zero of a ReLU's derivative, an
    iota) would be kept as a whole buffer from the forward pass to this region. For the
    same reason a cotangent that is only an expansion of a narrower one is tied through
    that one: it is ready exactly when its source is, so the order is the same, and XLA
    fuses the expansion into its readers instead of materialising it (a softmax
    cross-entropy's cotangent broadcast over a 30k vocabulary and converted to bfloat16:
    a 234.38 MiB buffer on transformers' GPT-2 at flax's lm1b width, H100 target; MEDL's
    plans of a one-layer copy 766.42 -> 584.07 MiB). Following any cheap node to
    narrower inputs (:func:`narrowest`) took the zoo GPT's and Llama's MEDL plans 2-4%
    lower but the corpus' ``eqx_bn_cnn`` plans 4-14% higher: not done.
    """
    return list(dict.fromkeys(x for v in dict.fromkeys(n.inputs) if _cotangent(program, v)
                              for x in expanded_from(program, v)))


def _backward(program: Program, v: int) -> bool:
    """Whether value ``v`` is made in the backward pass."""
    u = program.values[v].producer
    return u is not None and program.nodes[u].phase == "backward"


def _cotangent(program: Program, v: int) -> bool:
    """Whether value ``v`` is made in the backward pass from more than constants."""
    return _backward(program, v) and v not in program.constant_derived


#: Primitives that only widen, retype or reshape one value: XLA fuses them into readers.
EXPANSIONS: frozenset[str] = frozenset({
    "broadcast_in_dim", "convert_element_type", "reshape", "expand_dims", "squeeze"})


def expanded_from(program: Program, v: int) -> list[int]:
    """``[v]``, or where a chain of :data:`EXPANSIONS` made backward value ``v`` from one
    backward value of fewer bytes (not derived from constants alone), ``[that value]``."""
    x = v
    while (node := program.nodes[program.values[x].producer]).primitive in EXPANSIONS:
        ins = [w for w in dict.fromkeys(node.inputs) if _cotangent(program, w)]
        if len(ins) != 1:
            break
        x = ins[0]
    return [x] if program.values[x].nbytes < program.values[v].nbytes else [v]


#: Producers of the anchors a re-created node reads beside its region's barrier once
#: another of its inputs orders it after that barrier (:func:`beside_barrier`).
BESIDE: frozenset[str] = frozenset({"dot_general"})


def beside_barrier(program: Program, nodes: list[int], anchors: list[int],
                   fetched: list[int]) -> dict[int, frozenset[int]]:
    """Per re-created node of ``nodes`` (a region's chain, in order), the anchors it reads
    directly rather than through the region's barrier (which ``anchors`` and ``fetched``
    pass): those made by :data:`BESIDE` primitives, where another input already orders the
    node after the barrier (a value that passed it, or one made from such); a node with no
    such input reads the first of them through the barrier and the rest directly.

    XLA writes no result into the buffer of a barrier operand read through the barrier: a
    re-created softmax reading the logits so took a second logits-sized buffer for their
    gradient (transformers' GPT-2 at flax's lm1b width, H100 target: 234.38 MiB; a
    one-layer copy's selective plan 734.98 -> 563.18 MiB). Read directly, the values are
    the same and the order is kept. Convolution outputs are left behind the barrier: read
    directly they took the zoo ResNet's MEDL plan 7.6% higher on the H100 target.
    """
    beside = {a for a in anchors
              if (u := program.values[a].producer) is not None
              and program.nodes[u].primitive in BESIDE}
    ordered = set(fetched) | (set(anchors) - beside)
    out: dict[int, frozenset[int]] = {}
    for i in nodes:
        n = program.nodes[i]
        mine = [v for v in dict.fromkeys(n.inputs) if v in beside]
        after = any(v in ordered for v in n.inputs if v not in beside)
        if mine:
            out[i] = frozenset(mine if after else mine[1:])
        if after or mine:
            ordered.update(n.outputs)
    return out


def narrowest(program: Program, v: int) -> list[int]:
    """What a region that reads no cotangent ties to, standing for the last backward value
    made, ``v``: ``v``, or where cheap backward nodes make ``v`` from backward values of
    fewer bytes in all, those, recursively. In a loss region ``v`` is the loss's seed
    cotangent broadcast over the vocabulary (derived from constants alone): tied itself,
    it was a float32 ``[batch, sequence, vocabulary]`` buffer; it is followed to its
    scalar. (Tied to nothing, the region's re-created values could merge with the forward
    originals.)"""
    return _narrowest(program, v, {})   # a backward pass's cheap nodes share inputs


def _narrowest(program: Program, x: int, memo: dict[int, list[int]]) -> list[int]:
    """:func:`narrowest` of ``x``, memoised in ``memo`` (a function of the module's, not
    a recursive closure: that is a reference cycle, held until the collector runs)."""
    if x not in memo:
        node = program.nodes[program.values[x].producer]
        ins = [w for w in dict.fromkeys(node.inputs) if _backward(program, w)]
        below = list(dict.fromkeys(y for w in ins for y in _narrowest(program, w, memo))) \
            if node.kind in CHEAP and ins else []
        memo[x] = below if below and sum(program.values[y].nbytes for y in below) \
            < program.values[x].nbytes else [x]
    return memo[x]
