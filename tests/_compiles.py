"""Counting jaxmem's compiles in a test (every candidate, the plain step, the checked plan)."""

from __future__ import annotations

from jaxmem import measure


def count_compiles(monkeypatch) -> list[int]:
    """A list that grows by one at each ``jaxmem.measure.compile`` call from now on."""
    calls: list[int] = []
    real = measure.compile

    def counting(lowered, options=None):
        calls.append(1)
        return real(lowered, options)

    monkeypatch.setattr(measure, "compile", counting)
    return calls
