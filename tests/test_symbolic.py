"""The rewritten programs ``verify`` ranks are built without tracing them (issue 37).

:func:`jaxmem.rewriting.symbolic.rewritten_program` replays a plan onto a program under
construction instead of through JAX. It must be the program a trace of the rewrite gives,
node for node (primitive, phase, layer, name stack, kind, costs, which values each reads
and makes), or the ranking would read another program than the one compiled: checked on
every candidate plan of zoo steps that exercise what the replay emits (dropout's
constant-folded converts, max-pooling's substitute, the barriers of cut cotangents, the
accelerators' fences and settles, scanned layers).
"""

from __future__ import annotations

import dataclasses

import pytest

import jaxmem
from benchmarks import zoo
from jaxmem import targets
from jaxmem.analyzing.liveness import liveness
from jaxmem.compiling import choose, predicted, steps
from jaxmem.planning.plan import Decision
from jaxmem.rewriting import symbolic
from jaxmem.tracing.program import Program, from_jaxpr


class _Stop(Exception):
    pass


def _candidates(monkeypatch, w, where: str):
    """The step and verify's candidates of zoo workload ``w`` placed on ``where``, as
    ``jaxmem.optimize`` makes them (nothing compiled)."""
    got = {}

    def captured(plan, analysis, step, options):
        got.update(step=step, cands=choose.rewrite_candidates(plan, analysis, step, options))
        raise _Stop

    monkeypatch.setattr(predicted, "rewrite_candidates", captured)
    args = w.args if where == "cpu" else targets.place(w.args, targets.require(where))
    with pytest.raises(_Stop):
        jaxmem.optimize(w.step).lower(*args)
    return got["step"], got["cands"]


def _canonical(p: Program):
    """``p`` with its values numbered in the order they are made (constants by value):
    two programs built in different orders of constants compare equal."""
    made = list(p.inputs) + [o for n in p.nodes for o in n.outputs]
    ids = {v: k for k, v in enumerate(made)}

    def val(v):
        x = p.values[v]
        return ("const", x.shape, x.dtype, repr(x.const)[:60]) if x.is_const else ids[v]

    nodes = [(n.primitive, n.phase, n.layer, n.name_stack, n.kind, n.flops, n.bytes_moved,
              n.trip_count, tuple(map(val, n.inputs)), tuple(map(val, n.outputs)))
             for n in p.nodes]
    values = [(x.shape, x.dtype, x.nbytes, x.memory_space) for x in map(p.values.__getitem__,
                                                                       made)]
    return nodes, tuple(map(val, p.outputs)), values


@pytest.mark.parametrize("name,where", [
    ("transformer", "h100"),   # dropout: converts of constants folded, as JAX's trace does
    ("cnn_bn", "h100"),        # max-pooling's substitute, batch-norm state
    ("densenet", "h100"),      # cut cotangents
    ("transformer_scan", "h100"),  # scanned layers: units with bodies
    ("resnet", "cpu"),         # no fences or settles
])
def test_the_built_program_is_the_traced_one(monkeypatch, name, where):
    w = zoo.make(name, size="test", abstract=True)
    step, cands = _candidates(monkeypatch, w, where)
    assert len(cands) > 1
    for c in cands:
        traced = from_jaxpr(c.jitted.trace(*step.flat).jaxpr)
        built = step.rewritten(c.plan)
        assert _canonical(built) == _canonical(traced), c.plan.strategy
        assert liveness(built, donated=step.donate_flat, platform=step.platform) == \
            liveness(traced, donated=step.donate_flat, platform=step.platform)


def test_a_plan_that_offloads_is_traced(monkeypatch):
    """Host copies are not built: the step traces such a plan's rewrite, as before."""
    w = zoo.make("mlp", size="test", abstract=True)
    step, cands = _candidates(monkeypatch, w, "cpu")
    plan = next(c.plan for c in cands if c.plan.recompute)
    k = next(k for k, c in enumerate(plan.choices) if c.decision is Decision.RECOMPUTE)
    moved = dataclasses.replace(plan, choices=plan.choices[:k] + (dataclasses.replace(
        plan.choices[k], decision=Decision.OFFLOAD),) + plan.choices[k + 1:])
    assert moved.offload
    with pytest.raises(symbolic.Unsupported):
        symbolic.rewritten_program(step.program, moved)
    program = step.rewritten(moved)
    assert any(n.primitive == "device_put" for n in program.nodes)


def test_the_ranking_traces_no_rewrite(monkeypatch):
    """verify's ranking reads each candidate's built program: no rewrite is traced and
    flattened (the one compiled is traced when it is lowered)."""
    w = zoo.make("resnet", size="test", abstract=True)
    step, cands = _candidates(monkeypatch, w, "cpu")

    def no_trace(*a, **k):
        raise AssertionError("a rewrite was traced")

    monkeypatch.setattr(choose, "from_jaxpr", no_trace)
    monkeypatch.setattr(steps, "from_jaxpr", no_trace)
    peaks = predicted._RewrittenPeaks(cands, step, step.platform)
    figures = [peaks(i) for i in range(len(cands))]
    assert all(isinstance(f, int) and f > 0 for f in figures), figures
    assert not any(peaks.too_large(i) for i in range(len(cands)))


def test_ranking_a_candidate_leaves_no_reference_cycles(monkeypatch):
    """Building and analysing a candidate's rewritten step (a densenet's: cut cotangents,
    fences, the settles' narrowest ties) makes no cyclic garbage: it is all freed by
    reference counting as the analysis ends, not held until the collector runs (the
    liveness model's and the ties' recursive closures were reference cycles that kept the
    memo and each rewritten program alive until then)."""
    import gc

    w = zoo.make("densenet", size="test", abstract=True)
    step, cands = _candidates(monkeypatch, w, "h100")
    peaks = predicted._RewrittenPeaks(cands, step, step.platform)
    peaks(0)   # the step's shared caches (constants, substitutes) made once, kept
    gc.collect()
    gc.disable()
    try:
        figures = [predicted._RewrittenPeaks(cands, step, step.platform)(i)
                   for i in range(len(cands))]
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert all(isinstance(f, int) and f > 0 for f in figures), figures


def test_a_rewrite_estimated_far_past_its_limit_is_not_built(monkeypatch):
    """The rewrite's size estimated from its replay chains (the step's nodes and those
    its regions replay) is close to the built program's: within the margin above it
    (``ESTIMATE_MARGIN``), and below it by the barriers; a limit the estimate passes by
    more than the margin raises ``TooLarge`` before a node is built (MEDL's per-layer plan
    of GPT-2 small was built to its limit to learn that)."""
    w = zoo.make("transformer", size="test", abstract=True)
    step, cands = _candidates(monkeypatch, w, "h100")
    for c in cands:
        built = len(step.rewritten(c.plan).nodes)
        est = len(step.program.nodes) + symbolic._replayed(step.program, c.plan)
        assert 0.7 * built <= est <= 1.05 * built, (c.plan.strategy, est, built)
    plan = cands[0].plan
    est = len(step.program.nodes) + symbolic._replayed(step.program, plan)
    monkeypatch.setattr(symbolic.Symbolic, "bind", lambda *a: pytest.fail("built"))
    limit = int(est / symbolic.ESTIMATE_MARGIN) - 1
    with pytest.raises(symbolic.TooLarge) as e:
        step.rewritten(plan, limit)
    assert e.value.limit == limit


def test_a_build_past_its_limit_stops_there(monkeypatch):
    """``limit``: the build stops once it has made more nodes (``TooLarge``), so a rewrite
    too large to compile is not built whole to learn that (greedy's lowest plan of GPT-2
    small was 109,270 equations, 15.4x the step); at or over its size it is built whole;
    the budget search's ``_Compiles`` then declines to compile it without tracing it."""
    from jaxmem.compiling import plan_step
    from jaxmem.planning.budget.units import TooLargeToCompile

    w = zoo.make("mlp", size="test", abstract=True)
    step, cands = _candidates(monkeypatch, w, "cpu")
    plan = next(c.plan for c in cands if c.plan.recompute)
    whole = step.rewritten(plan)
    assert _canonical(step.rewritten(plan, len(whole.nodes))) == _canonical(whole)
    with pytest.raises(symbolic.TooLarge) as e:
        step.rewritten(plan, len(whole.nodes) // 2)
    assert e.value.limit == len(whole.nodes) // 2

    # a step whose rewrites all pass the growth limit: sized, not traced, not compiled
    # (the limit is steps.within_growth's, which plan_step's _Compiles builds with)
    monkeypatch.setattr(steps, "growth_limit", lambda n: len(whole.nodes) // 2)
    c = plan_step._Compiles(step)
    traced = []
    monkeypatch.setattr(steps.Step, "rewrite", lambda self, p: traced.append(p))
    assert c.rewritten(plan) is None
    with pytest.raises(TooLargeToCompile, match="more than"):
        c.plan(plan)
    assert traced == []
