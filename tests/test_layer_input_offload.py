"""A scanned layer's input parked in host memory without a model edit (issue 38): an
untagged scan body's input is a body value (``LAYER_INPUT``) a policy can offload; the
step's results are ``jax.jit``'s exactly; on the H100 target it goes at least 15% below
re-running each layer from an input kept on the device, and ``offload=True`` meets a budget
15% below the lowest peak the budget search reaches without offload.

Shapes: the zoo GPT scanned (``transformer_scan``) at its test widths, 32 layers, batch 16,
sequence 64 (the layer inputs are then most of what full remat keeps); on the H100 target
without dropout (its random bits took 40% of the compile time and are not what these tests
are about; the results test keeps it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from benchmarks import zoo
from jaxmem import measure, targets
from jaxmem.rewriting.scans import LAYER_KEY, BodyPolicy, body_values, candidates
from jaxmem.tracing.program import trace

FULL = BodyPolicy("full")
INPUT_OFFLOADED = BodyPolicy("full+input offloaded", offload=(LAYER_KEY,))
# The two budget searches of one step, with and without offload, compile the plain step and
# the save/recompute plans alike: each once (conftest.py).
COMPILE_ONCE = True


def test_untagged_bodies_offer_their_input_to_offload_only():
    g = zoo.make("transformer_scan", size="test", abstract=True)
    values = body_values(trace(g.step, *g.args))
    with_off = {p.name: p for p in candidates(values, offload=True)}
    assert {"full+input offloaded", "ladder-1+input offloaded"} <= set(with_off)
    assert LAYER_KEY in with_off["ladder-1+offload"].offload
    without = candidates(values)
    assert not any(p.layer_input_name for p in without)  # nothing changes without offload


@pytest.mark.parametrize("name", ["transformer_scan", "llama_scan"])
def test_input_offloaded_gives_jits_results_exactly(name):
    w = zoo.make(name, size="test")
    copy = lambda t: jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, t)  # noqa: E731
    ref = jax.jit(w.step)(*copy(w.args))
    opt = jaxmem.optimize(w.step, remat_scans=INPUT_OFFLOADED, verify=False)
    out = opt(*copy(w.args))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    jaxpr = str(opt.trace(*w.args).jaxpr)
    assert "jaxmem_layer_input" in jaxpr and "Host" in jaxpr  # named, stacked in host memory


def _peak(w, args, policy) -> measure.Figures:
    opt = jaxmem.optimize(w.step, remat_scans=policy, verify=False, max_recompute_fraction=0.0,
                          donate_argnums=(0,))
    return measure.figures(measure.compile(opt.lower(*args)))


@pytest.fixture(scope="module")
def gpt_h100():
    """The step, its arguments on the H100 target, and its compiled figures with every
    layer re-run from its input kept on the device (full remat per layer)."""
    target = targets.require("h100")
    w = zoo._make("transformer_scan", "test", 16, None, 0, abstract=True,  # noqa: SLF001
                  overrides={"layers": 32, "seq": 64, "dropout": 0.0})
    args = target.place(w.args)
    return w, args, _peak(w, args, FULL)


def test_offloaded_input_goes_below_full_remat_on_the_h100_target(gpt_h100):
    w, args, full = gpt_h100
    off = _peak(w, args, INPUT_OFFLOADED)
    assert off.host_temp > 0  # XLA:GPU placed the stacked inputs in host memory
    assert off.peak <= 0.85 * full.peak, (off.peak, full.peak)


@pytest.fixture(scope="module")
def save_recompute_floor(gpt_h100):
    """The lowest peak jaxmem's budget search reaches with save and recompute alone (no
    offload; compiled, or predicted where it ruled every plan out by prediction): its
    ``BudgetError`` under a budget just above the arguments, the scan-body policies and the
    residual search both tried."""
    from jaxmem.planning.budget import BudgetError

    w, args, _ = gpt_h100
    a = jaxmem.optimize(w.step, donate_argnums=(0,), verify=False).analysis(*args)
    with pytest.raises(BudgetError) as e:
        jaxmem.optimize(w.step, budget=a.argument_bytes + 1, donate_argnums=(0,)).plan(*args)
    return e.value.minimum_bytes


def test_offload_meets_a_budget_15_percent_below_what_save_and_recompute_reach(
        gpt_h100, save_recompute_floor):
    w, args, full = gpt_h100
    assert save_recompute_floor <= full.peak  # full remat is one of the search's plans
    budget = int(0.85 * save_recompute_floor)
    plan = jaxmem.optimize(w.step, budget=budget, offload=True, donate_argnums=(0,)).plan(*args)
    assert plan.compiled.peak <= budget
    assert any("jaxmem_layer_input" in n for n in plan.notes), plan.notes
