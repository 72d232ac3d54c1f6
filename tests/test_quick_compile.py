"""Figures-only compiles: the same figures as full compiles, the same plan chosen, and the
winner compiled in full to run (``verify="builtins"`` and ``"all"``: the default compiles
its few candidates in full)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from benchmarks import zoo
from jaxmem import measure, plan_cache
from jaxmem.compiling import quick_compile
from jaxmem.planning import strategies
from jaxmem.rewriting.rewrite import apply
from tests.test_plan_cache import step  # the residual gelu/tanh MLP step

WS = [jnp.full((32, 32), 0.02 * (i + 1)) for i in range(6)]
X = jax.random.normal(jax.random.key(0), (1024, 32))  # a plan beats the plain step


def _figures(exe):
    m = exe.memory_analysis()
    ca = exe.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return (m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
            m.alias_size_in_bytes, ca.get("flops"), ca.get("bytes accessed"))


def test_figures_match_full_compiles():
    w = zoo.make("mlp", size="test")  # blocks: several candidates
    analysis = jaxmem.analyze(w.step, w.state, w.batch)
    flat = jax.tree_util.tree_leaves((w.state, w.batch))
    fns = [jax.jit(w.step).lower(w.state, w.batch)] + [
        jax.jit(apply(analysis.program, p)).lower(*flat)
        for p in strategies.auto_candidates(analysis)]
    assert len(fns) >= 3
    for lowered in fns[:3]:  # the plain step and two candidates: a test's worth of compiles
        assert quick_compile.is_quick(lowered)  # CPU has figures-only options
        assert _figures(quick_compile.compile(lowered)) == _figures(measure.compile(lowered))


@pytest.fixture
def options_seen(monkeypatch):
    seen = []
    real = measure.compile

    def recording(lowered, options=None):
        seen.append(dict(options or {}))
        return real(lowered, options)
    monkeypatch.setattr(measure, "compile", recording)
    return seen


def test_same_plan_as_full_compiles_and_winner_runs_fully_optimised(monkeypatch, options_seen):
    plan_cache.clear_memory()
    quick = jaxmem.optimize(step, donate_argnums=(), verify="builtins")
    out = quick(WS, X)
    p_quick = quick.plan(WS, X)
    assert p_quick.recompute  # a candidate won: its executable is the one compiled again
    quick_calls = [o for o in options_seen if o == quick_compile.QUICK_OPTIONS["cpu"]]
    assert len(quick_calls) == len(options_seen) - 1  # all but the one that runs
    assert options_seen[-1] == {}  # the executable that ran: a full compile

    plan_cache.clear_memory()
    monkeypatch.setenv("JAXMEM_QUICK_COMPILE", "0")
    options_seen.clear()
    full = jaxmem.optimize(step, donate_argnums=(), verify="builtins")
    full(WS, X)
    p_full = full.plan(WS, X)
    assert all(o == {} for o in options_seen)
    assert len(options_seen) == len(quick_calls)  # no extra compile: the winner's reused
    assert (p_quick.strategy, p_quick.recompute) == (p_full.strategy, p_full.recompute)
    assert p_quick.compiled == p_full.compiled and p_quick.baseline == p_full.baseline
    ref = jax.jit(step)(WS, X)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-6)
    for a, b in zip(out[0], ref[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
