"""The benchmarks' own helpers: the step loader of the child processes, the parser of
XLA's pass timers, the compile-cores table, the causes of ranking disagreements and the
barriers XLA cut (benchmarks.workload, benchmarks.compile_phases, benchmarks.compile_cores,
benchmarks.ranking_disagreements, benchmarks.barrier_ties)."""

from __future__ import annotations

import jax

from benchmarks import barrier_ties, compile_cores, compile_phases, workload


def test_load_gives_a_zoo_step_with_its_arguments():
    w = workload.load("mlp", "test")
    out = jax.jit(w.step)(w.state, w.batch)
    assert jax.tree.structure(out) is not None and jax.tree.leaves(out)


def test_xla_timers_are_summed_per_compile_between_the_markers():
    mark = compile_phases.MARK
    log = "\n".join([
        "I1205 gpu_compiler.cc:1] GpuCompiler::RunHloPasses for jit_step time: 9.9 s (1 us)",
        f"{mark} start plain",
        "I1205 hlo_pass_pipeline.cc:1] HLO pass: priority-fusion for jit_step time: 3.2 s "
        "(3200000 us)",
        "I1205 hlo_pass_pipeline.cc:1] HLO pass: priority-fusion for jit_step time: 150 ms "
        "(150000 us)",
        "I1205 gpu_compiler.cc:1] GpuCompiler::RunHloPasses for jit_step time: 5.5 s (1 us)",
        f"{mark} end",
        f"{mark} start plan",
        "I1205 hlo_pass_pipeline.cc:1] HLO pass: cse for jit_run time: 40 us (40 us)",
        f"{mark} end",
    ])
    first, second = compile_phases.timers(log)
    assert abs(first["HLO pass: priority-fusion"] - 3.35) < 1e-9
    assert first["GpuCompiler::RunHloPasses"] == 5.5  # the line before the marker not counted
    assert abs(second["HLO pass: cse"] - 4e-5) < 1e-12


def test_the_compile_cores_table_counts_subprocesses_in_the_cores_busy():
    meta = dict(command="python -m benchmarks.compile_cores", git_commit="0" * 40,
                date="2026-12-07", jax="0.10.2", cpus=2)
    rows = [dict(how="alone", seconds=5.0, cpu_self=5.0, cpu_children=3.0, compiles=1),
            dict(how="threads", seconds=8.0, cpu_self=10.0, cpu_children=6.0, compiles=2)]
    table = compile_cores.markdown(meta, rows).splitlines()
    assert table[-2] == "| alone (1) | 5.00 (1.00x) | 5.00 | 3.00 | 1.60 |"
    assert table[-1] == "| threads (2) | 8.00 (1.60x) | 10.00 | 6.00 | 2.00 |"
    assert compile_cores.HOWS[0] == "alone"   # the table's ratios are over its first row


def test_a_disagreement_is_put_down_to_the_first_figure_that_orders_it_right():
    from benchmarks.ranking_disagreements import cause

    def row(compiled, model, fused=None, rewritten=None):
        return {"compiled": compiled, "model": model, "fused": fused, "rewritten": rewritten}

    assert cause(row(100, 10), row(200, 20)) is None             # the model agrees
    assert cause(row(100, 20), row(100.5, 10)) is None           # the compiler ties them
    assert cause(row(100, 10), row(200, 10)) == "tied"
    assert cause(row(100, 20, 1, 9), row(200, 10, 2, 1)) == "fused"
    assert cause(row(100, 20, 2, 1), row(200, 10, 1, 9)) == "rewritten"
    assert cause(row(100, 20, 2, 9), row(200, 10, 1, 1)) == "compiler"
    assert cause(row(100, 20, None, None), row(200, 10, None, None)) == "compiler"
    # --key rewritten: the rewritten steps' order checked, the model's the one alternative
    assert cause(row(100, 20, None, 1), row(200, 10, None, 9), "rewritten") is None
    assert cause(row(100, 20, None, 5), row(200, 10, None, 5), "rewritten") == "tied"
    assert cause(row(100, 10, None, 9), row(200, 20, None, 1), "rewritten") == "model"
    assert cause(row(100, 20, None, 9), row(200, 10, None, 1), "rewritten") == "compiler"


def test_fused_free_peak_is_the_plain_peak_when_everything_is_kept_and_drops_lower_it():
    import jax.numpy as jnp

    import jaxmem
    from benchmarks.ranking_disagreements import FusedFree
    from jaxmem.analyzing.costmodel import CostModel

    def loss(w, x):
        h = x
        for k in range(3):
            h = jnp.tanh(h @ w[k]) * 2.0 + 1.0
        return jnp.sum(h ** 2)

    w, x = jnp.ones((3, 64, 64)) * 0.01, jnp.ones((32, 64))
    a = jaxmem.analyze(jax.value_and_grad(loss), w, x)
    model = CostModel(a)
    ff = FusedFree(model)
    assert abs(ff.peak() - a.peak_bytes) <= 1
    assert ff.fused and ff.fused <= model.activations   # 1 - tanh², fused into its reader
    assert ff.peak(ff.fused) == ff.peak()           # dropping them changes nothing stored
    assert model.evaluate(ff.fused).peak < model.evaluate().peak  # where the model's did


def test_prediction_why_all_prints_every_candidates_compiled_peak(capsys):
    """``prediction_why MODEL all``: the plain step's compiled peak and each candidate's,
    one line each (no XLA dumps, so it runs in a process that has JAX already)."""
    from benchmarks import prediction_why

    assert prediction_why.main(["mlp", "all", "--size", "test"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.endswith(" MiB")]
    assert lines[0].startswith("plain ") and len(lines) >= 3
    assert all(float(ln.split()[-2]) > 0 for ln in lines)


def test_suite_compiles_logs_every_compile_of_a_pytest_run(tmp_path):
    """``-p benchmarks.suite_compiles`` with ``JAXMEM_COMPILE_LOG`` set logs each XLA
    compile of a test process with its test; the report counts a program compiled again
    (here: the same jitted function with a fresh cache, in a second test of the module)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks import suite_compiles

    (tmp_path / "test_two.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def f(x):\n    return jnp.sin(x) * 2\n"
        "def test_a():\n    jax.jit(f)(jnp.ones(3))\n"
        "def test_b():\n    jax.clear_caches(); jax.jit(f)(jnp.ones(3))\n"
        "    jax.jit(f)(jnp.ones(4))\n")
    log = tmp_path / "log"
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAXMEM_COMPILE_LOG=str(log), PYTHONPATH=str(root),
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "benchmarks.suite_compiles", "test_two.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(line) for f in log.glob("*.jsonl") for line in f.read_text().splitlines()]
    mine = [x for x in rows if x["test"] and x["test"].startswith("test_two.py::")]
    by_test = {t: [x["key"] for x in mine if x["test"] == t]
               for t in ("test_two.py::test_a", "test_two.py::test_b")}
    assert len(by_test["test_two.py::test_a"]) >= 1
    assert by_test["test_two.py::test_a"][-1] in by_test["test_two.py::test_b"]  # again
    assert len(set(by_test["test_two.py::test_b"])) >= 2  # another shape: another program
    report = suite_compiles.summary(rows)
    assert f"{len(rows)} compiles" in report and "test_two.py::test_b" in report


def test_xla_live_at_peak_reads_the_temp_values_live_where_their_bytes_sum_highest():
    """``prediction_why``'s reading of XLA's dumps: the ``preallocated-temp`` values (not the
    parameters), their ``BufferLiveRange`` (a ``{}`` name is the value's own), the position
    where their bytes sum highest, and each value's ``op_name`` from the HLO."""
    from benchmarks.prediction_why import xla_live_at_peak

    assignment = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <1 p0 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 300, preallocated-temp:
 value: <2 conv.1{} @0> (size=16,offset=284): (f32[25]{0}, u8[0]{0})
 value: <3 conv.1{0} @0> (size=100,offset=0): f32[25]{0}
 value: <4 fusion.2 @0> (size=200,offset=100): f32[50]{0}
 value: <5 copy.3 @0> (size=100,offset=100): f32[25]{0}
"""
    live_range = """HloLiveRange (max 9):
  InstructionSequence:
    0:p0
  BufferLiveRange:
    p0{}:0-9
    conv.1{}:1-1
    conv.1{0}:1-6
    fusion.2{}:2-4
    copy.3{}:5-8
  Live ranges at 3 (peak):
    fusion.2{}: 200 bytes (cumulative: 200 bytes)
"""
    hlo = ('  %conv.1 = (f32[25]{0}, u8[0]{0}) custom-call(%p0), '
           'metadata={op_name="jit(f)/jvp(m)/conv_general_dilated"}\n'
           '  %fusion.2 = f32[50]{0} fusion(%conv.1), kind=kLoop, '
           'metadata={op_name="jit(f)/transpose(jvp(m))/mul"}\n'
           '  %copy.3 = f32[25]{0} copy(%conv.1)\n')
    total, live, values = xla_live_at_peak(assignment, live_range, hlo)
    assert total == 300
    # at position 2 to 4: conv.1{0} (100) and fusion.2 (200); conv.1{} (16) only at 1
    assert live == 300
    assert [(size, name, op) for size, name, op, _, _ in values] == [
        (200, "fusion.2", "jit(f)/transpose(jvp(m))/mul"),
        (100, "conv.1{0}", "jit(f)/jvp(m)/conv_general_dilated")]


def test_repredict_prints_each_stored_plain_row_against_its_compiled_peak(capsys):
    """``prediction --repredict``: a stored plain row predicted again with the model as it
    is now, against its stored compiled peak (here the prediction itself: 0.0%), nothing
    compiled; rows the filters leave out are not predicted."""
    import jaxmem
    from benchmarks import prediction, zoo

    w = zoo.make("mlp", size="test", abstract=True)
    peak = jaxmem.analyze(w.step, *w.args, donate_argnums=0).peak_bytes
    rows = [{"model": "mlp", "size": "test", "target": "cpu", "step": "plain",
             "compiled": peak, "error_pct": 1.0},
            {"model": "mlp", "size": "bench", "target": "cpu", "step": "plain",
             "compiled": 1, "error_pct": 1.0}]
    assert prediction.repredict(rows, {"sizes": {"test"}}) == 0
    out = capsys.readouterr().out
    assert "stored   +1.0%  now   +0.0%" in out and "bench" not in out
    assert "1 rows: 1 within 5%, 1 within 10%" in out
    # --write: the predicted row is updated in place, compiled peak kept; the other is not
    assert prediction.repredict(rows, {"sizes": {"test"}}, {"git_commit": "abc"}) == 0
    assert rows[0]["predicted"] == peak == rows[0]["compiled"]
    assert rows[0]["error_pct"] == 0.0 and rows[0]["repredicted"] == {"git_commit": "abc"}
    assert "predicted" not in rows[1] and rows[1]["error_pct"] == 1.0


def test_repredict_plans_predicts_every_stored_candidate_without_compiling(tmp_path, capsys,
                                                                          monkeypatch):
    """``prediction --repredict --plans``: each stored candidate of a ``--plans`` file is
    found among today's candidates by name, its rewritten step predicted again against its
    stored compiled peak (here the prediction itself: 0.0%), and nothing is compiled."""
    import json

    from jaxmem.program import from_jaxpr

    import jaxmem
    from benchmarks import prediction, prediction_plans
    from jaxmem.analyzing.analysis import from_program
    from jaxmem.xla import measure

    w = prediction_plans.workload("mlp", "test", "cpu")
    step, cands = prediction_plans.candidates(w, "cpu")
    plans = [c for c in cands if not c.plan.loss_policy]
    assert plans

    def peak(c):
        prog = from_jaxpr(c.jitted.trace(*step.flat).jaxpr)
        return from_program(prog, donated=step.donate_flat).peak_bytes

    plain = jaxmem.analyze(w.step, *w.args, donate_argnums=0).peak_bytes
    rows = [{"candidate": c.plan.strategy, "kind": "plan", "compiled": peak(c),
             "rewritten_error_pct": 3.0} for c in plans[:2]]
    rows.append({"candidate": "gone", "kind": "plan", "compiled": 1,
                 "rewritten_error_pct": 0.0})
    entry = {"model": "mlp", "size": "test", "target": "cpu", "candidates": rows,
             "plain": {"candidate": "plain", "kind": "plain", "compiled": plain,
                       "rewritten_error_pct": 0.0}}
    path = tmp_path / "plans-cpu-test.json"
    path.write_text(json.dumps({"meta": {}, "models": [entry]}))

    def no_compile(*a, **k):
        raise AssertionError("compiled")
    monkeypatch.setattr(measure, "compile", no_compile)
    assert prediction.main(["--repredict", "--plans", "--files", str(path)]) == 0
    out = capsys.readouterr().out
    first = rows[0]["candidate"][:48]
    assert f"{first:48s} compiled" in out and "stored   +3.0% now   +0.0%" in out
    assert "gone" in out and "not among today's candidates" in out
    assert "rewritten: 3 rows, 3 within 5%" in out
    # --write stores the new predictions, errors and ranking; the unmatched row is kept
    assert prediction.main(["--repredict", "--plans", "--write", "--files", str(path)]) == 0
    (got,) = json.loads(path.read_text())["models"]
    assert [r["rewritten"] for r in got["candidates"][:2]] == [r["compiled"] for r in rows[:2]]
    assert [r["rewritten_error_pct"] for r in got["candidates"]] == [0.0, 0.0, 0.0]
    assert "rewritten" not in got["candidates"][2]
    assert got["repredicted"]["command"].startswith("python -m benchmarks.prediction")
    assert got["ranking"]["plans_rewritten"]["n"] == 2
    assert "Predictions made again" in path.with_suffix(".md").read_text()


def test_rewritten_disagreements_are_listed_from_the_files_without_tracing():
    from benchmarks import ranking_disagreements as rd

    def row(name, compiled, model, rewritten):
        return {"candidate": name, "kind": "plan", "compiled": compiled, "model": model,
                "rewritten": rewritten}

    entry = {"model": "m", "size": "bench", "target": "h100", "candidates": [
        row("a", 100, 10, 50), row("b", 200, 20, 40), row("c", 300, 5, 35),
        {"candidate": "plain", "kind": "plain", "compiled": 400, "model": None,
         "rewritten": 300}]}
    s = rd.step(entry, "rewritten")   # no trace: the step's name is no model
    assert s["pairs"] == 3
    assert [(p["a"], p["b"], p["cause"]) for p in s["disagreements"]] == [
        ("a", "b", "model"), ("a", "c", "compiler"), ("b", "c", "compiler")]
    s["key"] = "m (bench, h100)"
    md = rd.markdown({"command": "x", "date": "d", "git_commit": None, "key": "rewritten"},
                     [s])
    assert "3 of 3 pairs ordered unlike the compiler (0.0% agree)" in md
    assert "tied 0, model 1, compiler 2" in md


def test_split_k_sets_the_compiled_split_and_peak_beside_the_models():
    """``benchmarks.split_k``: one matmul of a language-model head compiled for the H100
    target beside the liveness model (GPT-2 small's input gradient at 256 tokens: split 16
    ways on both sides; its result is the program's output, so the model is low by it)."""
    from benchmarks import split_k
    from jaxmem import targets

    r = split_k.row(targets.require("h100"), "dx", 256, 768, 50257, "float32")
    assert r["split_compiled"] == r["split_model"] == 16
    assert r["compiled"] - r["predicted"] == 256 * 768 * 4


_LOWERED = """HloModule jit_run
%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}
ENTRY %main (a: f32[4], b: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %t.1 = (f32[4]{0}, f32[4]{0}) tuple(%a, %b)
  %optimization_barrier.1 = (f32[4]{0}, f32[4]{0}) opt-barrier(%t.1), metadata={op_name="x"}
  %t.2 = (f32[4]{0}, f32[4]{0}, f32[4]{0}) tuple(%a, %b, %b)
  %optimization_barrier.2 = (f32[4]{0}, f32[4]{0}, f32[4]{0}) opt-barrier(%t.2)
  ROOT %g = f32[4]{0} get-tuple-element(%optimization_barrier.1), index=0
}
"""


def test_barrier_ties_counts_the_barriers_whose_operands_xla_cut():
    # as scheduled: the first barrier (renamed with XLA's ``.0``) lost its tie, the
    # second kept its three operands
    scheduled = (_LOWERED.replace("%t.1 = (f32[4]{0}, f32[4]{0}) tuple(%a, %b)",
                                  "%t.1 = (f32[4]{0}) tuple(%a)")
                 .replace("%optimization_barrier.1 = (f32[4]{0}, f32[4]{0})",
                          "%optimization_barrier.1.0 = (f32[4]{0})"))
    assert barrier_ties.barrier_widths(_LOWERED) == {"optimization_barrier.1": 2,
                                                     "optimization_barrier.2": 3}
    assert barrier_ties.barrier_widths(scheduled)["optimization_barrier.1"] == 1
    assert barrier_ties.cut_barriers(_LOWERED, scheduled) == (2, 1, 1)
    assert barrier_ties.cut_barriers(_LOWERED, _LOWERED) == (2, 0, 0)


def test_xla_cuts_a_barrier_tie_once_nothing_else_reads_it():
    # The fact docs/first_call.md ("The rewrite's ties, cut by XLA") rests on, on the H100
    # target: of three ties nothing reads through their barriers, XLA keeps only the one
    # an elementwise op also reads; the one a matmul also reads (its fusion takes the
    # producer in) and a copy made for the barrier go before scheduling.
    assert barrier_ties.probe("h100") == "[2, 2, 2] [1, 1, 2]"
