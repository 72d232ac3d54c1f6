"""verify="background": the first call runs one unverified candidate plan, the others compile
in a thread, and the verified plan takes over once it is ready."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import plan_cache
from jaxmem.compiling import choose, predicted
from jaxmem.planning import strategies
from tests.test_plan_cache import step  # the residual tanh/gelu stack: plans to choose from

WS = [jnp.full((24, 24), 0.03 * (i + 1)) for i in range(3)]
X = jax.random.normal(jax.random.key(1), (192, 24))


def _close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _fresh_plans():
    plan_cache.clear_memory()
    yield
    plan_cache.clear_memory()


def test_background_verification_ends_on_the_verified_plan(caplog, monkeypatch):
    # the bar without the model's error bound: this small step's plan is below its predicted
    # plain peak, not 20% below (the bound is tested below); its prediction trusted though
    # under PLAIN_MIN_BYTES (that rule is tested below too)
    monkeypatch.setattr(predicted, "PLAIN_ERROR", {"cpu": 0.0})
    monkeypatch.setattr(predicted, "PLAIN_MIN_BYTES", 0)
    ref = jax.jit(step)(WS, X)
    verified = jaxmem.optimize(step, donate_argnums=(), verify="builtins").plan(WS, X)
    plan_cache.clear_memory()

    bg = jaxmem.optimize(step, donate_argnums=(), verify="background")
    _close(bg(WS, X), ref)  # the first call: the unverified auto plan, same results
    entry = next(iter(bg._cache.values()))
    assert entry.pending is not None and "not verified yet" in entry.plan.notes[-1]
    assert entry.verify_later is None  # started after the first call's compile
    cands = strategies.auto_candidates(bg.analysis(WS, X))
    assert entry.plan.strategy == max(cands, key=lambda p: p.dropped_bytes).strategy
    with caplog.at_level(logging.INFO, logger="jaxmem"):
        plan = bg.plan(WS, X)  # waits for the background verification
    assert entry.pending is None
    assert plan.strategy == verified.strategy
    assert plan.compiled.peak == verified.compiled.peak
    assert "verified in the background" in plan.notes[-1]
    assert any("verified in the background" in r.getMessage() for r in caplog.records)
    _close(bg(WS, X), ref)  # calls after the swap run the verified executable
    _close(bg(WS, X), ref)

    # the verified plan is what the plan cache holds, shared with verify="builtins"
    again = jaxmem.optimize(step, donate_argnums=(), verify="builtins")
    assert again.plan(WS, X).strategy == verified.strategy
    assert not any("not verified" in n for n in again.plan(WS, X).notes)


def test_a_thread_local_jax_context_verifies_before_the_first_call():
    # a background thread would not trace under the caller's context manager
    with jax.default_matmul_precision("highest"):
        bg = jaxmem.optimize(step, donate_argnums=(), verify="background")
        bg(WS, X)
    entry = next(iter(bg._cache.values()))
    assert entry.pending is None
    assert not any("not verified" in n for n in entry.plan.notes)
    assert entry.plan.compiled is not None  # verified (compiled) before the first call ran


def test_a_failed_background_verification_keeps_the_running_plan(monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("compile failed")
    monkeypatch.setattr(choose, "verified", broken)
    bg = jaxmem.optimize(step, donate_argnums=(), verify="background")
    ref = jax.jit(step)(WS, X)
    _close(bg(WS, X), ref)
    with caplog.at_level(logging.WARNING, logger="jaxmem"):
        plan = bg.plan(WS, X)
    assert "background verification failed (RuntimeError: compile failed)" in plan.notes[-1]
    assert any("background verification failed" in r.getMessage() for r in caplog.records)
    _close(bg(WS, X), ref)
    monkeypatch.undo()  # nothing unverified was stored: a new optimize plans afresh
    fresh = jaxmem.optimize(step, donate_argnums=())
    assert not any("not verified" in n for n in fresh.plan(WS, X).notes)


def test_a_first_plan_above_the_plain_prediction_waits_for_verification(monkeypatch):
    # an error bound of the whole prediction: the bar is 0 bytes, no plan is below it
    monkeypatch.setattr(predicted, "PLAIN_ERROR", {"cpu": 1.0})
    bg = jaxmem.optimize(step, donate_argnums=(), verify="background")
    _close(bg(WS, X), jax.jit(step)(WS, X))
    entry = next(iter(bg._cache.values()))
    assert entry.pending is None and entry.verify_later is None  # verified, then ran
    assert "verified before the first call" in entry.plan.notes[-1]
    assert entry.plan.compiled is not None


def test_the_first_plans_bar_is_the_plain_prediction_less_the_error_bound(monkeypatch):
    """An unverified plan runs first only where verify=True's predicted check would keep it:
    below the plain step's predicted peak by ``PLAIN_ERROR`` (the corpus over-predicts plain
    steps by up to 19%); a plan within that waits for its verification."""
    monkeypatch.setattr(predicted, "PLAIN_ERROR", {"cpu": 0.0})
    monkeypatch.setattr(predicted, "PLAIN_MIN_BYTES", 0)
    bg = jaxmem.optimize(step, donate_argnums=(), verify="background")
    bg(WS, X)
    entry = next(iter(bg._cache.values()))
    assert entry.pending is not None  # below the bare prediction: runs unverified first
    peak = entry.compiled and jaxmem.measure.figures(entry.compiled).peak
    bar = entry.first_plan_bar
    bg.plan(WS, X)
    plan_cache.clear_memory()
    # a bound that puts the bar just below this plan's peak: it verifies first
    monkeypatch.setattr(predicted, "PLAIN_ERROR", {"cpu": 1 - 0.99 * peak / bar})
    bg = jaxmem.optimize(step, donate_argnums=(), verify="background")
    _close(bg(WS, X), jax.jit(step)(WS, X))
    entry = next(iter(bg._cache.values()))
    assert entry.pending is None and entry.first_plan_bar < peak
    assert "verified before the first call" in entry.plan.notes[-1]


def test_a_step_under_the_trusted_size_verifies_before_the_first_call(monkeypatch):
    """Under ``PLAIN_MIN_BYTES`` verify=True does not trust the plain step's predicted peak
    (it compiles the plain step); verify="background" uses the same bar: none, so the first
    plan waits for its verification, however far below the prediction it compiles."""
    monkeypatch.setattr(predicted, "PLAIN_ERROR", {"cpu": 0.0})
    bg = jaxmem.optimize(step, donate_argnums=(), verify="background")
    assert bg.analysis(WS, X).peak_bytes < predicted.PLAIN_MIN_BYTES
    _close(bg(WS, X), jax.jit(step)(WS, X))
    entry = next(iter(bg._cache.values()))
    assert entry.first_plan_bar == 0
    assert entry.pending is None and entry.verify_later is None  # verified, then ran
    assert "verified before the first call" in entry.plan.notes[-1]


def test_verify_must_be_one_of_its_options():
    with pytest.raises(ValueError, match="verify must be True, False, 'builtins', 'all', "
                                         "'background' or 'predicted'"):
        jaxmem.optimize(step, verify="later")
