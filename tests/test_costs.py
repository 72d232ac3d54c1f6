"""A plan's predicted cost by mechanism (issue 38): recompute time, bytes over the host link,
and whether the compute around the copies hides them, in the plan's printout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem import targets
from jaxmem.analyzing.costmodel import CostModel, DeviceProfile
from jaxmem.planning import strategies
from jaxmem.planning.costs import step_costs
from tests.test_offload import _step


@pytest.fixture(scope="module")
def analysis():
    step, args = _step(tag=False)
    return jaxmem.analyze(step, *args)


def test_a_plan_that_keeps_everything_costs_nothing(analysis):
    c = step_costs(analysis, strategies.plan_none(analysis), "h100")
    assert (c.recompute_flops, c.recompute_s, c.offload_bytes, c.link_s, c.exposed_s) == (
        0.0, 0.0, 0, 0.0, 0.0)
    assert c.step_s > 0 and c.extra_s == 0.0 and c.profile == "h100"


def test_recompute_is_priced_as_the_planner_prices_it(analysis):
    plan = strategies.plan_auto(analysis)
    assert plan.recompute
    c = step_costs(analysis, plan, "cpu")
    ev = CostModel(analysis, "cpu").evaluate(plan.recompute, plan.offload)
    assert c.recompute_flops == ev.flops > 0
    assert c.recompute_s == pytest.approx(ev.time) and c.offload_bytes == 0
    assert "recompute" in c.describe() and "host link" not in c.describe()


def test_offload_is_priced_by_the_link_and_its_window(analysis):
    plan = strategies.plan_offload(analysis, strategies.plan_auto(analysis), offload=True)
    off = plan.of(jaxmem.Decision.OFFLOAD)
    assert off
    nbytes = sum(ch.residual.nbytes for ch in off)
    fast = DeviceProfile("fast link", 1e11, 2e10, host_bw=1e15, overlap=1.0)
    slow = DeviceProfile("slow link", 1e11, 2e10, host_bw=1e3, overlap=0.0)
    hidden, exposed = step_costs(analysis, plan, fast), step_costs(analysis, plan, slow)
    assert hidden.offload_bytes == exposed.offload_bytes == nbytes
    assert exposed.link_s == pytest.approx(2 * nbytes / 1e3)
    assert hidden.exposed_s == 0.0 and "hidden under compute" in hidden.describe()
    assert exposed.exposed_s > 0 and "not hidden" in exposed.describe()
    assert exposed.extra_s == pytest.approx(exposed.recompute_s + exposed.exposed_s)


def test_the_plan_printout_says_what_each_mechanism_costs():
    step, args = _step(tag=True)  # three offload_name tags: offloaded whatever the budget
    plan = jaxmem.optimize(step, donate_argnums=()).plan(*args)
    assert plan.costs is not None and plan.costs.profile == jax.default_backend()
    assert plan.costs.offload_bytes == sum(
        c.residual.nbytes for c in plan.of(jaxmem.Decision.OFFLOAD))
    text = str(plan)
    assert "predicted cost (cpu)" in text and "host link" in text


def test_a_step_with_scan_body_policies_says_their_cost_is_left_out(analysis):
    """The scanned layers' body policy is not a plan of the outer step: its recompute and
    offload are not in the figures, and the printout says so."""
    plan = strategies.plan_auto(analysis)
    assert "not included" not in step_costs(analysis, plan, "cpu").describe()
    assert "body policy's cost is not included" in step_costs(
        analysis, plan, "cpu", scan_bodies=True).describe()


def test_a_scan_body_choice_prices_its_recompute_and_host_link():
    """The budget's scan-body policy (``BodyChoice``) says what it costs: FLOPs above the
    candidate with the fewest, its host bytes' round trip, and whether the step's compute
    covers it, on the profile named."""
    from jaxmem.compiling.scan_budget import BodyCandidate, BodyChoice
    from jaxmem.rewriting.scans import BodyPolicy

    h100 = DeviceProfile.get("h100")
    least = BodyCandidate(BodyPolicy("everything"), flops=1e15, kept_bytes=10 << 30)
    off = BodyCandidate(BodyPolicy("full+input offloaded"), flops=1.3e15, kept_bytes=1 << 30,
                        host_bytes=4 << 30)
    line = BodyChoice(off, (least, off), budget=2 << 30, fits=True).cost("h100")
    assert "recompute 300000.0 GFLOP" in line and "host link 4.00 GiB each way" in line
    link, compute = 2 * h100.transfer_time(4 << 30), 1.3e15 / h100.flops_per_s
    assert ("below the step's compute" in line) == (link <= compute)
    slow = dataclasses.replace(off, flops=1.0e14, host_bytes=64 << 30)
    assert "cannot all hide" in BodyChoice(slow, (slow,), 1, True).cost(h100)
    # the note carries the line only where the step's profile is known
    assert len(BodyChoice(off, (least, off), 1, True).notes) == 2
    assert BodyChoice(off, (least, off), 1, True, profile="h100").notes[-1] == line


def test_the_scan_body_budget_choice_weighs_the_host_link():
    """With the step's profile the body search orders candidates by predicted time: one
    with the fewest FLOPs whose parked bytes' round trip outlasts the compute loses to one
    that recomputes more and hides its transfers; without a profile, FLOPs decide."""
    from jaxmem.compiling.scan_budget import BodyCandidate, choose
    from jaxmem.rewriting.scans import BodyPolicy
    from jaxmem.xla.measure import Figures

    h100 = DeviceProfile.get("h100")
    flops = 1e15  # about 1 s on the profile
    parked = BodyCandidate(BodyPolicy("offload all"), flops, kept_bytes=1 << 30,
                           host_bytes=int(2 * h100.host_bw))  # a 4 s round trip
    hidden = BodyCandidate(BodyPolicy("input offloaded"), 1.2 * flops, kept_bytes=1 << 30,
                           host_bytes=1 << 30)
    everything = BodyCandidate(BodyPolicy("everything"), 0.9 * flops, kept_bytes=100 << 30)

    def compile_with(policy):  # what fits is what keeps little on the device
        kept = {c.policy.name: c.kept_bytes for c in (parked, hidden, everything)}
        return Figures(argument=0, output=0, temp=kept[policy.name], alias=0)

    cands = [parked, hidden, everything]
    assert hidden.seconds(h100) < parked.seconds(h100)
    by_time = choose(cands, compile_with, budget=2 << 30, profile="h100")
    assert by_time.fits and by_time.policy.name == "input offloaded"
    assert "least predicted time (h100)" in by_time.notes[0]
    assert "below the step's compute" in by_time.notes[-1]
    by_flops = choose(cands, compile_with, budget=2 << 30)
    assert by_flops.policy.name == "offload all" and "fewest FLOPs" in by_flops.notes[0]


def test_the_scan_body_search_predicted_from_the_plain_step_chooses_as_the_bisection():
    """``choose(..., plain_peak=...)`` (issue 37: rank by prediction, compile to check)
    compiles the candidate predicted to fit first and settles the choice around it: on
    candidates whose peaks are their kept bytes plus a term that varies by a few MiB (as
    the zoo's scanned GPT compiled, docs/plan_cache.md), it picks what the bisection picks at
    every budget, fits or not, with fewer compiles in all."""
    from jaxmem.compiling.scan_budget import BodyCandidate, choose
    from jaxmem.rewriting.scans import BodyPolicy
    from jaxmem.xla.measure import Figures

    mib = 1 << 20
    kept = [k * 10 * mib for k in range(1, 13)]  # 10 .. 120 MiB
    wobble = [3, -2, 4, 0, -4, 1, 2, -3, 0, 4, -1, 2]  # MiB, peaks still rising with kept
    peaks = {f"p{i}": k + (30 + w) * mib for i, (k, w) in enumerate(zip(kept, wobble,
                                                                         strict=True))}
    cands = [BodyCandidate(BodyPolicy(f"p{i}"), flops=1e12 * (20 - i), kept_bytes=k)
             for i, k in enumerate(kept)]
    plain = max(kept) + 32 * mib  # the step with nothing re-run keeps at least the most

    def run(budget, **kw):
        calls = []

        def compile_with(policy):
            calls.append(policy.name)
            return Figures(argument=0, output=0, temp=peaks[policy.name], alias=0)
        return choose(cands, compile_with, budget, **kw), len(calls)

    total = {"bisection": 0, "predicted": 0}
    for budget in range(35 * mib, 160 * mib, 7 * mib):
        a, n_a = run(budget)
        b, n_b = run(budget, plain_peak=plain)
        assert (b.policy.name, b.fits) == (a.policy.name, a.fits), budget / mib
        total["bisection"] += n_a
        total["predicted"] += n_b
    assert total["predicted"] < total["bisection"], total


def test_the_budget_search_weighs_on_the_target_it_compiles_for():
    """A step compiled for the H100 target on a CPU machine is planned on the H100 profile
    (it said "(profile cpu)" and ordered its candidates by CPU speeds), unless the Budget
    names a profile."""
    from jaxmem.compiling.plan_step import _budget_profile
    from jaxmem.planning.budget import Budget

    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    h100 = targets.require("h100").place([x])
    assert _budget_profile(0.5, h100) == "h100"
    assert _budget_profile(Budget(0.5, profile="h200"), h100) == "h200"
    assert _budget_profile(0.5, [jnp.zeros(8)]) == "cpu"
