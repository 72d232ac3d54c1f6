"""The benchmarks' own helpers: the step loader of the child processes and the parser of
XLA's pass timers (benchmarks.workload, benchmarks.compile_phases)."""

from __future__ import annotations

import jax

from benchmarks import compile_phases, workload


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
