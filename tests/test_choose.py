"""The choice among compiled candidates (jaxmem.compiling.choose), on synthetic figures."""

from __future__ import annotations

from types import SimpleNamespace

from jaxmem.compiling.choose import Candidate, Compiled, within_cap
from jaxmem.xla.measure import Figures


def _fig(peak: int, flops: float, source: str = "xla") -> Figures:
    return Figures(argument=peak, output=0, temp=0, alias=0, flops=flops,
                   flops_source=source)


def _cand(name: str, fig: Figures) -> Compiled:
    return Compiled(Candidate(SimpleNamespace(strategy=name), None, None), fig, None, None)


def test_the_flop_cap_holds_on_the_compilers_count():
    base = _fig(100, 1000.0)
    cands = [_cand("a", _fig(60, 1057.0)), _cand("b", _fig(70, 1049.0)),
             _cand("c", _fig(80, 1000.0))]
    kept, notes = within_cap(cands, base, 0.05)
    assert [c.candidate.plan.strategy for c in kept] == ["b", "c"]
    assert len(notes) == 1 and notes[0].startswith("a not kept: +5.70% FLOPs")


def test_jaxmems_own_count_is_what_the_planner_capped_already():
    base = _fig(100, 1000.0, "jaxmem")
    cands = [_cand("a", _fig(60, 1100.0, "jaxmem"))]
    assert within_cap(cands, base, 0.05) == (cands, ())


class _Model:
    """A cost model whose predicted peak of a plan is its ``recompute`` field."""

    def __init__(self, analysis):
        pass

    def evaluate(self, drop, off):
        return SimpleNamespace(peak=drop)


def _plan(name: str, predicted: int):
    return SimpleNamespace(strategy=name, recompute=predicted, offload=())


def _ranked_run(monkeypatch, compiled_peaks: dict[str, int], verify=True,
                rewritten: dict[str, int] | None = None):
    """``choose.verified`` over five candidate plans (predicted peaks 50, 10, 40, 20, 30)
    with synthetic compiled figures (the plain step: 100) and the rewritten steps' predicted
    peaks (``rewritten``; none traced where not given): what it compiled, in what batches,
    and what it kept."""
    from jaxmem.compiling import choose

    cands = [Candidate(_plan(n, p), None, None)
             for n, p in zip("abcde", (50, 10, 40, 20, 30), strict=True)]
    batches: list[list[str]] = []

    def compiled(cs):
        batches.append([c.plan.strategy for c in cs])
        return [Compiled(c, _fig(compiled_peaks[c.plan.strategy], 1000.0), None, None)
                for c in cs]

    monkeypatch.setattr(choose, "CostModel", _Model)
    monkeypatch.setattr(choose, "rewrite_candidates", lambda *a: list(cands))
    monkeypatch.setattr(choose, "builtin_candidates", lambda *a: ([], ()))
    monkeypatch.setattr(choose, "compile_candidates", lambda step, cs: (
        Compiled(None, _fig(100, 1000.0), None, None), compiled(cs)))
    monkeypatch.setattr(choose, "compile_more", lambda step, cs: compiled(cs))
    monkeypatch.setattr(choose, "_kept", lambda best, base, tried, skipped, step: (
        "kept", best.candidate.plan.strategy, list(tried), skipped))
    monkeypatch.setattr(choose, "_plain_kept", lambda plan, analysis, best, base, skipped: (
        "plain", best and best.peak, skipped))
    monkeypatch.setattr(choose, "_hinted", lambda chosen, analysis, cap: chosen)
    monkeypatch.setattr(choose, "rewritten_peak", lambda c, step, platform: (
        (rewritten or {}).get(c.plan.strategy)))
    options = SimpleNamespace(verify=verify, max_recompute_fraction=0.05)
    return batches, choose.verified(SimpleNamespace(donated=(0,)),
                                    SimpleNamespace(platform="cpu"), None, options)


def test_only_the_best_predicted_plans_are_compiled_when_one_is_below_plain(monkeypatch):
    peaks = dict(a=60, b=90, c=70, d=80, e=85)
    batches, (kind, best, tried, skipped) = _ranked_run(monkeypatch, peaks)
    assert batches == [["b", "d", "e"]]  # the three lowest predictions, in their order
    assert (kind, best, tried) == ("kept", "d", ["b", "d", "e"])
    assert skipped[-1].startswith("compiled 3 of 5 candidate plans") and "a, c" in skipped[-1]


def test_the_rewritten_steps_best_is_compiled_with_the_models_three(monkeypatch):
    """The cost model ranks drop sets; the rewritten step's liveness sees how a plan groups
    its re-creation. Its lowest ("a", the model's worst) joins the first compiles."""
    peaks = dict(a=60, b=90, c=70, d=80, e=85)
    rewritten = dict(a=50, b=70, c=60, d=65, e=80)
    batches, (kind, best, tried, skipped) = _ranked_run(monkeypatch, peaks,
                                                        rewritten=rewritten)
    assert batches == [["b", "d", "e", "a"]] and (kind, best) == ("kept", "a")
    assert skipped[-1].startswith("compiled 4 of 5 candidate plans") and "not compiled: c" \
        in skipped[-1]
    # already among the model's three: nothing added
    batches, _ = _ranked_run(monkeypatch, peaks, rewritten=dict(rewritten, d=10))
    assert batches == [["b", "d", "e"]]


def test_the_rest_are_compiled_when_none_of_the_first_is_below_plain(monkeypatch):
    peaks = dict(a=60, b=100, c=70, d=120, e=101)
    batches, (kind, best, tried, skipped) = _ranked_run(monkeypatch, peaks)
    assert batches == [["b", "d", "e"], ["a", "c"]]
    assert (kind, best, tried) == ("kept", "a", ["b", "d", "e", "a", "c"])
    assert not any("not compiled" in s for s in skipped)


def test_verify_all_compiles_every_candidate_at_once(monkeypatch):
    peaks = dict(a=60, b=90, c=70, d=80, e=85)
    batches, (kind, best, _, _) = _ranked_run(monkeypatch, peaks, verify="all")
    assert batches == [list("abcde")] and best == "a"


def test_nothing_below_plain_keeps_plain_after_every_candidate(monkeypatch):
    peaks = dict(a=100, b=100, c=130, d=120, e=101)
    batches, (kind, best, _) = _ranked_run(monkeypatch, peaks)
    assert len(batches) == 2 and kind == "plain" and best == 100


def test_plans_tied_with_the_last_of_the_best_predicted_are_compiled_too(monkeypatch):
    """The model cannot tell two groupings of one drop set apart: a tie goes to the
    compiler, not to the candidates' order."""
    from jaxmem.compiling import choose

    monkeypatch.setattr(choose, "CostModel", _Model)
    cands = [Candidate(_plan(n, p), None, None)
             for n, p in zip("abcdef", (10, 20, 20, 30, 20, 40), strict=True)]
    first, rest = choose.ranked(cands, None)
    assert [c.plan.strategy for c in first] == ["a", "b", "c", "e"]
    assert [c.plan.strategy for c in rest] == ["d", "f"]
