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

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(mode: str, timeout: float = 150.0) -> list[dict]:
    """Run tests/_distributed_worker.py as processes 0 and 1 of one job; their results.
    Both are killed at ``timeout`` seconds: a hang fails the test, never CI."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
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


def test_two_processes_plan_alike_and_match_jit():
    """Two processes (2 CPU devices each, gloo collectives), a batch-sharded step under
    optimize with and without a budget: the same loss as plain jit on both, the same plan
    fingerprint on both."""
    a, b = _two_processes("same")
    assert a["devices"] == b["devices"] == 4
    for name in ("auto", "budget"):
        assert a[name]["fingerprint"] == b[name]["fingerprint"], (a, b)
        assert a[name]["loss"] == b[name]["loss"]
        assert abs(a[name]["loss"] - a["ref"]) <= 1e-6 * abs(a["ref"]) + 1e-7
    assert a["auto"]["recompute"] > 0


def test_two_processes_that_plan_differently_fail_loudly():
    """Process 1 plans differently: both processes raise PlanMismatchError naming the
    fingerprints, before any planned program runs (no hang)."""
    a, b = _two_processes("mismatch")
    for r in (a, b):
        assert "planned" in r.get("error", "") and "differently" in r["error"], r
        assert len(set(r["fingerprints"])) == 2
