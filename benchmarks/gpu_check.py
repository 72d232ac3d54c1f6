"""Compiled figures against a real GPU: peak memory, step time and first-call cost on the device.

``python -m benchmarks.gpu_check [--models transformer,corpus:tx_gpt2_ts] [--size bench]
[--variants plain,jaxmem] [--deadline SECONDS] [--out DIR]``

Every table of jaxmem is XLA's compiled peak (``argument + output + temp - alias``). On a
machine with an NVIDIA GPU this script checks those figures against what the device really
allocates, and measures what only the device can show: step time, and the first call's cost.
Models are zoo names (``transformer``, ``resnet``, ...) or corpus entries
(``corpus:tx_gpt2_ts``: :mod:`benchmarks.external.corpus`, other people's train steps as
their users write them). Variants:

- ``plain``: ``jax.jit(step, donate_argnums=0)``, the train state donated;
- ``dots_saveable``: the same with per-block ``dots_saveable`` (zoo) or the whole loss under
  ``jax.checkpoint(policy=dots_saveable)`` (corpus);
- ``jaxmem``: ``jaxmem.optimize(step)`` at its defaults, as a user swaps it in.

Each (model, variant) runs in two fresh processes sharing JAX's persistent compilation cache
and jaxmem's plan cache (:mod:`jaxmem.plan_cache`):

- **fill**: the first call as a user meets it (trace, plan, compile, autotune, run), timed;
  for ``plain`` also the deviceless figure (``--deviceless``: compiled from the named
  target's config, as on a machine without the GPU);
- **measure**: everything comes from the caches (nothing is compiled or autotuned, so the
  device's ``peak_bytes_in_use`` holds the steps' own allocations): the compiled figures of
  the executable that runs, the real peak over the warm-up and the timed steps (minus what
  was in use before the model was built), and the median step time.

``XLA_PYTHON_CLIENT_PREALLOCATE=false`` in both. Rows are written to ``gpu_check.json`` /
``gpu_check.md`` under ``--out`` (default ``benchmarks/results/gpu_check``) as they finish;
``--deadline`` starts no process past that many seconds, so a leased device's time is kept.
Exits 0 with a message when there is no GPU (``--cpu`` runs the same code on the CPU, for
checking this script; real peaks are then missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "jaxmem")
DEFAULT_MODELS = "transformer,corpus:tx_gpt2_ts,corpus:hk_resnet50,resnet,llama"
TARGET_OF = {"H100": "h100", "H200": "h200", "A100": "a100"}


def _gpu_name() -> str | None:
    import jax

    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return None
    return devs[0].device_kind if devs else None


def target_for(device_kind: str) -> str:
    """The named jaxmem target for a device kind (``"NVIDIA H200"`` -> ``"h200"``)."""
    for key, name in TARGET_OF.items():
        if key in device_kind.upper():
            return name
    return "h100"


def _workload(model: str, variant: str, size: str) -> tuple[Any, tuple[Any, Any], Any]:
    """``(step, (state, batch), sharding)`` on the default device; ``variant`` picks the
    step's built-in remat (``dots_saveable``) or none."""
    import jax

    dots = jax.checkpoint_policies.dots_saveable
    if model.startswith("corpus:"):
        from benchmarks.external import corpus

        e = corpus.make(model.split(":", 1)[1], size, jax.devices())
        wrap = ((lambda fn: jax.checkpoint(fn, policy=dots)) if variant == "dots_saveable"
                else (lambda fn: fn))
        return e.make_step(wrap), (e.state, e.batch), e.sharding
    from benchmarks import zoo

    w = zoo.make(model, size=size, remat_policy=dots if variant == "dots_saveable" else None)
    return w.step, tuple(w.args), None


def _loss(metrics: Any) -> float | None:
    if isinstance(metrics, dict) and "loss" in metrics:
        return float(metrics["loss"])
    return None


def _one(model: str, variant: str, size: str, target: str, phase: str, steps: int,
         deviceless: bool) -> dict[str, Any]:
    """Child process: build, compile (or load from the caches), run and time the steps."""
    import jax

    import jaxmem
    from jaxmem import measure

    dev = jax.devices()[0]
    stats = dev.memory_stats  # None on CPU
    before = (stats() or {}).get("bytes_in_use", 0)
    r: dict[str, Any] = dict(model=model, variant=variant, size=size, phase=phase,
                             device=dev.device_kind, jax=jax.__version__)
    t0 = time.perf_counter()
    step, args, sharding = _workload(model, variant, size)
    jax.block_until_ready(jax.tree.leaves(args))
    r["build_s"] = round(time.perf_counter() - t0, 2)
    r["peak_after_build"] = (stats() or {}).get("peak_bytes_in_use", 0) - before or None
    if deviceless and variant != "jaxmem":
        try:
            t = jaxmem.targets.get(target)
            placed = t.place(args, sharding=sharding)
            lowered = jax.jit(step, donate_argnums=0).lower(*placed)
            r["deviceless"] = measure.figures(measure.compile(lowered)).peak
            r["deviceless_target"] = str(t)
        except Exception as e:  # noqa: BLE001 - recorded; the device figures go on
            r["deviceless_error"] = f"{type(e).__name__}: {e}"[:300]
    t0 = time.perf_counter()
    if variant == "jaxmem":
        fn = jaxmem.optimize(step)
        plan = fn.plan(*args)
        f = plan.compiled
        r["strategy"] = str(plan.strategy)
        r["plain_compiled"] = plan.baseline.peak if plan.baseline is not None else None
        r["donated"] = list(getattr(plan, "donated", ()) or ())
    else:
        lowered = jax.jit(step, donate_argnums=0).lower(*args)
        fn = measure.compile(lowered)
        f = measure.figures(fn)
    r.update(compiled=f.peak, argument=f.argument, output=f.output, temp=f.temp,
             alias=f.alias, host_temp=f.host_temp)
    state, batch = args
    state, metrics = fn(state, batch)
    jax.block_until_ready(metrics)
    r["first_call_s"] = round(time.perf_counter() - t0, 2)
    state, metrics = fn(state, batch)  # a second warm-up step (the state is now an output)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, metrics = fn(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    r["step_ms"] = round(1e3 * statistics.median(times), 3)
    r["step_ms_min"] = round(1e3 * min(times), 3)
    r["loss"] = _loss(metrics)
    s = stats()
    if s:
        r["real"] = s["peak_bytes_in_use"] - before
        r["bytes_limit"] = s.get("bytes_limit")
    return r


def _spawn(model: str, variant: str, a: argparse.Namespace, target: str, cache: str,
           deadline: float) -> dict[str, Any]:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               JAXMEM_GPU_CHECK_CACHE=cache, JAXMEM_PLAN_CACHE_DIR=os.path.join(cache, "plans"))
    row: dict[str, Any] = dict(model=model, variant=variant)
    for phase in ("fill", "measure"):
        left = deadline - time.time()
        if left < 5:
            row["error"] = f"not run: the deadline passed before the {phase} process"
            return row
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--one", model, variant,
               "--size", a.size, "--target", target, "--phase", phase,
               "--steps", str(a.steps)] + (["--deviceless"] if a.deviceless else [])
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            row["error"] = f"{phase}: stopped at the deadline ({left:.0f} s left)"
            return row
        if p.returncode != 0:
            row["error"] = f"{phase}: " + p.stderr.strip()[-1500:]
            return row
        out = json.loads(p.stdout.strip().splitlines()[-1])
        if phase == "fill":
            row.update(first_call_s=out["first_call_s"], fill_step_ms=out["step_ms"],
                       **{k: out[k] for k in ("deviceless", "deviceless_target",
                                              "deviceless_error", "strategy",
                                              "plain_compiled", "donated") if k in out})
        else:
            row.update({k: v for k, v in out.items() if k not in ("phase", "first_call_s")})
            row["cached_first_call_s"] = out["first_call_s"]
    return row


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """One row per (model, variant): compiled and real peaks, step time, first call."""
    lines = ["| model | variant | deviceless MiB | compiled on device MiB | real MiB | "
             "real / compiled | step ms | first call s | plan |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            last = r["error"].strip().splitlines()[-1][:100] if r["error"].strip() else "?"
            lines.append(f"| {r['model']} | {r['variant']} | error: {last} | | | | | | |")
            continue
        ratio = (f"{r['real'] / r['compiled']:.3f}" if r.get("real") and r.get("compiled")
                 else "-")
        lines.append(f"| {r['model']} | {r['variant']} | {_mib(r.get('deviceless'))} | "
                     f"{_mib(r.get('compiled'))} | {_mib(r.get('real'))} | {ratio} | "
                     f"{r.get('step_ms', '-')} | {r.get('first_call_s', '-')} | "
                     f"{r.get('strategy', '')} |")
    return "\n".join(lines)


def _write(out: Path, argv: list[str], kind: str, target: str,
           rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(
        dict(command="python -m benchmarks.gpu_check " + " ".join(argv), device=kind,
             target=target, rows=rows), indent=1))
    (out / "gpu_check.md").write_text(markdown(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--size", default="bench")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--deviceless", action="store_true",
                   help="also compile plain steps for the named target without the device")
    p.add_argument("--target", help="named target to compare with (default: from the GPU)")
    p.add_argument("--deadline", type=float, default=3600.0,
                   help="seconds after which no process is started (and a running one stops)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks this script)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check"))
    p.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--phase", default="measure", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        cache = os.environ.get("JAXMEM_GPU_CHECK_CACHE")
        import jax

        if cache:
            jax.config.update("jax_compilation_cache_dir", cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        print(json.dumps(_one(*a.one, a.size, a.target, a.phase, a.steps, a.deviceless)))
        return 0
    deadline = time.time() + a.deadline
    kind = "cpu" if a.cpu else _gpu_name()
    if kind is None:
        print("gpu_check: no GPU here; this compares compiled figures with a real GPU's "
              "memory_stats() and needs one (the deviceless figures alone: python -m "
              "benchmarks --target h100).")
        return 0
    target = a.target or target_for(kind)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as cache:
        for model in a.models.split(","):
            for variant in a.variants.split(","):
                t = time.time()
                rows.append(_spawn(model, variant, a, target, cache, deadline))
                rows[-1]["wall_s"] = round(time.time() - t, 1)
                print(markdown(rows[-1:]).splitlines()[-1], f"({rows[-1]['wall_s']} s)",
                      flush=True)
                _write(a.out, argv, kind, target, rows)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
