"""Shrink a failing generated program to a minimal one (Zeller's ddmin over its ops).

A :class:`~.generator.Case` is a list of ops, each ``(B, D) -> (B, D)``, so every sub-list is
a valid program. :func:`ddmin` finds a 1-minimal sub-list that still fails: removing any one
op makes the failure go away. :func:`shrink_pack` first finds the case of a failing pack
that fails alone, then shrinks it; print the result and paste it into
:data:`tests.difftest.regressions.CASES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from tests.difftest.check import check, pack, tolerance
from tests.difftest.generator import Case, generate

T = TypeVar("T")


def ddmin(items: Sequence[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """A 1-minimal sub-list of ``items`` for which ``fails`` holds (``fails(items)`` must).

    Example:
      >>> ddmin(list(range(10)), lambda xs: 3 in xs and 7 in xs)
      [3, 7]
    """
    items = list(items)
    n = 2
    while len(items) >= 2:
        size = max(1, len(items) // n)
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        for i, chunk in enumerate(chunks):
            if fails(chunk):                      # a chunk alone fails
                items, n = chunk, 2
                break
            rest = [x for j, c in enumerate(chunks) if j != i for x in c]
            if fails(rest):                       # the complement fails
                items, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


def case_fails(case: Case, strategy: str, **kw) -> bool:
    step, states, batches = pack([case])
    return bool(check(step, (states, batches), strategy, rtol=tolerance([case]), **kw))


def shrink_case(case: Case, strategy: str, **kw) -> Case:
    """The smallest case (fewest ops, then simplest update and loss) that still fails."""
    ops = ddmin(case.ops, lambda ops: case_fails(case.replace(ops=tuple(ops)), strategy, **kw))
    case = case.replace(ops=tuple(ops))
    for simpler in ({"update": "sgd"}, {"loss": "mse"}):
        c = case.replace(**simpler)
        if c != case and case_fails(c, strategy, **kw):
            case = c
    return case


def shrink_pack(seeds: Sequence[int], strategy: str, max_ops: int = 6, **kw) -> Case | None:
    """The shrunk case of the first seed of a failing pack that fails alone (None: the
    failure needs several cases together; shrink the pack by hand)."""
    for s in seeds:
        case = generate(s, max_ops=max_ops)
        if case_fails(case, strategy, **kw):
            return shrink_case(case, strategy, **kw)
    return None
