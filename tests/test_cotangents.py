"""Cotangents that cross backward regions (jaxmem.rewriting.rewrite.crossing_cotangents).

A concatenation's cotangent is split among the regions of its pieces; left alone, XLA fuses
its producer into every reader and keeps the producer's inputs (re-created activations, ReLU
derivatives) live across all of them. The rewrite materialises such values where they are
made when a split crosses regions. These tests check the memory relation on a DenseNet, that
the values do not change, and that programs without such a split are rewritten as before.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from jaxmem.program import trace

from benchmarks import zoo
from jaxmem import measure
from jaxmem.analyzing.analysis import from_program
from jaxmem.planning.strategies import plan_auto
from jaxmem.rewriting.rewrite import crossing_cotangents, rewrite

# The default (cut_cotangents=None) is the cut rewrite: the same program, compiled once.
COMPILE_ONCE = True


@functools.cache
def _setup(name: str):
    w = zoo.make(name, size="test")
    prog = trace(w.step, *w.args)
    a = from_program(prog)
    plan = plan_auto(a)
    residuals = frozenset(r.value for r in a.residuals) | plan.keep
    return w, prog, plan, residuals


def _lowered(name: str, **kw):
    w, prog, plan, residuals = _setup(name)
    fn = rewrite(prog, plan.recompute, residuals=residuals, **kw)
    donate = tuple(range(len(jax.tree.leaves(w.state))))
    return fn, jax.jit(fn, donate_argnums=donate).lower(*jax.tree.leaves(w.args))


def test_cutting_split_cotangents_lowers_a_densenet_peak_and_keeps_values():
    w, prog, _, _ = _setup("densenet")
    assert crossing_cotangents(prog)
    peaks, exes = {}, {}
    for cut in (False, True, None):
        _, lowered = _lowered("densenet", cut_cotangents=cut)
        exes[cut] = measure.compile(lowered)
        peaks[cut] = measure.figures(exes[cut]).peak
    assert peaks[True] < peaks[False]
    assert peaks[None] == peaks[True]  # on by default: the concatenation's cotangent is split
    flat = jax.tree.leaves(w.args)
    # the values of the very executables measured (they donate the state: run on copies)
    got, want = (exes[cut](*[jnp.copy(x) for x in flat]) for cut in (True, False))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_programs_without_split_cotangents_are_rewritten_as_before():
    _, prog, _, _ = _setup("mlp")
    assert crossing_cotangents(prog)  # cotangents do cross regions, but none is a split
    _, default = _lowered("mlp")
    _, off = _lowered("mlp", cut_cotangents=False)
    assert default.as_text() == off.as_text()
