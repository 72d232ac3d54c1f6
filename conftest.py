"""Repository-wide pytest set-up (tests, and the doctests of jaxmem/ and benchmarks/zoo/)."""

from __future__ import annotations

import pytest

#: Docstring examples known to fail, by node id, each with why. They are marked
#: ``xfail(strict=True)``: listed in the summary, and the run fails as soon as one passes,
#: so that its line here goes with the fix.
KNOWN_DOCTEST_FAILURES: dict[str, str] = {
    "jaxmem/analysis.py::jaxmem.analysis.analyze": (
        "the example expects residual activations ['tanh'], analyze now also reports the "
        "'sub' and 'mul' of tanh's derivative; analysis.py is being restructured (issue 18), "
        "so the fix belongs there"
    ),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        reason = KNOWN_DOCTEST_FAILURES.get(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
