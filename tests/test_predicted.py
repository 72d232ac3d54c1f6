"""The default ``verify=True`` (jaxmem.compiling.predicted; ``"predicted"`` is its earlier
name): the best-predicted candidate
compiled first and in full; the plain step compiled only when the plan is not below its
predicted peak by the model's error bound. Synthetic figures for the order of compiles, a
small step for the results and the compile count."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from benchmarks.zoo.small import MLP, make_step
from jaxmem import measure
from jaxmem.compiling import choose, predicted
from jaxmem.compiling.choose import Candidate
from jaxmem.compiling.options import Options
from jaxmem.rewriting.symbolic import TooLarge
from jaxmem.xla.measure import Figures
from tests._compiles import count_compiles


def _fig(peak: int) -> Figures:
    return Figures(argument=peak, output=0, temp=0, alias=0, flops=1000.0)


class _Model:
    """A cost model whose predicted peak of a plan is its ``recompute`` field."""

    def __init__(self, analysis):
        pass

    def evaluate(self, drop, off):
        return SimpleNamespace(peak=drop)


def _run(monkeypatch, compiled: dict[str, int], plain_predicted: int = 100,
         plain: int = 100, predictions=(40, 10, 30, 20), rewritten=None,
         min_bytes: int = 0, within: float = 10.0, platform: str = "cpu",
         too_large: frozenset[str] = frozenset(), crowd: int = 99, growth=None,
         past_limit: frozenset[str] = frozenset()):
    """``predicted.predicted`` over four candidates (predicted 40, 10, 30, 20) with
    synthetic compiled peaks: what was compiled, in order (a group compiled together
    joined by "+"), and what runs. ``within``: ``REWRITTEN_WITHIN`` (default: every
    candidate's rewritten step analysed); ``too_large``: the candidates whose rewrite is
    over ``MAX_REWRITE_GROWTH`` (the reasons the plan's notes get are in ``_run.skipped``);
    ``crowd``: ``CROWD`` (default: no crowd); ``growth``: each rewrite's equations over the
    step's (default 1.2); ``past_limit``: those whose build passes the growth limit (the
    step has 100 equations)."""
    order: list[str] = []
    events: list[str] = []  # compiles started and rewritten steps analysed, in order
    cands = [Candidate(SimpleNamespace(strategy=n, recompute=p, offload=(), notes=(),
                                       donated=(0,)), None, None)
             for n, p in zip("abcd", predictions, strict=True)]
    monkeypatch.setattr(predicted, "CostModel", _Model)
    monkeypatch.setattr(predicted, "PLAIN_MIN_BYTES", min_bytes)
    monkeypatch.setattr(predicted, "REWRITTEN_WITHIN", within)
    monkeypatch.setattr(predicted, "CROWD", crowd)
    monkeypatch.setattr(predicted, "rewrite_candidates", lambda *a: list(cands))

    def rewritten_peak(c, step, platform, program=None):
        events.append(f"analysed {c.plan.strategy}")
        return (rewritten or {}).get(c.plan.strategy)

    monkeypatch.setattr(choose, "rewritten_peak", rewritten_peak)

    class Compiles:  # predicted._Compiles without XLA: start records, results compiles
        def __init__(self, step):
            self.started = set()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start(self, cs):
            for c in cs:
                if c.plan.strategy not in self.started:
                    self.started.add(c.plan.strategy)
                    events.append(f"started {c.plan.strategy}")

        def start_plain(self):
            events.append("started plain")

        def plain(self):
            if not hasattr(self, "base"):
                self.base = predicted._plain(None)
            return self.base

        def results(self, cs):
            self.start(cs)
            order.append("+".join(c.plan.strategy for c in cs))
            return ([_fig(compiled[c.plan.strategy]) for c in cs],
                    [f"exe {c.plan.strategy}" for c in cs])

    def compile_plain(step):
        order.append("plain")
        return _fig(plain), "exe plain"

    monkeypatch.setattr(predicted, "_Compiles", Compiles)
    monkeypatch.setattr(predicted, "_plain", compile_plain)
    def rewritten_program(c, step, limit=None):
        if c.plan.strategy in past_limit:   # its build stopped at the growth limit
            raise TooLarge(limit)
        return c.plan.strategy

    monkeypatch.setattr(choose, "rewritten_program", rewritten_program)
    monkeypatch.setattr(choose, "rewrite_size", lambda c, step, program=None: (
        "too large (test)" if c.plan.strategy in too_large else None,
        (growth or {}).get(program, 1.2)))
    _run.skipped = []

    def kept(plan, fig, base, tried, skipped, check):
        _run.skipped = skipped
        return plan.strategy, base is not None, check

    def plain_kept(plan, a, base, tried, skipped):
        _run.skipped = skipped
        return ("plain", base[0].peak), base[1]

    monkeypatch.setattr(predicted, "_kept", kept)
    monkeypatch.setattr(predicted, "_plain_kept", plain_kept)
    analysis = SimpleNamespace(peak_bytes=plain_predicted, platform=platform)
    step = SimpleNamespace(platform=platform, program=SimpleNamespace(nodes=[None] * 100))
    options = SimpleNamespace(max_recompute_fraction=0.05)
    _run.events = events
    return order, predicted.predicted(SimpleNamespace(donated=(0,)), analysis, step, options)


def test_one_compile_when_the_best_predicted_is_well_below_the_predicted_plain(monkeypatch):
    order, ((name, plain_compiled, check), exe) = _run(monkeypatch, dict(a=60, b=75, c=70,
                                                                        d=75))
    assert order == ["b"] and name == "b" and exe == "exe b" and not plain_compiled
    assert "predicted peak" in check


def test_the_plain_step_is_compiled_when_the_margin_is_not_there(monkeypatch):
    # 95 is not 20% below the predicted 100, but below the compiled plain step's 100
    order, ((name, plain_compiled, check), exe) = _run(monkeypatch, dict(a=60, b=95, c=70,
                                                                        d=75))
    assert order == ["b", "plain"] and name == "b" and plain_compiled
    assert "compiled peak" in check


def test_a_plan_compiled_below_its_rewritten_prediction_lowers_the_predicted_bar(monkeypatch):
    """The predicted check's bar is scaled by the plan's own compiled over rewritten peak
    where that is under 1 (a model that over-predicts the plan over-predicts the plain step
    too: the lm1b decoder's plain step 22%, past ``PLAIN_ERROR``'s bound): 75 passes the
    CPU bar of 80 as predicted, not at 75 / 100 (60); the plain step is compiled."""
    order, ((name, plain_compiled, check), _) = _run(
        monkeypatch, dict(a=60, b=75, c=70, d=75), rewritten=dict(b=100))
    assert order == ["b", "plain"] and name == "b" and plain_compiled
    assert "compiled peak" in check
    # a plan compiled at or above its rewritten prediction keeps the bar as it is
    order, ((name, plain_compiled, check), _) = _run(
        monkeypatch, dict(a=60, b=75, c=70, d=75), rewritten=dict(b=70))
    assert order == ["b"] and not plain_compiled and "predicted peak" in check
    assert "own compiled over predicted" not in check


def test_the_next_best_predicted_follows_a_plan_above_plain(monkeypatch):
    order, ((name, _, _), exe) = _run(monkeypatch, dict(a=60, b=120, c=70, d=85))
    assert order == ["b", "plain", "d"] and name == "d" and exe == "exe d"


def test_the_plain_step_runs_when_no_candidate_is_below_it(monkeypatch):
    order, (kept, exe) = _run(monkeypatch, dict(a=60, b=120, c=130, d=110))
    # the three best predicted (b, d, c) and the plain step; "a" is never compiled
    assert order == ["b", "plain", "d", "c"] and kept == ("plain", 100)
    assert exe == "exe plain"


def test_a_candidate_too_large_to_compile_is_left_out_and_the_next_best_compiled(
        monkeypatch):
    # b, the best predicted, has a rewrite over MAX_REWRITE_GROWTH: d is compiled instead
    order, ((name, plain_compiled, _), exe) = _run(
        monkeypatch, dict(a=60, b=80, c=70, d=75), too_large=frozenset("b"))
    assert order == ["d"] and name == "d" and exe == "exe d" and not plain_compiled
    assert _run.skipped == ["b: too large (test)"]
    assert not any("analysed b" in e for e in _run.events)  # not analysed either
    # every fitting one is tried before the plain step runs: "a" takes b's place
    order, (kept, _) = _run(monkeypatch, dict(a=160, b=80, c=170, d=175),
                            too_large=frozenset("b"))
    assert order == ["d", "plain", "c", "a"] and kept == ("plain", 100)
    assert _run.skipped == ["b: too large (test)"]
    # one too large after the first group is passed over when reached (the first group,
    # traced to be lowered anyway, is all that is sized before the first compile)
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=120, c=70, d=85),
                                    too_large=frozenset("d"))
    assert order == ["b", "plain", "c"] and name == "c"
    assert _run.skipped == ["d: too large (test)"]


def test_a_rewrite_whose_build_passes_the_growth_limit_is_not_built_further_nor_compiled(
        monkeypatch):
    """A candidate's rewritten step is built only up to ``growth_limit`` nodes
    (``MAX_REWRITE_GROWTH`` times the step's): one that passes it is too large, never
    analysed nor compiled, and its note says it was not built past the limit."""
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=80, c=70, d=75),
                                    past_limit=frozenset("b"))
    assert order == ["d"] and name == "d"
    assert not any(e.endswith(" b") for e in _run.events)   # neither analysed nor started
    assert _run.skipped == ["b: its rewrite has more than 300 equations, over 3.0x the "
                            "step's 100 (over MAX_REWRITE_GROWTH=3: XLA's compile time and "
                            "host memory grow with the program)"]


def test_plans_tied_in_the_model_are_compiled_together_and_the_lowest_checked(
        monkeypatch):
    # b and d tie (the same values dropped, grouped differently): the compiler decides
    order, ((name, plain_compiled, _), exe) = _run(
        monkeypatch, dict(a=60, b=80, c=70, d=75), predictions=(40, 10, 30, 10))
    assert order == ["b+d"] and name == "d" and exe == "exe d" and not plain_compiled


def test_on_a_gpu_plans_tied_in_the_model_are_compiled_one_at_a_time(monkeypatch):
    """``TIES_BY_REWRITTEN``: on XLA:GPU the tied plan whose rewritten step is predicted
    lowest is compiled alone, before any compile starts; the other follows only where it
    does not pass. On CPU both compile together (as above)."""
    ties = dict(predictions=(40, 10, 30, 10), rewritten=dict(a=90, b=70, c=95, d=66))
    order, ((name, plain_compiled, _), exe) = _run(
        monkeypatch, dict(a=60, b=80, c=70, d=75), platform="cuda", **ties)
    assert order == ["d"] and name == "d" and exe == "exe d" and not plain_compiled
    assert _run.events.index("analysed b") < _run.events.index("started d"), _run.events
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=80, c=70, d=120),
                                    platform="cuda", **ties)
    assert order == ["d", "plain", "b"] and name == "b"
    order, _ = _run(monkeypatch, dict(a=60, b=80, c=70, d=75), platform="cpu", **ties)
    assert order == ["b+d"]


def test_the_rewritten_steps_best_is_compiled_with_the_first_group(monkeypatch):
    # "a" is the model's worst and the rewritten step's lowest: compiled with "b", and kept
    order, ((name, _, _), exe) = _run(monkeypatch, dict(a=60, b=80, c=70, d=75),
                                      rewritten=dict(a=55, b=70, c=65, d=66))
    assert order == ["b+a"] and name == "a" and exe == "exe a"
    # from a later group of the model's: moved, not compiled twice
    order, _ = _run(monkeypatch, dict(a=60, b=120, c=130, d=110),
                    rewritten=dict(a=90, b=70, c=65, d=66))
    assert order == ["b+c", "plain", "d"]
    assert predicted._first_with([[1], [3], [2]], [2]) == [[1, 2], [3]]
    assert predicted._first_with([[1], [3], [2]], [2, 3]) == [[1, 2, 3]]
    assert predicted._first_with([[1], [3]], []) == [[1], [3]]


def test_plans_predicted_near_the_lowest_have_their_rewritten_step_analysed_first(
        monkeypatch):
    """``REWRITTEN_WITHIN``: the candidates the model predicts within that of its lowest
    are analysed as rewritten steps first, and the rewritten lowest of them joins the
    first group."""
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=80, c=70, d=75),
                                    predictions=(100, 40, 43, 60),
                                    rewritten=dict(a=64, b=70, c=65, d=66), within=0.10)
    analysed = [e.split()[1] for e in _run.events if e.startswith("analysed")]
    assert analysed[:2] == ["b", "c"], _run.events
    assert order == ["b+c"] and name == "c"   # c: within 10% of b, the rewritten lowest


def test_a_far_plan_joins_where_its_rewritten_step_is_well_below(monkeypatch):
    """``REWRITTEN_OVERRULES``: the rewritten lowest of the candidates the model puts
    further up (analysed after the near ones) joins the first group only where it is
    predicted more than that below each plan there (the lm1b decoder's ``selective``)."""
    kw = dict(predictions=(100, 40, 43, 60), within=0.10)
    # "a": 15% below "c" (the first group's rewritten lowest): joins, and runs
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=80, c=70, d=75),
                                    rewritten=dict(a=55, b=70, c=65, d=66), **kw)
    analysed = [e.split()[1] for e in _run.events if e.startswith("analysed")]
    assert analysed[:2] == ["b", "c"] and set(analysed) == set("abcd"), _run.events
    assert order == ["b+c+a"] and name == "a"
    # 3% below: left to a later group (here never compiled: "c" passes)
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=80, c=70, d=75),
                                    rewritten=dict(a=63, b=70, c=65, d=66), **kw)
    assert order == ["b+c"] and name == "c"


def test_the_first_group_compiles_while_the_rewritten_steps_are_analysed(monkeypatch):
    """The cost model's first group is handed to the compiler before the rewritten steps
    are traced and analysed (which takes seconds at a real width), so the two overlap; the
    rewritten step's best joins it after."""
    _run(monkeypatch, dict(a=60, b=80, c=70, d=75), predictions=(40, 10, 30, 10),
         rewritten=dict(a=55, b=70, c=65, d=66))
    events = _run.events
    assert events[:2] == ["started b", "started d"], events
    assert events.index("started a") > max(i for i, e in enumerate(events)
                                           if e.startswith("analysed")), events


def test_a_large_first_choice_waits_for_the_rewritten_steps(monkeypatch):
    """``LARGE_REWRITE``: where the model's first choice rewrites to more than that times
    the step's equations (MEDL's region plan of the lm1b-width decoder, 1.68x: 64.5 s to
    compile beside selective's 26.6 s), it is not compiled before every rewritten step is
    analysed; one the liveness model puts more than ``REWRITTEN_DEFERS`` above the
    rewritten lowest (here the far one that overrules it) then compiles only where that
    one does not pass."""
    kw = dict(predictions=(40, 10, 30, 20), within=0.10,
              rewritten=dict(a=90, b=70, c=60, d=66))
    # small: b compiles before the analyses, c (overruling) joins it, as before
    order, _ = _run(monkeypatch, dict(a=60, b=80, c=70, d=75), **kw)
    assert _run.events[0] == "started b" and order == ["b+c"], (_run.events, order)
    # large: nothing starts before the analyses; c alone, b never compiled
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=80, c=70, d=75),
                                    growth=dict(b=1.7), **kw)
    events = _run.events
    assert events.index("started c") > max(i for i, e in enumerate(events)
                                           if e.startswith("analysed")), events
    assert order == ["c"] and name == "c" and "started b" not in events
    # c above plain: b is compiled next
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=80, c=120, d=75),
                                    growth=dict(b=1.7), **kw)
    assert order == ["c", "plain", "b"] and name == "b"
    # large, not overruled: b alone, after the analyses
    order, _ = _run(monkeypatch, dict(a=60, b=70, c=70, d=75), growth=dict(b=1.7),
                    **{**kw, "rewritten": dict(a=90, b=60, c=59, d=66)})
    assert order == ["b"] and _run.events[-1] == "started b", _run.events


def test_in_a_crowd_the_rewritten_steps_rank_the_models_choice_before_it_compiles(
        monkeypatch):
    """``CROWD``: where more candidates than that are near the model's lowest on a step
    whose plain prediction is trusted, their rewritten steps are analysed before anything
    compiles, and the model's choice compiles first only where its rewritten step is
    within ``REWRITTEN_DEFERS`` of their lowest (transformers' ResNet18: one compile, not
    two), and then alone; where none of the first passes, the other is compiled next."""
    kw = dict(predictions=(40, 10, 30, 20), crowd=3)
    # b (the model's) 10% above c (the rewritten lowest): c alone, after every analysis
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=75, c=70, d=75),
                                    rewritten=dict(a=90, b=71.5, c=65, d=66), **kw)
    assert order == ["c"] and name == "c"
    events = _run.events
    assert events.index("started c") > max(i for i, e in enumerate(events)
                                           if e.startswith("analysed")), events
    assert "started b" not in events
    # b 1% above c: the liveness does not tell them apart, the model's choice compiles
    # alone (GPT-2 small: one compile, not two), c after it where it does not pass
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=75, c=70, d=75),
                                    rewritten=dict(a=90, b=65.6, c=65, d=66), **kw)
    assert order == ["b"] and name == "b"
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=120, c=70, d=75),
                                    rewritten=dict(a=90, b=65.6, c=65, d=66), **kw)
    assert order == ["b", "plain", "c"] and name == "c"
    # c above plain: b, put after the first compiles, is compiled next
    order, ((name, _, _), _) = _run(monkeypatch, dict(a=60, b=75, c=120, d=75),
                                    rewritten=dict(a=90, b=71.5, c=65, d=66), **kw)
    assert order == ["c", "plain", "b"] and name == "b"
    # not a crowd (three near: b, d, c; CROWD 3): b compiles before the analyses, as before
    _run(monkeypatch, dict(a=60, b=75, c=70, d=75), within=2.0,
         rewritten=dict(a=90, b=71.5, c=65, d=66), **kw)
    assert _run.events[0] == "started b", _run.events
    # a small step (the plain prediction not trusted): no crowd either
    _run(monkeypatch, dict(a=60, b=75, c=70, d=75), min_bytes=101,
         rewritten=dict(a=90, b=71.5, c=65, d=66), **kw)
    assert _run.events[0] == "started b", _run.events
    assert predicted._later([[1, 2], [3]], [1]) == [[2], [1], [3]]
    assert predicted._later([[1], [3]], [1]) == [[1], [3]]
    assert predicted._later([[1], [3]], []) == [[1], [3]]


def test_a_small_step_compiles_the_plain_step_beside_the_first_group(monkeypatch):
    """Below ``PLAIN_MIN_BYTES`` the predicted plain peak is not trusted (small steps are
    predicted worse, and compile fast): the plain step compiles from the start, and a plan
    well below the predicted plain peak is still checked against the compiled one."""
    order, ((name, plain_compiled, check), _) = _run(
        monkeypatch, dict(a=60, b=80, c=70, d=75), min_bytes=101)
    assert _run.events[:2] == ["started b", "started plain"], _run.events
    assert order == ["b", "plain"] and name == "b" and plain_compiled
    assert "compiled peak" in check
    # the case it guards: the plain step over-predicted, the plan above the compiled plain
    order, (kept, _) = _run(monkeypatch, dict(a=95, b=85, c=97, d=96), plain=84,
                            min_bytes=101)
    assert kept == ("plain", 84) and order == ["b", "plain", "d", "c"]


def test_groups_stop_once_the_best_predicted_are_in():
    assert predicted._tied([40, 10, 30, 10, 10], 3) == [[1, 3, 4]]
    assert predicted._tied([40, 10, 30, 20], 3) == [[1], [3], [2]]
    assert predicted._tied([40, 10, 30, 30], 2) == [[1], [2, 3]]


def test_a_platform_without_a_bound_always_compiles_the_plain_step(monkeypatch):
    monkeypatch.setattr(predicted, "PLAIN_ERROR", {})
    order, _ = _run(monkeypatch, dict(a=60, b=10, c=70, d=75))
    assert order == ["b", "plain"]


@pytest.fixture(scope="module")
def mlp():
    return make_step(MLP(width=256, depth=6), jnp.ones((256, 256)))


def test_predicted_mode_matches_jit_below_its_peak_compiling_each_program_once(
        mlp, monkeypatch):
    """The outputs of jax.jit; below the plain step's compiled peak; the compiles are the
    candidates the note names (the best-predicted group: four plans tie in the model on
    this MLP) and the plain step only where the note says it was compiled, none after
    the first call (the checked executable is the one that runs)."""
    import re

    step, state, (x, y) = mlp
    plain = measure.measure(jax.jit(step), state, x, y)  # nothing donated, as below
    ref = jax.jit(step)(state, x, y)
    calls = count_compiles(monkeypatch)
    opt = jaxmem.optimize(step, donate_argnums=())  # the default, verify=True
    out = opt(state, x, y)
    first = len(calls)
    opt(state, x, y)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)
    plan = opt.plan(state, x, y)
    note = next(n for n in plan.notes if n.startswith("verify: "))
    n = int(re.search(r"compiled (\d+) candidate", note).group(1))
    plain_compiled = "plain step was not compiled" not in note
    assert len(calls) == first == n + plain_compiled, (len(calls), first, note)
    assert plan.compiled.peak < plain.peak, (plan.compiled, plain)


def test_verify_names_its_options_and_shares_plans_between_aliases():
    """A misspelt ``verify`` names every option; ``"predicted"`` (the default's earlier
    name) plans as ``True`` does and ``"background"`` ends as ``"builtins"`` does, so each
    pair shares a plan cache entry, and the three procedures do not."""
    with pytest.raises(ValueError, match="'builtins'.*'predicted'"):
        jaxmem.optimize(lambda x: x, verify="predict")
    key = {v: repr(Options(None, "auto", False, "auto", 0.05, v, True, False, {}).cache_key(()))
           for v in (True, "predicted", "builtins", "background", "all", False)}
    assert key[True] == key["predicted"] and key["builtins"] == key["background"]
    assert len({key[v] for v in (True, "builtins", "all", False)}) == 4


def test_the_steps_analysis_is_for_its_compiler_and_its_donation(mlp):
    """The analysis a plan is made from (whose cost model ranks the candidates, and whose
    plain-step prediction the default ``verify`` may check a plan against) predicts for the
    compiler the arguments are compiled by, with the step's donation: without it the plain
    peak is overstated by the state the step updates in place."""
    step, state, (x, y) = mlp
    donated = jaxmem.optimize(step, verify=False).analysis(state, x, y)
    undonated = jaxmem.optimize(step, donate_argnums=(), verify=False).analysis(state, x, y)
    assert donated.platform == undonated.platform == "cpu"
    assert donated.peak_bytes < undonated.peak_bytes
    h100 = jaxmem.targets.get("h100").place((state, x, y))
    on_gpu = jaxmem.optimize(step, verify=False).analysis(*h100)
    assert on_gpu.platform == jaxmem.targets.get("h100").platform
