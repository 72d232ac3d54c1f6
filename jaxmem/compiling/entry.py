"""The per-signature record the :class:`~jaxmem.optimized.Optimized` cache keeps.

Part of the fifth box (:mod:`jaxmem.compiling`). One :class:`Entry` per signature
(:mod:`.signature`): the analysis and plan the step was made from, the jitted step that runs
the plan and its executable, the plain step (the baseline), and what ``verify="background"``
swaps in once its verification is done (:mod:`.background`). :func:`placed` compiles the
same step again, the jaxmem way, for arguments the first executable rejects.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any

from jaxmem.analyzing.analysis import Analysis
from jaxmem.compiling.signature import placement
from jaxmem.planning.plan import Plan
from jaxmem.xla import measure


@dataclasses.dataclass
class Entry:
    """What one signature runs; mutable: the background verification swaps its plan."""

    analysis: Analysis
    plan: Plan
    jitted: Any
    donate_flat: tuple[int, ...]
    plain: Any  # jax.jit of the user's own step on flat inputs (same donation): the baseline
    compiled: Any = None
    static_out: Any = None  # the step's static (non-array) outputs: arguments.partition
    # Executables compiled (the jaxmem way) for arguments the first one rejects: other
    # committed devices or shardings, keyed by signature.placement.
    placed: dict[Any, Any] = dataclasses.field(default_factory=dict)
    host_state: tuple[int, ...] = ()  # flat argument positions kept in pinned_host memory
    # verify="background": the verification running beside the first calls; its result
    # (the verified plan, its jitted step and executable) replaces plan/jitted/compiled
    # at the start of the first call after it is done (background.adopt).
    # It starts once the first call's own executable is compiled and running (verify_later),
    # so that the two compiles do not share the cores.
    verify_later: Callable[[], Any] | None = None
    # the first plan's bar: the plain step's predicted peak less the model's error bound
    # (predicted.PLAIN_ERROR), as verify=True's predicted check (build.build sets it)
    first_plan_bar: int | None = None
    pending: concurrent.futures.Future | None = None
    calls: int = 0  # calls run so far (for the log line that says when a plan was adopted)
    # The plan cache key the plan is stored under (None: not cached): the figures the report
    # compiles later (Optimized.plan) are stored with it, so a hit's report compiles nothing.
    cache_key: str | None = None


def placed(entry: Entry, flat: list[Any], name: str) -> Callable[..., Any]:
    """The step of ``entry`` compiled (the jaxmem way, once per placement) for arguments
    on other committed devices or shardings than the first executable's; a clear error
    when that one rejects them too. ``name``: the step's name, for the error."""
    key = placement(flat)
    if key not in entry.placed:
        entry.placed[key] = measure.compile(entry.jitted.lower(*flat))
    exe = entry.placed[key]

    def call(*leaves: Any) -> Any:
        try:
            return exe(*leaves)
        except (TypeError, ValueError) as e:
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"jaxmem.optimize({name}): the step compiled for these arguments' devices "
                f"and shardings rejects them: {e}. Put the arguments on one device (or "
                "mesh) with jax.device_put before the call.") from e
    return call
