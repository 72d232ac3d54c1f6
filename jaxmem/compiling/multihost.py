"""One plan on every process: the plan fingerprint checked across a ``jax.distributed`` job.

Part of the last box of the data flow (the entry point, :mod:`jaxmem.optimized`). Every
process of a multi-host job compiles the step for itself, and the compiled programs must
be the same, or the job deadlocks or crashes inside a collective. jaxmem's plans are a pure
function of the traced program, the target and the options (the budget search is bounded by
work, never by time), so they agree; this module checks it. After planning, each process
gathers every process's :meth:`~jaxmem.planning.plan.Plan.fingerprint` (one small all-gather) and,
if they differ, every process raises :class:`PlanMismatchError` naming the processes, before
any planned program runs: a clear error, never a hang.

Example:
  >>> import jax, jax.numpy as jnp, jaxmem
  >>> step = jax.value_and_grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
  >>> plan = jaxmem.optimize(step, verify=False).plan(jnp.ones((8, 8)), jnp.ones((4, 8)))
  >>> check_same_plan(plan)  # one process: nothing to compare
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jaxmem import _jax

__all__ = ["PlanMismatchError", "check_same_plan", "gather_fingerprints"]


class PlanMismatchError(RuntimeError):
    """The processes of a ``jax.distributed`` job planned a step differently.

    Attributes:
      fingerprints: each process's plan fingerprint (hex), by process index.
    """

    def __init__(self, message: str, fingerprints: list[str]) -> None:
        super().__init__(message)
        self.fingerprints = fingerprints


def gather_fingerprints(fingerprint: str) -> list[str]:
    """Every process's ``fingerprint`` (a hex digest), by process index: an all-gather
    every process must call (they all do, at the same point of planning)."""
    if jax.process_count() == 1:
        return [fingerprint]
    from jax.experimental import multihost_utils

    mine = np.frombuffer(bytes.fromhex(fingerprint), dtype=np.uint8).astype(np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine))
    every = every.reshape(jax.process_count(), -1)
    return [bytes(row.astype(np.uint8).tolist()).hex() for row in every]


def check_same_plan(plan: Any, what: str = "the step") -> None:
    """Raise :class:`PlanMismatchError` on every process if the processes of this job did
    not all choose ``plan``'s fingerprint; nothing on a single process, or with
    ``JAXMEM_CHECK_PLANS=0`` (for a step that only some processes plan: the check is a
    collective every process must join)."""
    if jax.process_count() == 1 or os.environ.get("JAXMEM_CHECK_PLANS", "1") == "0":
        return
    if _jax.tracing():  # a body planned while the outer step is traced: the outer plan's
        return          # fingerprint covers it (Plan.inner), checked once tracing is done
    mine = plan.fingerprint()
    every = gather_fingerprints(mine)
    if len(set(every)) == 1:
        return
    groups: dict[str, list[int]] = {}
    for i, f in enumerate(every):
        groups.setdefault(f, []).append(i)
    listing = "; ".join(f"processes {ps}: {f[:12]}" for f, ps in groups.items())
    raise PlanMismatchError(
        f"jaxmem.optimize: the processes of this jax.distributed job planned {what} "
        f"differently ({listing}; this is process {jax.process_index()}), so they would "
        "compile different programs and hang or crash in a collective. Plans depend only "
        "on the traced program, the target and the options: check that every process "
        "runs the same code and jaxmem/JAX versions with the same arguments (shapes, "
        "dtypes, shardings) and options, and that no process reads a stale plan cache "
        "(jaxmem.plan_cache).", every)
