"""Repository-wide pytest set-up (tests, and the doctests of jaxmem/ and benchmarks/zoo/)."""

from __future__ import annotations

import os

# The tests run on the CPU. The test extra installs JAX's CUDA plugin and libtpu for the
# deviceless GPU- and TPU-target tests; without this JAX would try to start both devices
# (libtpu spends seconds looking for a TPU) and the CUDA plugin, failing without a driver,
# could no longer build topology devices. Subprocesses (examples, CLI) inherit it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's LLVM back end at -O0: less compile time (the whole suite: 14% less CPU time,
# docs/testing.md). The memory figures the tests compare are fixed before it (buffer
# assignment), and every variant a test compares is compiled with the same flags.
# Subprocesses inherit it; those that set XLA_FLAGS add theirs (tests._fast_compile.xla_flags).
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA}".strip()

import pytest  # noqa: E402

#: Docstring examples known to fail, by node id, each with why. They are marked
#: ``xfail(strict=True)``: listed in the summary, and the run fails as soon as one passes,
#: so that its line here goes with the fix.
KNOWN_DOCTEST_FAILURES: dict[str, str] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        reason = KNOWN_DOCTEST_FAILURES.get(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


@pytest.fixture(autouse=True)
def _fresh_plan_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test plans from scratch: jaxmem's in-memory plan cache outlives an ``Optimized``
    (tests that patch the planner would otherwise get another test's plan), and a
    developer's JAXMEM_PLAN_CACHE_DIR is not the tests' business."""
    from jaxmem import plan_cache

    monkeypatch.delenv("JAXMEM_PLAN_CACHE_DIR", raising=False)
    plan_cache.set_dir(None)
    plan_cache.clear_memory()


@pytest.fixture(scope="module", autouse=True)
def _compile_each_program_once(request: pytest.FixtureRequest):
    """In a test module that sets ``COMPILE_ONCE = True``, each distinct lowered program is
    compiled once (``tests._compiles.compile_once``): its tests compile the same plain steps
    and candidate plans again and again (docs/testing.md)."""
    if not getattr(request.module, "COMPILE_ONCE", False):
        yield
        return
    from tests._compiles import compile_once

    with compile_once():
        yield
