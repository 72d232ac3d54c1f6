"""The liveness model's run order and buffers around ``optimization_barrier`` and
multi-output nodes (jaxmem.analyzing.schedule, jaxmem.analyzing.liveness.buffers): what
the rewrite's barriers hold and for how long, measured by ``python -m
benchmarks.prediction --repredict --plans`` against the stored compiled peaks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxmem.program import trace

from jaxmem.analyzing.liveness import buffers, liveness
from jaxmem.analyzing.schedule import schedule

F32 = jax.ShapeDtypeStruct((64, 64), jnp.float32)


def _producer(prog, primitive, nth=0):
    nodes = [n for n in prog.nodes if n.primitive == primitive]
    return nodes[nth]


def test_a_barrier_output_is_its_operands_buffer_read_as_long_as_its_own_readers():
    """A barrier bundling two buffers passes each on: its outputs are no new buffers, and
    the operand whose output is read early dies there, not at the latest reader of the
    other operand bundled with it."""
    def f(w, x):
        a = x @ w
        b = a @ w
        a2, b2 = lax.optimization_barrier((a, b))
        c = (a2 @ w) @ w
        return ((c @ w) + b2).sum()

    prog = trace(f, F32, F32)
    mat, _ = buffers(prog, "cpu")
    barrier = _producer(prog, "optimization_barrier")
    assert not any(mat[o] for o in barrier.outputs)
    order = schedule(prog, mat)
    last = order.last_use(prog)
    a, b = barrier.inputs
    assert last[a] < last[b]
    reads_a = [n for n, ins in order.reads.items() if a in ins]
    assert reads_a and all(b not in order.reads[n] for n in reads_a
                           if prog.nodes[n].primitive == "dot_general"
                           and barrier.outputs[0] in prog.nodes[n].inputs)


def test_a_node_reading_two_outputs_of_one_producer_is_scheduled():
    """A reader of two buffers made by one node (a scan's carries) waits for that node
    once: every buffer-making node gets a place in the run order (a reader left out sat at
    the end, and everything it read lived to the end of the step)."""
    def f(x):
        def body(c, _):
            u, v = c
            return (jnp.tanh(u @ v), jnp.sin(v @ u)), None

        (u, v), _ = lax.scan(body, (x, x), None, length=3)
        return (u @ v).sum()

    prog = trace(jax.grad(f), F32)
    mat, late = buffers(prog, "cpu")
    order = schedule(prog, mat, late=late)
    assert len(order.order) == len(order.reads)
    assert all(order.position[n] < len(order.order) for n in order.reads)


def test_a_cheap_operand_a_barrier_holds_is_made_right_before_its_readers():
    """An elementwise value the barrier passes on to a later reader is a buffer (XLA
    fuses nothing through the barrier) made from buffers alone: it is *late*, its buffer
    made where the barrier's readers read it, while its forward reader fuses it; an
    operand whose barrier output nobody reads holds nothing. The step's peak (inside a
    wide forward stretch, with the late value's input ``h`` live anyway) is lower by the
    value's bytes than where the value is stored from the forward on."""
    wide = jax.ShapeDtypeStruct((64, 1024), jnp.float32)

    def f(w, v, x, summed):
        h = x @ w
        r = jnp.maximum(h, 0.0)                  # cheap, made from the buffer h
        z = (((r * 3.0 + 1.0) @ v) @ v.T) @ w    # r's forward reader fuses it
        r2, _ = lax.optimization_barrier((r, jnp.sin(h) * 2.0))  # sin(h): unread
        out = ((z * r2) @ w + (z * h) @ w).sum()  # read after z; h read late anyway
        return out + r.sum() if summed else out  # summed: r stored from the forward

    prog = trace(lambda w, v, x: f(w, v, x, False), F32, wide, F32)
    mat, late = buffers(prog, "cuda")
    barrier = _producer(prog, "optimization_barrier")
    r, s = barrier.inputs
    assert mat[r] and r in late
    assert not mat[s]
    order = schedule(prog, mat, late=late)
    made = order.made_at(late)
    assert made[r] > order.position[prog.values[r].producer]

    kept = trace(lambda w, v, x: f(w, v, x, True), F32, wide, F32)
    assert not buffers(kept, "cuda")[1]
    assert (liveness(prog, platform="cuda")[0] + prog.values[r].nbytes
            <= liveness(kept, platform="cuda")[0])
