"""The options of one ``jaxmem.optimize``: checked when it is called, recorded for planning.

Part of the fifth box (:mod:`jaxmem.compiling`). :func:`check` rejects a bad option at the
``optimize`` call, each with what to pass instead (an option that slipped through used to be
ignored, or to fail on the first call). :class:`Options` is what the planning functions of
this folder read (the :class:`~jaxmem.optimized.Optimized` facade keeps the same values as
public attributes and makes one of these for each new signature), and
:meth:`Options.cache_key` the part of the plan cache's key the options give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxmem.memory import state_offload
from jaxmem.planning.budget import parse_budget

STRATEGIES = ("auto", "none")
VERIFY = (True, False, "background", "all", "predicted", "builtins")


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of one ``optimize`` (static arguments aside: they shape the signature)."""

    budget: Any
    strategy: str
    offload: bool | str
    donate_argnums: int | Sequence[int] | str | None
    max_recompute_fraction: float
    verify: bool | str
    remat_scans: bool | Callable[..., Any]
    offload_state: Any
    jit_kwargs: dict[str, Any]

    def cache_key(self, donate_flat: tuple[int, ...]) -> tuple[Any, ...]:
        """What changes the plan besides the program and target: the plan cache's key."""
        # verify="background" ends with the plan verify="builtins" makes, and "predicted"
        # is True's earlier name: one cache entry for each pair
        verify = (False if self.verify is False else "all" if self.verify == "all"
                  else "builtins" if self.verify in ("builtins", "background") else "ranked")
        return (self.budget, self.strategy, self.offload, self.max_recompute_fraction,
                verify, self.remat_scans, donate_flat,
                sorted(self.jit_kwargs.items()))


def check(*, budget: Any, strategy: Any, offload: Any, donate_argnums: Any,
          max_recompute_fraction: Any, verify: Any, offload_state: Any,
          jit_kwargs: dict[str, Any]) -> None:
    """Reject bad options when ``optimize`` is called, each with what to pass instead."""
    if not (callable(offload_state) or offload_state in state_offload.MODES):
        raise ValueError(f"offload_state must be True, False, 'opt', 'auto', 'all' or a "
                         f"predicate (path, leaf) -> bool, got {offload_state!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not any(verify is v or (isinstance(v, str) and verify == v) for v in VERIFY):
        raise ValueError(f"verify must be True, False, 'builtins', 'all', 'background' or "
                         f"'predicted' (True's earlier name), got {verify!r}")
    _check_values(budget, offload, donate_argnums, max_recompute_fraction)
    unknown = set(jit_kwargs) - {"keep_unused", "inline"}
    if unknown:
        raise TypeError(f"optimize got unsupported jit arguments {sorted(unknown)}; "
                        "shardings follow the arguments' own shardings")


def _check_values(budget: Any, offload: Any, donate_argnums: Any,
                  max_recompute_fraction: Any) -> None:
    """The budget, offload, donation and FLOP-cap options' values."""
    if budget is not None:
        parse_budget(budget)
    if not (isinstance(offload, bool | np.bool_) or offload == "auto"):
        raise ValueError(f"offload must be True, False or 'auto', got {offload!r} "
                         f"({type(offload).__name__})")
    d = donate_argnums
    ints = (isinstance(d, int | np.integer) and not isinstance(d, bool)) or (
        isinstance(d, Sequence) and not isinstance(d, str)
        and all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in d))
    if not (d is None or d == "auto" or ints):
        raise ValueError(
            f"donate_argnums must be 'auto', None, an int or a sequence of ints (positions of "
            f"the arguments to donate), got {d!r}; to donate every argument pass "
            "tuple(range(n_args))")
    f = max_recompute_fraction
    if isinstance(f, bool) or not isinstance(f, int | float | np.number) or not 0 <= f < np.inf:
        raise ValueError(f"max_recompute_fraction must be a number >= 0 (a fraction of the "
                         f"step's FLOPs), got {f!r}")
