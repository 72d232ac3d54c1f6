"""Run batches of generated steps through :func:`.check.check`.

Cases are packed ``pack_size`` to a step (one compile of plain jit and one ``optimize``
serve them all); strategy ``k`` of :data:`.check.STRATEGIES` is used for pack ``k``
(rotation), or every strategy for every pack with ``all_strategies=True``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

import jaxmem
from tests.difftest.check import STRATEGIES, Finding, check, pack, plain_peak, tolerance
from tests.difftest.generator import Case, generate


@dataclasses.dataclass
class Result:
    seeds: list[int]
    strategy: str
    findings: list[Finding]
    seconds: float


def run_pack(cases: Sequence[Case], strategies: Iterable[str], **kw) -> list[Result]:
    step, states, batches = pack(cases)
    args = (states, batches)
    t0 = time.perf_counter()
    target = kw.get("target")
    ref = plain_peak(step, args if target is None else jaxmem.targets.get(target).place(args))
    out = []
    kw.setdefault("fraction", (0.9, 1.0, 0.5)[cases[0].seed % 3])  # of the headroom
    for s in strategies:
        t = time.perf_counter()
        found = check(step, args, s, rtol=tolerance(cases), reference=ref, **kw)
        out.append(Result([c.seed for c in cases], s, found, time.perf_counter() - t
                          + (t - t0 if not out else 0.0)))
    return out


def run(seeds: Sequence[int], *, pack_size: int = 10, all_strategies: bool = False,
        strategies: Sequence[str] = STRATEGIES, max_ops: int = 4, **kw) -> list[Result]:
    results = []
    for k in range(0, len(seeds), pack_size):
        cases = [generate(s, max_ops=max_ops) for s in seeds[k:k + pack_size]]
        chosen = strategies if all_strategies else [strategies[(k // pack_size) % len(strategies)]]
        results.extend(run_pack(cases, chosen, **kw))
    return results
