"""``benchmarks.maxbatch.search``: the batch search behind the README's max-batch tables.

The search compiles one program per batch it tries, so it is tested here on synthetic peak
curves (no compiles): the batch it returns fits, the next one it names does not, the gap is
within the stated resolution, and it never calls a batch twice.
"""

from __future__ import annotations

import pytest

from benchmarks.maxbatch import markdown, search


def _counting(peak_of):
    calls: list[int] = []

    def f(b: int) -> int:
        calls.append(b)
        return peak_of(b)
    return f, calls


@pytest.mark.parametrize("fixed,per_sample,start,tol", [
    (55_000_000, 86_000, 512, 0.125),    # the MLP's shape: a large fixed part
    (2_600_000, 1_250_000, 32, 0.125),   # a CNN: nearly all activations
    (0, 33_000_000, 4, 1 / 16),          # a decoder at a small batch
    (1_000, 1_000, 8, 0.01),             # fine resolution
])
def test_linear_peaks_give_the_largest_fitting_batch_within_the_resolution(
        fixed, per_sample, start, tol):
    def peak(b: int) -> int:
        return fixed + per_sample * b

    budget = peak(start) * 3 + per_sample // 2  # the answer is about 3x start, not a round one
    truth = (budget - fixed) // per_sample
    f, calls = _counting(peak)
    s = search(f, budget, start, tol=tol)
    assert peak(s.batch) <= budget
    assert s.too_big is not None and peak(s.too_big) > budget
    assert s.too_big - s.batch <= max(1, int(tol * s.batch))
    assert s.batch <= truth < s.too_big
    assert len(calls) == len(set(calls)) == s.compiles == len(s.trail)
    assert s.peak == peak(s.batch)


def test_a_start_that_does_not_fit_searches_down():
    def peak(b: int) -> int:
        return 10 * b

    s = search(peak, budget=45, start=16, tol=0.0)
    assert (s.batch, s.too_big) == (4, 5)


def test_nothing_fits_gives_batch_zero():
    s = search(lambda b: 100 + b, budget=50, start=8)
    assert s.batch == 0 and s.too_big == 1


def test_the_cap_bounds_the_search():
    s = search(lambda b: b, budget=10**9, start=4, cap=8)
    assert s.batch == 32 and s.too_big is None


def test_known_peaks_are_not_measured_again():
    def peak(b: int) -> int:
        return 10 * b

    f, calls = _counting(peak)
    s = search(f, budget=205, start=8, tol=0.0, known={8: 80, 16: 160})
    assert (s.batch, s.too_big) == (20, 21)
    assert 8 not in calls and 16 not in calls


def test_markdown_names_the_better_builtin_and_the_ratios():
    def row(model, plain, builtin, jm, policy="nothing_saveable"):
        def s(variant, batch, pol=None):
            return {"variant": variant, "batch": batch, "peak": 1, "too_big": batch + 1,
                    "compiles": 2, "seconds": 1.0, "policy": pol, "trail": []}
        return {"model": model, "size": "bench", "start_batch": plain, "budget": 2**20,
                "plain": s("plain", plain), "builtin": s("builtin", builtin, policy),
                "builtin_all": {}, "jaxmem": s("jaxmem", jm)}

    table = markdown([row("transformer", 4, 18, 19)])
    line = next(x for x in table.splitlines() if x.startswith("| transformer"))
    assert "18 (nothing_saveable)" in line and "| 19 |" in line
    assert "4.75x" in line and "1.06x" in line
