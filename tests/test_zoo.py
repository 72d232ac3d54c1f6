"""The model zoo (benchmarks.zoo) and the benchmark runner (python -m benchmarks)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import zoo
from tests._fast_compile import fast_compile, xla_flags

ROOT = Path(__file__).resolve().parents[1]
# The Llama variants have their own file (tests/test_llama.py: steps, remat, presets, sizes).
MODELS = [m for m in zoo.names() if not m.startswith("llama")]
POLICIES = {
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


@functools.cache
def _workload(name: str) -> zoo.Workload:
    return zoo.make(name, size="test")


@functools.cache
def _plain_compiled(name: str):
    """``(state, batch) -> ((new_state, metrics), (loss, grads))``, compiled once.

    XLA merges the step and its loss_and_grads (the same computation), so the grads that the
    remat tests compare against cost no second compile. These tests check values, not
    memory: compiled the fast way (tests/_fast_compile.py), as the remat programs they are
    compared with are.
    """
    w = _workload(name)
    both = lambda state, batch: (w.step(state, batch), w.loss_and_grads(state, batch))
    return fast_compile(jax.jit(both).lower(*w.args))


@functools.cache
def _plain(name: str):
    """The plain program's outputs on the workload's own arguments."""
    return _plain_compiled(name)(*_workload(name).args)


def _assert_close(actual, expected, rtol: float, what: str) -> None:
    """Every leaf within ``rtol`` of ``expected``, relative to the tree's largest magnitude.

    The scale is the whole tree's (the largest gradient entry), not each leaf's: a tiny leaf,
    e.g. a BatchNorm bias gradient summed over N*H*W terms, differs by float reassociation
    when XLA fuses the recomputed program differently, which is not a remat error.
    """
    expected_leaves = [np.asarray(e) for e in jax.tree.leaves(expected)]
    scale = max(float(np.max(np.abs(e), initial=0.0)) for e in expected_leaves)
    scale = max(scale, float(np.finfo(np.float32).tiny))
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, _), e, a in zip(paths, expected_leaves, jax.tree.leaves(actual), strict=True):
        err = float(np.max(np.abs(np.asarray(a) - e), initial=0.0)) / scale
        assert err <= rtol, f"{what}{jax.tree_util.keystr(path)}: relative error {err:.3g}"


def test_names_are_the_documented_models():
    assert MODELS == [
        "mlp",
        "cnn_bn",
        "resnet",
        "resnet_bottleneck",
        "densenet",
        "unet",
        "transformer",
        "transformer_scan",
        "nnx_mlp",
    ]
    for name in MODELS:
        assert zoo.describe(name)
        assert set(zoo.config(name, "bench")) == set(zoo.config(name, "test"))


def test_make_rejects_unknown_names_and_sizes():
    with pytest.raises(KeyError, match="unknown zoo model"):
        zoo.make("vgg")
    with pytest.raises(ValueError, match="size must be one of"):
        zoo.make("mlp", size="huge")
    with pytest.raises(ValueError, match="batch must be"):
        zoo.make("mlp", batch=0)


@pytest.mark.parametrize("name", MODELS)
def test_one_step_runs_and_keeps_the_state_structure(name):
    w = _workload(name)
    assert set(w.state) >= {"params", "opt_state", "step", "rng"}
    assert w.batch["x"].shape[0] == w.batch_size == zoo.config(name)["batch"]
    assert w.n_blocks >= 2
    (new_state, metrics), _ = _plain(name)
    assert jnp.isfinite(metrics["loss"]), metrics
    assert float(metrics["grad_norm"]) > 0.0
    assert int(new_state["step"]) == 1
    assert jax.tree.structure(new_state) == jax.tree.structure(w.state)
    key_data = lambda k: np.asarray(jax.random.key_data(k))
    assert not np.array_equal(key_data(new_state["rng"]), key_data(w.state["rng"])), "same rng"


def test_make_is_deterministic_for_a_seed():
    a, b = zoo.make("mlp", seed=3), zoo.make("mlp", seed=3)
    _assert_close(b.args, a.args, 0.0, "seed 3 ")
    c = zoo.make("mlp", seed=4)
    assert not np.array_equal(c.batch["x"], a.batch["x"])


def test_batch_override():
    w = zoo.make("transformer", batch=3)
    assert w.batch_size == 3 and w.batch["x"].shape == (3, zoo.config("transformer")["seq"])


@pytest.mark.parametrize("name", ["mlp", "nnx_mlp"])
def test_loss_decreases_over_three_steps(name):
    w = _workload(name)
    step, state, losses = _plain_compiled(name), w.state, []
    for _ in range(3):
        (state, metrics), _ = step(state, w.batch)
        losses.append(float(metrics["loss"]))
    assert losses[0] > losses[1] > losses[2], losses


@pytest.mark.parametrize("name", ["cnn_bn", "resnet", "resnet_bottleneck", "densenet", "unet"])
def test_batch_stats_are_updated_by_the_step(name):
    w = _workload(name)
    (new_state, _), _ = _plain(name)
    old = jax.tree.leaves(w.state["batch_stats"])
    new = jax.tree.leaves(new_state["batch_stats"])
    assert old and len(old) == len(new)
    changed = [not np.allclose(a, b) for a, b in zip(old, new, strict=True)]
    assert all(changed), f"{changed.count(False)} of {len(old)} batch_stats leaves unchanged"


@pytest.mark.parametrize("name", MODELS)
def test_loss_and_grads_is_the_steps_own_loss(name):
    # loss_and_grads is what the remat tests compare; it must be the step's loss (same key).
    (_, metrics), (loss, grads) = _plain(name)
    np.testing.assert_allclose(loss, metrics["loss"], rtol=1e-6)
    norm = np.sqrt(
        sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads))
    )
    np.testing.assert_allclose(norm, metrics["grad_norm"], rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(_workload(name).state["params"])


def test_unet_labels_every_pixel():
    w = _workload("unet")
    b, h, wd, _ = w.batch["x"].shape
    assert w.batch["y"].shape == (b, h, wd) and w.batch["y"].dtype == jnp.int32
    assert len(np.unique(np.asarray(w.batch["y"]))) > 1, "a constant segmentation map"
    ups = [k for k in w.state["params"] if k.startswith("up")]
    assert len(ups) == len(zoo.config("unet")["channels"]) - 1


def test_resnet_bottleneck_expands_the_width():
    params = _workload("resnet_bottleneck").state["params"]
    c = zoo.config("resnet_bottleneck")["channels"]
    block = params[f"stage{len(c) - 1}_block0"]
    assert block["conv1"]["kernel"].shape[:2] == (1, 1)
    assert block["conv2"]["kernel"].shape[:2] == (3, 3)
    assert block["conv3"]["kernel"].shape == (1, 1, c[-1], 4 * c[-1])
    assert params["head"]["kernel"].shape[0] == 4 * c[-1]


# Each model under one policy and each policy on several kinds of model (compiles are the
# suite's cost: the 18-pair product doubles it for no new kind of program).
REMAT_CASES = [
    ("mlp", "dots_saveable"),
    ("mlp", "nothing_saveable"),
    ("cnn_bn", "nothing_saveable"),
    ("resnet", "dots_saveable"),
    ("resnet_bottleneck", "nothing_saveable"),
    ("densenet", "nothing_saveable"),
    ("unet", "dots_saveable"),
    ("transformer", "dots_saveable"),
    ("transformer_scan", "nothing_saveable"),
    ("nnx_mlp", "dots_saveable"),
]


def test_remat_cases_cover_every_model_and_policy():
    assert {n for n, _ in REMAT_CASES} == set(MODELS)
    assert {p for _, p in REMAT_CASES} == set(POLICIES)


@pytest.mark.parametrize(("name", "policy"), REMAT_CASES)
def test_per_block_remat_gives_the_same_loss_and_grads(name, policy):
    w = _workload(name)
    r = w.with_remat(POLICIES[policy])
    assert r.state is w.state and r.batch is w.batch and r.remat_policy is POLICIES[policy]
    jaxpr = str(jax.make_jaxpr(r.loss_and_grads)(*r.args))
    assert "checkpoint" in jaxpr or "remat" in jaxpr, "no remat in the program"
    loss, grads = fast_compile(jax.jit(r.loss_and_grads).lower(*r.args))(*r.args)
    _, (plain_loss, plain_grads) = _plain(name)
    _assert_close(loss, plain_loss, 1e-6, f"{name}/{policy} loss")
    _assert_close(grads, plain_grads, 1e-6, f"{name}/{policy} grads")


def test_a_registered_variant_is_measured(monkeypatch):
    from benchmarks import run

    def build(w):
        return jax.jit(w.step, donate_argnums=run.DONATE_ARGNUMS)

    monkeypatch.setitem(run.VARIANTS, "again", build)
    w = _workload("mlp")
    r = run.measure_variant(w, "again", runs=2, warmup=1)
    assert r.error is None, r.error
    assert r.peak == r.argument + r.output + r.temp - r.alias > 0
    assert r.flops > 0 and len(r.step_times) == 2 and r.step_s > 0
    assert np.isfinite(r.loss)
    assert int(w.state["step"]) == 0, "the workload's own state was donated"


def test_benchmark_quick_cli_writes_json_and_csv(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # the files' form is checked, not the figures: XLA:CPU's loop emitters as well as
        # conftest.py's -O0 (tests/_fast_compile.py), for less compile time
        "XLA_FLAGS": xla_flags("--xla_cpu_use_fusion_emitters=false"),
    }
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--models", "mlp", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing_saveable" in proc.stdout and "peak vs plain" in proc.stdout

    data = json.loads((tmp_path / "results.json").read_text())
    assert {"platform", "cpu_count", "jax", "date", "donate_argnums"} <= set(data["meta"])
    assert data["meta"]["donate_argnums"] == [0]
    variants = [r["variant"] for r in data["results"]]
    assert variants[:3] == ["plain", "dots_saveable", "nothing_saveable"]
    for r in data["results"]:
        assert r["model"] == "mlp" and r["error"] is None
        assert r["peak"] == r["argument"] + r["output"] + r["temp"] - r["alias"] > 0
        assert r["flops"] > 0 and r["step_s"] > 0

    csv_lines = (tmp_path / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("model,variant,") and len(csv_lines) == 1 + len(variants)

    from benchmarks import readme_table

    md = readme_table.render(data)
    assert "donate_argnums=(0,)" in md
    assert md.count("\n| plain |") == 1 and "| nothing_saveable |" in md


def test_match_builtin_table_says_whether_the_budget_met_the_builtin():
    """``benchmarks.match_builtin``'s table: the budget row is compared with the built-in whose
    peak it was given (met, at how many FLOPs), or says the budget was not met."""
    from benchmarks import match_builtin

    def row(model, variant, peak, flops, **kw):
        return dict(model=model, variant=variant, peak=peak, flops=flops, error=None, **kw)

    meta = dict(command="python -m benchmarks.match_builtin --models a,b", target="cpu",
                jax="0.10.2", date="2026-12-02T00:00:00", flops_note="XLA's cost_analysis")
    rows = [row("a", "plain", 100, 10.0), row("a", "nothing_saveable", 40, 13.0),
            row("a", "jaxmem", 60, 10.4),
            row("a", "jaxmem(budget=40)", 40, 12.0, matches="nothing_saveable", budget=40,
                strategy="budget: blocks"),
            row("b", "plain", 100, 10.0), row("b", "nothing_saveable", 40, 13.0),
            row("b", "jaxmem", 60, 10.4),
            dict(row("b", "jaxmem(budget=40)", None, None, matches="nothing_saveable",
                     budget=40), error="BudgetError: no plan fits")]
    text = match_builtin.markdown(rows, meta)
    assert "| a | budget=40 | 40 B | -60.0% | +20.0% | at or below nothing_saveable's peak, " \
           "FLOPs -7.7% vs it | budget: blocks |" in text
    assert "| b | budget=40 | - | | | budget not met: BudgetError: no plan fits | |" in text
