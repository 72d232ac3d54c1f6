"""Many devices and many hosts (issue 17): shard_map steps, sharded jitted steps (2-D and FSDP
meshes) on 8 host devices, and two ``jax.distributed`` processes on localhost that must plan
alike (and fail loudly when they do not)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._fast_compile import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(mode: str, timeout: float = 150.0) -> list[dict]:
    """Run tests/_distributed_worker.py as processes 0 and 1 of one job; their results.
    Both are killed at ``timeout`` seconds: a hang fails the test, never CI."""
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "_distributed_worker.py"),
                               str(i), port, mode], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the two jax.distributed processes ({mode}) did not finish in "
                    f"{timeout:.0f} s")
    results = []
    for rc, out, err in outs:
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        assert rc == 0 and lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


@pytest.fixture(scope="module")
def job() -> list[dict]:
    return _two_processes("mismatch")


def test_two_processes_plan_alike_and_match_jit(job):
    """Two processes (2 CPU devices each, gloo collectives), a batch-sharded step under
    optimize with and without a budget: the same loss as plain jit on both, the same plan
    fingerprint on both."""
    a, b = job
    assert a["devices"] == b["devices"] == 4
    for name in ("auto", "budget"):
        assert a[name]["fingerprint"] == b[name]["fingerprint"], (a, b)
        assert a[name]["loss"] == b[name]["loss"]
        assert abs(a[name]["loss"] - a["ref"]) <= 1e-6 * abs(a["ref"]) + 1e-7
    assert a["auto"]["recompute"] > 0


def test_two_processes_that_plan_differently_fail_loudly(job):
    """Process 1 plans differently: both processes raise PlanMismatchError naming the
    fingerprints, before any planned program runs (no hang)."""
    for r in job:
        err = r["mismatch"]["error"] or ""
        assert "planned" in err and "differently" in err, r
        assert len(set(r["mismatch"]["fingerprints"])) == 2


_EIGHT = r"""
import warnings
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jaxmem
from benchmarks import distributed as D

assert jax.device_count() == 8
rows = []
for name, (step, ws, x) in D.cases("small").items():
    if name == "jit batch":  # tests/test_optimize.py has it
        continue
    opt = jaxmem.optimize(step, donate_argnums=())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "kept the plain step" / "no backward pass"
        out = opt(ws, x)
    ref = jax.jit(step)(ws, x)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (name, a.sharding, b.sharding)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=1e-6)
    plan = opt.plan(ws, x)
    assert plan.compiled.peak < plan.baseline.peak, (name, str(plan))
    if name.startswith("shard_map"):
        body = plan.inner[0]
        assert body.strategy.startswith("shard_map body") and body.recompute, (name, str(body))
    if name == "shard_map FSDP":  # FSDP's trade-off: re-gathering beat keeping the weights
        assert body.strategy.endswith("re-gather"), str(body)
        assert any(c.residual.primitive == "all_gather" for c in body.of(jaxmem.Decision.RECOMPUTE))
        from jaxmem import _jax
        from jaxmem.compiling import shard_map as S
        from jaxmem.planning import strategies
        eqn = next(e for e in jax.make_jaxpr(step)(ws, x).jaxpr.eqns
                   if S.has_backward_body(e))
        body_an = jaxmem.analyzing.analysis.from_program(jaxmem.program.from_jaxpr(
            _jax.closed_jaxpr(eqn.params["jaxpr"])))
        auto = strategies.plan_auto(body_an)
        fast = jaxmem.DeviceProfile("fast", 1e11, 2e10, 1e10, interconnect_bw=1e15)
        slow = jaxmem.DeviceProfile("slow", 1e11, 2e10, 1e10, interconnect_bw=1.0)
        assert S.regather(body_an, auto, fast, 0.05) is not None
        assert S.regather(body_an, auto, slow, 0.05) is None  # communication too dear
    rows.append((name, plan.baseline.peak, plan.compiled.peak))

# Explicit mesh axes: sizes in the analysis are per device (the batch is split 8 ways).
ws, x = D.arrays("small")
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
xs = jax.device_put(x, NamedSharding(mesh, P("data")))
wr = jax.device_put(ws, NamedSharding(mesh, P()))
a = jaxmem.optimize(D.jit_step, donate_argnums=(), verify=False).analysis(wr, xs)
rx = [r for r in a.residuals if r.shape == x.shape]
assert rx and all(r.nbytes == x.nbytes // 8 for r in rx), [(r.name, r.nbytes) for r in rx]

# A budget on a shard_map step: met by the planned body between its peak and the plain one;
# one below both is a BudgetError.
step, ws, x = D.cases("small")["shard_map DP"]
_, base, planned = next(r for r in rows if r[0] == "shard_map DP")
fits = planned + (base - planned) // 2
plan = jaxmem.optimize(step, donate_argnums=(), budget=fits).plan(ws, x)
assert plan.inner and plan.compiled.peak <= fits < plan.baseline.peak, str(plan)
# 5% below the automatic plan: the body's own budget search (each candidate compiled as the
# whole step) goes below what the automatic plan of the body reaches.
below = planned - planned // 20
plan = jaxmem.optimize(step, donate_argnums=(), budget=below).plan(ws, x)
assert plan.compiled.peak <= below and "budget" in plan.inner[0].strategy, str(plan)
try:
    jaxmem.optimize(step, donate_argnums=(), budget=planned // 2).plan(ws, x)
    raise AssertionError("no BudgetError")
except jaxmem.BudgetError as e:  # its minimum: the lowest found, not the plain step's
    assert e.minimum_bytes <= plan.compiled.peak < base, (e.minimum_bytes, base)

# FSDP with the optimizer state (and the parameters) in host memory: adam on kernels and
# moments sharded over the 8 devices; jax.jit's results within float rounding (the streamed
# update is partitioned and fused differently: last-bit differences on ~2% of the elements),
# its output shardings, the state's shards in pinned_host.
import optax
tx = optax.adam(1e-3)
def adam_step(params, opt_state, x):
    def loss(params):
        h = x
        for k in params:
            h = jnp.tanh(h @ k)
        return jnp.mean(h ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))  # GSPMD gathers
rows_s = NamedSharding(mesh, P("data"))
ks = jax.random.split(jax.random.key(0), 4)
params = [jax.device_put(jax.random.normal(k, (64, 64)) / 8, rows_s) for k in ks]
xb = jax.device_put(jax.random.normal(jax.random.key(1), (16, 64)), rows_s)
ref = jax.jit(adam_step)(params, tx.init(params), xb)
for mode in (True, "all"):
    opt = jaxmem.optimize(adam_step, offload_state=mode, strategy="none", donate_argnums=())
    out = opt(params, tx.init(params), xb)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding.with_memory_kind(a.sharding.memory_kind),
                                           a.ndim), (mode, a.sharding, b.sharding)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    kinds = {l.sharding.memory_kind for l in jax.tree.leaves(out[1]) if l.ndim}
    assert kinds == {"pinned_host"}, (mode, kinds)
    if mode == "all":
        assert {l.sharding.memory_kind for l in out[0]} == {"pinned_host"}
print("OK", rows)
"""


def test_sharded_and_shard_map_steps_on_8_host_devices():
    """shard_map data parallelism and FSDP (forward and backward in the body), FSDP and 2-D
    (data x model) meshes under jit: the same outputs and output shardings as jax.jit, a
    lower per-device compiled peak; sizes per device on an Explicit mesh; a budget on the
    shard_map step met by its planned body, one below the body's automatic plan met by the
    body's budget search, and a BudgetError's minimum the lowest peak found."""
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _EIGHT], env=env, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.startswith("OK"), r.stdout[-2000:]

