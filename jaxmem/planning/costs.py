"""What a plan's mechanisms cost in step time, predicted: recompute and the host link.

Part of the third box (``Analysis -> Plan``). A plan trades memory for time through two
mechanisms, re-creating values in the backward pass (FLOPs) and parking them in host memory
(bytes over the host link, each twice). :func:`step_costs` prices both on a device profile
(:class:`~jaxmem.analyzing.costmodel.DeviceProfile`) with the cost model the planner uses
(:class:`~jaxmem.analyzing.costmodel.CostModel`): each re-created node at its roofline time,
each round trip at the link's bandwidth, and the part of those round trips that the compute
around them cannot hide (the prefetch's window). The plan's printout shows the result
(``Plan.costs``), so a user reads what each ingredient of the plan is predicted to cost
before running it. Predictions, not measurements: ``benchmarks/gpu_check.py`` measures the
step time on a device.

Example:
  >>> import jax, jax.numpy as jnp, jaxmem
  >>> from jaxmem.planning.strategies import plan_auto
  >>> def step(w, x):
  ...     return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)))(w)
  >>> a = jaxmem.analyze(step, jnp.ones((64, 64)), jnp.ones((32, 64)))
  >>> costs = step_costs(a, plan_auto(a), "h100")
  >>> costs.profile, costs.offload_bytes
  ('h100', 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.costmodel import CostModel, DeviceProfile
from jaxmem.xla.measure import fmt_bytes

__all__ = ["StepCosts", "fmt_seconds", "step_costs"]


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """A plan's predicted extra step time, by mechanism, on one device profile.

    Attributes:
      profile: the profile's name (``"h100"``, ``"cpu"``...).
      step_s: the step's own predicted compute time (every node at its roofline time).
      recompute_flops: the FLOPs the plan re-creates in the backward pass.
      recompute_s: their time.
      offload_bytes: bytes the plan parks in host memory (each crosses the link twice).
      link_s: the round trips' time over the host link (``2 x bytes / host_bw``).
      exposed_s: the part of ``link_s`` the compute around the copies cannot hide.
      scan_bodies: the step scans layers whose bodies run under a checkpoint policy of
        their own (:mod:`jaxmem.rewriting.scans`): what that policy recomputes and offloads
        is not in these figures (the plan's notes name the policy).
    """

    profile: str
    step_s: float
    recompute_flops: float
    recompute_s: float
    offload_bytes: int
    link_s: float
    exposed_s: float
    scan_bodies: bool = False

    @property
    def extra_s(self) -> float:
        """Predicted extra step time: recompute plus the exposed transfers."""
        return self.recompute_s + self.exposed_s

    def describe(self) -> str:
        """One line for the plan's printout."""
        share = self.extra_s / self.step_s if self.step_s else 0.0
        line = (f"predicted cost ({self.profile}): {fmt_seconds(self.extra_s)} more per step "
                f"({100 * share:.1f}% of its {fmt_seconds(self.step_s)}); recompute "
                f"{_fmt_flops(self.recompute_flops)}, {fmt_seconds(self.recompute_s)}")
        if self.offload_bytes:
            hidden = ("hidden under compute" if self.exposed_s <= 0.0 else
                      f"{fmt_seconds(self.exposed_s)} of it not hidden")
            line += (f"; host link {fmt_bytes(self.offload_bytes)} each way, round trip "
                     f"{fmt_seconds(self.link_s)}, {hidden}")
        if self.scan_bodies:
            line += " (outside the scanned layers: their body policy's cost is not included)"
        return line


def _fmt_flops(n: float) -> str:
    return f"{n / 1e9:.4f} GFLOP" if n >= 1e8 else f"{n / 1e6:.3f} MFLOP"


def fmt_seconds(s: float) -> str:
    """``s`` seconds in the unit that reads best.

    Example:
      >>> fmt_seconds(2.5), fmt_seconds(0.0123), fmt_seconds(4.2e-6), fmt_seconds(0.0)
      ('2.50 s', '12.300 ms', '4.20 us', '0 s')
    """
    if s == 0:
        return "0 s"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{1e3 * s:.3f} ms"
    return f"{1e6 * s:.2f} us"


def step_costs(analysis: Analysis, plan: Any, profile: DeviceProfile | str | None = None,
               *, scan_bodies: bool = False) -> StepCosts:
    """The predicted costs of ``plan`` (a :class:`~jaxmem.planning.plan.Plan`) on
    ``analysis``'s step with ``profile`` (a preset name, a profile, or None: the device);
    ``scan_bodies``: see :attr:`StepCosts.scan_bodies`."""
    from jaxmem.planning.lower_peaks import block_model

    model = block_model(CostModel(analysis, profile), plan)
    ev = model.evaluate(plan.recompute, plan.offload)
    link = sum(2 * model.profile.transfer_time(model.bytes.get(v) or
                                               model.program.values[v].nbytes)
               for v in plan.offload)
    exposed = model.transfer(plan.offload, plan.region_depth)
    return StepCosts(profile=model.profile.name, step_s=model.step_time,
                     recompute_flops=ev.flops, recompute_s=max(ev.time - ev.transfer_time, 0.0),
                     offload_bytes=ev.offload_bytes, link_s=link, exposed_s=exposed,
                     scan_bodies=scan_bodies)
