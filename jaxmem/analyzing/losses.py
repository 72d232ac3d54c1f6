"""Where the loss is the bottleneck: the logits of a large vocabulary.

Beside the third box of the data flow (``Analysis -> Plan``): a check the plan reports as a
note. In a language model the ``[tokens, vocab]`` logits (and their softmax and cotangent, as
large) are often the largest buffers of the step: with a 128k vocabulary and 4k tokens, one
float32 copy is 2 GiB per sequence, more than a decoder layer's activations. No
save/recompute decision shrinks them: the loss has to be computed in chunks
(:func:`jaxmem.memory.chunked.chunked_cross_entropy`, a one-line change in the loss function, shown
in docs/llm.md).

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxmem
  >>> def loss(h, w, y):
  ...     return optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()
  >>> an = jaxmem.analyze(loss, jnp.ones((64, 8)), jnp.ones((8, 4096)), jnp.zeros(64, int))
  >>> print(logits_notes(an)[0][:33])
  the logits f32[64,4096] (1.00 MiB
"""

from __future__ import annotations

from jaxmem.analyzing.analysis import Analysis
from jaxmem.tracing.program import Program
from jaxmem.xla.measure import fmt_bytes

__all__ = ["logits_notes", "logits_value"]

# Reductions a softmax / log-sum-exp over the logits starts with.
_SOFTMAX_READS = frozenset({"reduce_max", "argmax", "reduce_logsumexp"})
# Primitives that pass the logits on unchanged in size (casts, reshapes).
_PASS = frozenset({"convert_element_type", "reshape", "squeeze", "broadcast_in_dim", "copy",
                   "stop_gradient", "transpose"})


def logits_value(program: Program) -> int | None:
    """The id of the largest value a matmul makes, if it is the largest value the step makes
    and a softmax reads it (a max over it, directly or through casts): the logits."""
    made = [v for v in program.values if v.producer is not None]
    if not made:
        return None
    largest = max(made, key=lambda v: v.nbytes)
    if program.nodes[largest.producer].primitive != "dot_general":
        return None
    frontier, seen = [largest.id], set()
    while frontier:
        v = frontier.pop()
        if v in seen:
            continue
        seen.add(v)
        for n in program.users.get(v, ()):
            node = program.nodes[n]
            if node.primitive in _SOFTMAX_READS:
                return largest.id
            if node.primitive in _PASS:
                frontier += list(node.outputs)
    return None


def logits_notes(analysis: Analysis) -> tuple[str, ...]:
    """A plan note when the logits are the step's largest buffer (else nothing)."""
    prog = analysis.program
    v = logits_value(prog)
    if v is None:
        return ()
    val = prog.values[v]
    node = prog.nodes[val.producer]
    where = f" in {node.layer}" if node.layer else ""
    shape = ",".join(map(str, val.shape))
    return (f"the logits {_short(val.dtype)}[{shape}] ({fmt_bytes(val.nbytes)}, made{where}) "
            "are the step's largest buffer: compute the loss in chunks with "
            "jaxmem.memory.chunked.chunked_cross_entropy(hidden, head, labels) in place of "
            "softmax_cross_entropy(hidden @ head, labels) (docs/llm.md)",)


def _short(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(str(dtype), str(dtype))
