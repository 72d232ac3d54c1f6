"""Deviceless figures against a real GPU: is the compile-only H100/H200 peak what the device sees?

``python -m benchmarks.gpu_check [--models mlp,transformer] [--size bench] [--out DIR]``

jaxmem's benchmarks and budgets are compiled for a GPU *target* without the GPU
(:mod:`jaxmem.targets`). On a machine with an NVIDIA GPU this script checks that figure
against the device. Per zoo model and variant (``plain`` jit, per-block ``dots_saveable``,
``jaxmem.optimize``), train state donated, each in its own subprocess so that
``memory_stats()['peak_bytes_in_use']`` is that variant's own:

- **deviceless**: compiled peak (``argument + output + temp - alias``) for the named target
  that matches the device (``H100`` -> ``h100``, ``H200`` -> ``h200``, ``A100`` -> ``a100``),
  compiled from the target config as on a CPU-only machine;
- **on device**: the same figure from the executable compiled for the real device;
- **real**: ``peak_bytes_in_use`` over three steps, minus what was in use before the
  arguments were placed.

Autotuning allocates scratch memory on the device while compiling, which would count in the
real peak, so each variant runs twice with JAX's persistent compilation cache: the first
process compiles and fills the cache, the second loads the executables (nothing is
autotuned) and is the one measured. ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` in both.

Goal: real within 10% of deviceless on every row. Writes ``gpu_check.json`` and
``gpu_check.md`` under ``--out`` (default ``benchmarks/results/gpu_check``). Exits 0 with a
message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "dots_saveable", "jaxmem")
DEFAULT_MODELS = "mlp,resnet,transformer,transformer_scan,llama"
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


def _one(model: str, variant: str, size: str, target: str) -> dict[str, Any]:
    """Child process: build, compile deviceless and on device, run three steps."""
    import jax

    import jaxmem
    from benchmarks import zoo
    from jaxmem import measure

    dev = jax.devices("gpu")[0]
    before = dev.memory_stats().get("bytes_in_use", 0)
    policy = jax.checkpoint_policies.dots_saveable if variant == "dots_saveable" else None
    w = zoo.make(model, size=size, remat_policy=policy)
    if variant == "jaxmem":
        step = jaxmem.optimize(w.step, donate_argnums=(0,))
    else:
        step = jax.jit(w.step, donate_argnums=(0,))
    t = jaxmem.targets.get(target)
    deviceless = measure.figures(step.lower(*t.place(w.args)).compile()).peak
    args = jax.device_put(w.args, dev)
    on_device = measure.figures(step.lower(*args).compile()).peak
    state, batch = args
    for _ in range(3):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    stats = dev.memory_stats()
    return dict(model=model, variant=variant, size=size, target=str(t),
                device=dev.device_kind, deviceless=deviceless, on_device=on_device,
                real=stats["peak_bytes_in_use"] - before, loss=float(metrics["loss"]))


def _spawn(model: str, variant: str, size: str, target: str, cache: str) -> dict[str, Any]:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAXMEM_GPU_CHECK_CACHE=cache)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--one", model, variant,
           "--size", size, "--target", target]
    out: dict[str, Any] = {}
    for attempt in ("fill", "measure"):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            return dict(model=model, variant=variant, error=r.stderr.strip()[-2000:],
                        attempt=attempt)
        out = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """One row per (model, variant): deviceless, on-device and real peak, real/deviceless."""
    from jaxmem.measure import fmt_bytes

    lines = ["| model | variant | deviceless | compiled on device | real (memory_stats) | "
             "real / deviceless |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | error: "
                         f"{r['error'].splitlines()[-1][:80]} | | | |")
            continue
        lines.append(f"| {r['model']} | {r['variant']} | {fmt_bytes(r['deviceless'])} | "
                     f"{fmt_bytes(r['on_device'])} | {fmt_bytes(r['real'])} | "
                     f"{r['real'] / r['deviceless']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--size", default="bench")
    p.add_argument("--target", help="named target to compare with (default: from the GPU)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check"))
    p.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        cache = os.environ.get("JAXMEM_GPU_CHECK_CACHE")
        if cache:
            import jax

            jax.config.update("jax_compilation_cache_dir", cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        print(json.dumps(_one(*a.one, a.size, a.target)))
        return 0
    kind = _gpu_name()
    if kind is None:
        print("gpu_check: no GPU here; this compares deviceless figures with a real GPU's "
              "memory_stats() and needs one (the deviceless figures alone: python -m "
              "benchmarks --target h100).")
        return 0
    target = a.target or target_for(kind)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for model in a.models.split(","):
            for variant in a.variants.split(","):
                rows.append(_spawn(model, variant, a.size, target, cache))
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_check.json").write_text(json.dumps(
        dict(command="python -m benchmarks.gpu_check " + " ".join(argv or sys.argv[1:]),
             device=kind, target=target, rows=rows), indent=2))
    table = markdown(rows)
    (a.out / "gpu_check.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
