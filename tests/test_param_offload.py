"""optimize(offload_state="all"): the parameters in host memory too, fetched per use.

CPU: identical values with and without (XLA:CPU strips the host placement). H100 target
(compile only): the parameters are in ``pinned_host`` and the device peak falls by their
bytes less about two layers' slices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from benchmarks import zoo
from jaxmem import measure
from jaxmem.memory import param_offload
from tests.test_state_offload import _adam_mlp  # the same 4-layer adam MLP on the H100 target


def test_identical_values_with_the_parameters_in_host_memory():
    w = zoo.make("mlp", size="test")  # adam
    ref = jaxmem.optimize(w.step, verify=False)
    opt = jaxmem.optimize(w.step, offload_state="all", verify=False)
    state_r, state_o = jax.tree.map(jnp.copy, w.state), jax.tree.map(jnp.copy, w.state)
    for _ in range(2):
        state_r, m_r = ref(state_r, w.batch)
        state_o, m_o = opt(state_o, w.batch)
        for x, y in zip(jax.tree.leaves((state_r, m_r)), jax.tree.leaves((state_o, m_o)),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    info = opt.plan(state_o, w.batch).state_offload
    kernels = [x for x in jax.tree.leaves(state_o["params"]) if x.ndim == 2]
    assert {x.sharding.memory_kind for x in kernels} == {"pinned_host"}
    assert info.param_bytes == sum(x.nbytes for x in kernels)
    # each kernel is read by the forward, and all but the first by the backward
    assert info.param_bytes < info.fetch_bytes < 2 * info.param_bytes
    assert info.link_bytes == 2 * info.nbytes + info.fetch_bytes
    assert len(opt._cache) == 1


@pytest.mark.slow
def test_on_the_h100_target_the_parameters_leave_the_device():
    step, args = _adam_mlp()
    moments = jaxmem.optimize(step, offload_state=True, strategy="none")
    both = jaxmem.optimize(step, offload_state="all", strategy="none")
    info = both.plan(*args).state_offload
    layer = 512 * 512 * 4
    assert info.param_bytes == 4 * layer and info.nbytes == 12 * layer
    assert both.lower(*args).as_text().count('mhlo.memory_kind = "pinned_host"') == 12
    exe = both.lower(*args).compile()
    stats = exe.memory_analysis()
    assert stats.host_argument_size_in_bytes == info.nbytes  # moments and parameters
    assert stats.host_output_size_in_bytes == info.nbytes
    before = measure.figures(moments.lower(*args).compile()).peak
    after = measure.figures(exe).peak
    assert before - after >= info.param_bytes - 2 * layer


def test_a_fetch_waits_for_the_activation_of_its_layer():
    step, args = _adam_mlp(layers=2, width=8)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    program = jaxmem.optimize(step, strategy="none").analysis(*args).program
    params = frozenset(program.inputs[:2])
    start = param_offload.update_start(program)
    uses = [n for n in program.nodes[:start] if set(n.inputs) & params]
    assert uses
    for n in uses:
        tie = param_offload.anchor(program, n.index, params)
        if program.inputs[-1] in n.inputs:
            continue  # the first layer's matmul reads the batch: nothing to wait for
        assert tie is not None and program.values[tie].producer < n.index


def test_a_recomputed_embedding_lookup_is_not_fetched_again(monkeypatch):
    """The auto plan recomputes the Llama embedding lookup in the backward (behind the
    rewrite's barriers); each would fetch the whole table. Value numbering finds them the
    same as the first lookup, which they reuse: the table is fetched once per step."""
    from jaxmem.program import from_jaxpr

    from jaxmem.memory import state_offload
    seen = {}
    real = state_offload.stream

    def spy(fn, avals, inputs, outputs, window=None):
        seen.update(fn=fn, avals=avals, inputs=inputs)
        return real(fn, avals, inputs, outputs, window)

    monkeypatch.setattr(state_offload, "stream", spy)
    w = zoo.make("llama", size="test", batch=1, abstract=True, seq=64, layers=2)
    jaxmem.optimize(w.step, offload_state="all", verify=False).analysis(*w.args)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in seen["avals"]]
    program = from_jaxpr(jax.make_jaxpr(seen["fn"])(*avals))
    model = param_offload.model_reads(program)
    params = param_offload.through_barriers(
        program, frozenset(program.inputs[i] for i in seen["inputs"]) & model)
    lookups = [n.index for n in program.nodes if n.eqn.primitive.name == "gather"
               and set(n.inputs) & params]
    assert len(lookups) > 2  # recomputed per layer by the plan
    monkeypatch.setattr(param_offload, "REUSE_FRACTION", 1.0)  # tiny table at test size
    again = param_offload.reuse(program, params)
    assert set(lookups[1:]) <= set(again) and {again[i] for i in lookups[1:]} == {lookups[0]}
