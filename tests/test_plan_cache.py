"""The plan cache: a second optimize of the same step plans without compiling."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem
from jaxmem import measure, plan_cache


def step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = h + jnp.tanh(jax.nn.gelu(h @ w) * 1.5)
        return jnp.mean(h ** 2)
    val, g = jax.value_and_grad(loss)(ws)
    return [w - 0.1 * d for w, d in zip(ws, g, strict=True)], val


WS = [jnp.full((32, 32), 0.02 * (i + 1)) for i in range(3)]
X = jax.random.normal(jax.random.key(0), (256, 32))


@pytest.fixture
def compiles(monkeypatch):
    calls = []
    real = measure.compile

    def counting(lowered, options=None):
        calls.append(lowered)
        return real(lowered, options)
    monkeypatch.setattr(measure, "compile", counting)
    return calls


@pytest.fixture
def compiled_once():
    """Each distinct program compiled once in the test (tests/_compiles.py): for a test
    that counts traces, or jaxmem's compile calls (requested before ``compiles``, which
    then counts every call)."""
    from tests._compiles import compile_once

    with compile_once():
        yield


@pytest.mark.parametrize("budget", [None, 0.9])
def test_disk_cache_hit_skips_planning_compiles(tmp_path, compiles, budget):
    plan_cache.set_dir(tmp_path)
    first = jaxmem.optimize(step, donate_argnums=(), budget=budget)
    out1 = first(WS, X)
    cold = len(compiles)
    assert cold >= 2  # planning compiled candidates (and reused one to run)
    assert list(tmp_path.glob("*.plan"))
    plan1 = first.plan(WS, X)

    plan_cache.clear_memory()  # a new process: only the disk cache is left
    compiles.clear()
    second = jaxmem.optimize(step, donate_argnums=(), budget=budget)
    out2 = second(WS, X)
    assert len(compiles) == 1  # the step itself, for the cached plan: no planning compile
    plan2 = second.plan(WS, X)
    assert plan2.recompute == plan1.recompute and plan2.strategy == plan1.strategy
    for a, b in zip(jax.tree_util.tree_leaves(out1), jax.tree_util.tree_leaves(out2),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(out2[1], jax.jit(step)(WS, X)[1], rtol=1e-6)


def test_a_hit_reports_the_figures_the_first_report_compiled(tmp_path, compiles):
    """A plan made without the plain step compiled (``verify=False`` here; ``verify=True``
    where the predicted margin holds) has its report's figures compiled by ``plan()``; they
    are stored with the plan, so a cache hit's report compiles nothing."""
    plan_cache.set_dir(tmp_path)
    first = jaxmem.optimize(step, donate_argnums=(), verify=False)
    first(WS, X)
    plan1 = first.plan(WS, X)  # compiles the plain step for the baseline
    assert plan1.baseline is not None
    plan_cache.clear_memory()
    compiles.clear()
    second = jaxmem.optimize(step, donate_argnums=(), verify=False)
    second(WS, X)
    plan2 = second.plan(WS, X)
    assert len(compiles) == 1  # the step itself: the report's figures came with the plan
    assert plan2.compiled == plan1.compiled and plan2.baseline == plan1.baseline


def test_changed_option_misses_and_memory_cache(compiles):
    jaxmem.optimize(step, donate_argnums=())(WS, X)
    compiles.clear()
    jaxmem.optimize(step, donate_argnums=())(WS, X)  # in memory, no directory set
    assert len(compiles) == 1
    compiles.clear()
    jaxmem.optimize(step, donate_argnums=(), max_recompute_fraction=0.2)(WS, X)
    assert len(compiles) > 1  # another option: planned again


def test_verify_reuses_the_winning_executable(compiles):
    fast = jaxmem.optimize(step, donate_argnums=())
    fast(WS, X)
    n = len(compiles)
    fast(WS, X)
    fast.plan(WS, X)
    assert len(compiles) == n  # no compile after planning: the winner ran the first call


def test_progress_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="jaxmem"):
        run = plan_cache.progress(lambda: None, "budget search", after_s=-1.0)
        run()
    assert "budget search: compile 1" in caplog.text


def test_a_step_without_scans_is_traced_once_per_plan(tmp_path, monkeypatch, compiled_once):
    """The step's Python runs once to trace its program (and once more for each of the plain
    step the plan is verified against and, with ``verify="builtins"``, the two built-in
    candidates); a cache hit traces it once. A scan-body choice, which traces the step under
    each body policy, is skipped when the step has no scan."""
    from benchmarks import zoo
    from tests._compiles import one_rewrite_plan

    # The rewrite's candidates never run the step's Python (they rewrite its traced
    # program): one of them is enough here; the plain step and that candidate, compiled by
    # the first two optimizes alike, are compiled once (the compiled_once fixture).
    one_rewrite_plan(monkeypatch)
    w = zoo.make("mlp", size="test")
    traces = []

    def counted(state, batch):
        traces.append(1)
        return w.step(state, batch)

    def state():  # the step donates its state
        return jax.tree.map(jnp.copy, w.state)

    plan_cache.set_dir(tmp_path)
    first = jaxmem.optimize(counted)
    first(state(), w.batch)
    assert first.plan(state(), w.batch).recompute  # the plan runs, not the plain step
    # the program, and plain jax.jit: a step under predicted.PLAIN_MIN_BYTES is checked
    # against the plain step's compiled peak
    assert len(traces) == 2
    traces.clear()
    first = jaxmem.optimize(counted, verify="builtins")
    first(state(), w.batch)
    # the program, plain jax.jit for the verifying compile, and the step with its loss under
    # jax.checkpoint(policy=dots_saveable), whole and per block (the built-in candidates)
    assert len(traces) == 4
    traces.clear()
    jaxmem.optimize(counted)(state(), w.batch)  # a new object: a plan cache hit
    assert len(traces) == 1


def _hk_resnet_step():
    """A haiku ResNet step (sgd with momentum, batch-norm state) whose loss under
    jax.checkpoint(policy=dots_saveable) compiles below the plain step on CPU."""
    import haiku as hk

    def forward(x):
        return hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=10,
                              bottleneck=False, channels_per_group=(16, 32, 64, 128))(
                                  x, is_training=True)

    net = hk.transform_with_state(forward)
    x = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
    y = jnp.array([1, 2])
    params, hk_state = jax.jit(net.init)(jax.random.PRNGKey(1), x)  # one compile, not ~140
    tx = optax.sgd(0.1, momentum=0.9)

    def loss(params, hk_state, x, y):
        logits, hk_state = net.apply(params, hk_state, None, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), hk_state

    def step(state, x, y):
        params, hk_state, opt_state = state
        (value, hk_state), grads = jax.value_and_grad(loss, has_aux=True)(params, hk_state,
                                                                           x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), hk_state, opt_state), value

    return step, (params, hk_state, tx.init(params)), (x, y)


def test_the_builtin_policy_candidate_runs_and_is_cached(tmp_path, compiled_once, compiles,
                                                         monkeypatch):
    """When the step with its loss under jax.checkpoint(policy=dots_saveable) compiles
    lowest (here the rewrite's candidates are replaced by a plan that drops nothing, and the
    built-ins are the one that wins, the policy around each block), that step runs, with
    jax.jit's results, and a plan cache hit runs it again without a planning compile."""
    from jaxmem.planning import strategies
    from tests._compiles import one_builtin

    step, state0, batch = _hk_resnet_step()
    monkeypatch.setattr(strategies, "auto_candidates",
                        lambda a, **kw: [strategies.plan_none(a)])
    one_builtin(monkeypatch, per_block=True)  # the whole-loss built-in compiled above it here

    def state():  # the step donates its state
        return jax.tree.map(jnp.copy, state0)

    want = jax.jit(step)(state(), *batch)
    plan_cache.set_dir(tmp_path)
    first = jaxmem.optimize(step, verify="builtins")
    got = first(state(), *batch)
    plan = first.plan(state(), *batch)
    assert plan.loss_policy == "dots_saveable" and plan.loss_blocks
    assert plan.compiled.peak < plan.baseline.peak
    plan_cache.clear_memory()
    compiles.clear()
    second = jaxmem.optimize(step, verify="builtins")
    again = second(state(), *batch)
    # the cached plan's step: no planning compile (jaxmem asks for one compile, of the
    # program the first optimize ran: compiled_once, beneath the count, hands that back)
    assert len(compiles) == 1
    assert second.plan(state(), *batch).loss_policy == "dots_saveable"
    for a, b, c in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(again),
                       strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(b, c)
