"""``python -m jaxmem analyze|plan|bench``: target loading, output, errors (small zoo sizes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxmem.__main__ import TargetError, build_parser, load_target, main
from tests._compiles import one_rewrite_plan

ROOT = Path(__file__).resolve().parents[1]


def test_subcommands_are_registered_next_to_managed_memory():
    text = build_parser().format_help()
    for cmd in ("managed-memory", "analyze", "plan", "bench"):
        assert cmd in text


def test_analyze_zoo_prints_the_analysis(capsys):
    assert main(["analyze", "zoo:mlp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# zoo mlp (test, batch 16)")
    assert "jaxmem.Analysis" in out and "MLP/block0" in out and "recomputable" in out


def test_analyze_lists_residuals(capsys):
    assert main(["analyze", "zoo:mlp", "--batch", "8", "--residuals"]) == 0
    out = capsys.readouterr().out
    assert "batch 8" in out and "utility" in out


def test_plan_prints_compiled_figures(capsys, monkeypatch):
    one_rewrite_plan(monkeypatch)  # the report's sections, whichever plan verify keeps
    assert main(["plan", "zoo:cnn_bn", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "jaxmem.Plan" in out
    assert "plain jit (compiled)" in out and "jaxmem    (compiled)" in out


def test_plan_infeasible_budget_is_an_error(capsys):
    assert main(["plan", "zoo:mlp", "--budget", "1KiB"]) == 1
    assert "budget" in capsys.readouterr().err


def test_bench_from_a_module_make_step(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_steps.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp

        def make_step(batch=32):
            def step(w, x):
                loss, g = jax.value_and_grad(
                    lambda w: jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2))(w)
                return w - 0.1 * g, loss
            return step, (jnp.full((64, 64), 0.01), jnp.ones((batch, 64)))
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["bench", "my_steps:make_step", "--batch", "16", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "# my_steps:make_step"
    assert any(x.startswith("plain jit") for x in lines)
    jm = next(x for x in lines if x.startswith("jaxmem "))
    assert "KiB" in jm and len(jm.split()) >= 6  # peak, vs plain, GFLOP, vs plain, step ms


def test_target_forms(tmp_path):
    step, args, label = load_target("zoo:resnet:test", batch=2)
    assert callable(step) and args[1]["x"].shape[0] == 2 and "resnet" in label
    f = tmp_path / "workload.py"
    f.write_text("from benchmarks import zoo\nW = zoo.make('mlp')\n")
    step, args, _ = load_target(f"{f}:W")  # an attribute that already is a Workload
    assert len(args) == 2


@pytest.mark.parametrize("spec, words", [
    ("zoo:nope", "unknown zoo model"),
    ("zoo:mlp:huge", "size must be"),
    ("no_such_module_xyz:make", "cannot import"),
    ("benchmarks.zoo:not_there", "no attribute"),
    ("benchmarks.zoo:SIZES", "expected (step, args)"),
    ("justtext", "expected pkg.module:make_step"),
])
def test_bad_targets_say_why(spec, words):
    with pytest.raises(TargetError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_target(spec)


def test_zoo_target_outside_a_checkout_says_where_the_zoo_is(monkeypatch):
    """The zoo ships with the repository's benchmarks/, not with the installed package."""
    monkeypatch.setitem(sys.modules, "benchmarks.zoo", None)  # import raises, as outside
    with pytest.raises(TargetError, match="checkout") as info:
        load_target("zoo:mlp")
    assert "file.py:make_step" in str(info.value)


def test_zoo_target_without_optax_says_what_to_install(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("benchmarks.zoo")]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, then put back
    monkeypatch.setitem(sys.modules, "optax", None)  # import raises, as when not installed
    with pytest.raises(TargetError, match=r"needs 'optax'.*\[test\]"):
        load_target("zoo:mlp")


def test_bad_target_exits_2_without_traceback(capsys):
    assert main(["bench", "zoo:nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxmem bench:") and "Traceback" not in err


def test_console_entry_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "jaxmem", "analyze", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "zoo:<name>" in r.stdout
