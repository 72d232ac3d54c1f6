"""jaxmem.compiling.heap: a cache miss is built with the heap that existed before it frozen
out of the collector's walks, and the collector's state is as it was afterwards."""

from __future__ import annotations

import gc

import jax.numpy as jnp

import jaxmem
import jaxmem.optimized
from jaxmem.compiling import heap


def test_a_miss_is_built_with_the_heap_frozen_and_unfrozen_after(monkeypatch):
    seen = []
    build = jaxmem.optimized.build

    def spy(*a, **k):
        seen.append(gc.get_freeze_count())
        return build(*a, **k)

    monkeypatch.setattr(jaxmem.optimized, "build", spy)
    before = gc.get_freeze_count()
    step = jaxmem.optimize(lambda x: jnp.sum(jnp.tanh(x) ** 2))
    assert float(step(jnp.ones(4))) > 0
    assert before == 0 and seen and seen[0] > 0   # the objects before the miss: frozen
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_callers_own_freeze_or_disabled_collector_is_left_alone():
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        with heap.frozen():
            assert gc.get_freeze_count() == n
        assert gc.get_freeze_count() == n   # not unfrozen by jaxmem
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with heap.frozen():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
