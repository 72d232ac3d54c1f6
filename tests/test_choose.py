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
