"""benchmarks/external/corpus: other people's train steps, in their own idioms, under
jaxmem.optimize.

Only the cheap entries of ``corpus.CI`` are compiled here (the suite's time budget); the
rest are measured by ``python -m benchmarks.external --set corpus``. Every CI entry's
package is in the ``test`` extra, so none of them is ever skipped: a missing package there
is an install error, and fails.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import jax
import pytest

import jaxmem
from benchmarks.external import corpus
from benchmarks.external.__main__ import _compare
from jaxmem import measure
from tests._compiles import one_rewrite_plan

ROOT = Path(__file__).resolve().parents[1]


def _extra(name: str) -> list[str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    out: list[str] = []
    for req in extras[name]:
        if req.startswith("jaxmem["):
            for sub in req[len("jaxmem["):-1].split(","):
                out += _extra(sub)
        else:
            out.append(req.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip())
    return out


def test_corpus_covers_the_projects():
    projects = {corpus.CORPUS[n][0] for n in corpus.CORPUS}
    assert len(corpus.CORPUS) >= 12 and len(projects) >= 5, (len(corpus.CORPUS), projects)
    # every package of the corpus is in the external extra (the benchmark's install)
    external = set(_extra("external"))
    assert projects <= external, projects - external


def test_ci_entries_are_in_the_test_extra():
    """The entries compiled below need only the test extra: none of them may skip."""
    test = set(_extra("test"))
    for name in corpus.CI:
        assert corpus.CORPUS[name][0] in test, name


@pytest.mark.parametrize("name", corpus.CI)
def test_optimize_matches_jit_and_peak_not_above(name, monkeypatch):
    # verify compiles one of the rewrite's plans beside the plain step, not its best three:
    # the step still runs a rewritten plan, with jit's outputs, at a peak not above jit's
    one_rewrite_plan(monkeypatch)
    e = corpus.make(name, "test")
    step = e.make_step()

    def copy(t):
        return jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, t)

    jitted = jax.jit(step, donate_argnums=(0,))
    compiled = measure.compile(jitted.lower(e.state, e.batch))
    plain = measure.compiled_figures(compiled, jitted, (e.state, e.batch))
    ref = compiled(copy(e.state), e.batch)
    opt = jaxmem.optimize(step, donate_argnums=(0,))
    plan = opt.plan(e.state, e.batch)
    out = opt(copy(e.state), e.batch)
    ok, worst = _compare(out, ref)
    assert ok, f"{name}: jaxmem.optimize's outputs differ from jax.jit's (rel {worst:.2e})"
    assert plan.compiled.peak <= plain.peak, (plan.compiled.peak, plain.peak)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-n", "0", "-o", "addopts="]))
