#!/usr/bin/env python
"""Managed (CUDA Unified) memory on a GPU: bigger-than-device training, with and without advice.

This is the GPU check for ``jaxmem.managed_memory`` (Choi & Lee's setting). It runs these
configurations, each in its own subprocess, because the memory settings must be in place
before the backend starts:

=================  ===================================================================
``fit/plain``      a model at ``--fit-factor`` (0.5) x device memory, XLA defaults
``fit/managed``    the same model on managed memory (oversubscription 1.0): overhead
``big/plain``      a model at ``--size-factor`` (1.5) x device memory, XLA defaults:
                   expected to fail (out of memory)
``big/managed``    the same model on managed memory, pool bounded at size-factor + 0.2
``big/advised``    the same, plus ``advise_train_state`` (params read-mostly, batch
                   accessed-by device and host, optimizer state preferred on device)
=================  ===================================================================

The model is a stack of tanh layers (``lax.scan`` over ``[L, H, H]`` weights) trained with
``optax.sgd``, with the train state donated. It is sized from the device's
``memory_stats()['bytes_limit']``, probed at ``XLA_CLIENT_MEM_FRACTION=1.0`` (the whole
device; the plain runs then use XLA's default fraction). The parent compiles the step on
the CPU for two depths and solves ``footprint(L) = target``, where footprint = argument +
output + temp - alias of ``memory_analysis()``. Each child reports the compiled footprint on
the GPU, the peak bytes in use, compile/init times and the step times.

Safety: the managed pool is at most ``size_factor + 0.2`` (<= 1.7) x device memory. Before
any oversubscribed run, the script checks that host RAM (MemAvailable) holds the excess
with 25% margin, and shrinks the model if not. Every child has a timeout.

Usage::

    python benchmarks/managed_memory_gpu.py --out managed_memory_gpu.json
    python benchmarks/managed_memory_gpu.py --steps 2 --timeout 240 \
        --configs big/managed,big/advised
    python benchmarks/managed_memory_gpu.py --dry-run-cpu   # the whole pipeline on CPU, tiny sizes

On a machine without an NVIDIA GPU it prints why and exits 0 (with ``--out``, the JSON file
records ``"status": "skipped"``). Only jax, optax and jaxmem are needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
CONFIGS = ("fit/plain", "fit/managed", "big/plain", "big/managed", "big/advised")
MAX_SIZE_FACTOR = 1.5  # bounded oversubscription (see docs/managed_memory.md)
POOL_HEADROOM = 0.2  # managed pool = size_factor + this, x device memory
MEM_VARS = (
    "TF_FORCE_UNIFIED_MEMORY",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)
GiB = 1 << 30


# --- the model (used by the parent for sizing on CPU, and by the children) ------------------

def build(depth: int, width: int, batch: int):
    """``(init, step)`` for an MLP of ``depth`` tanh layers of ``width``, batch ``batch``."""
    import functools

    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.sgd(1e-3)

    def loss_fn(w, x, y):
        def layer(h, wi):
            return jnp.tanh(h @ wi), None

        h, _ = jax.lax.scan(layer, x, w)
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def init(key):
        kw, kx, ky = jax.random.split(key, 3)
        # One random layer, varied per layer by a broadcast scale: no depth x width^2 random
        # intermediate, so init needs no more memory than the weights themselves.
        base = jax.random.normal(kw, (width, width), jnp.float32) / math.sqrt(width)
        scale = 1.0 + 0.1 * jnp.arange(depth, dtype=jnp.float32)[:, None, None] / depth
        w = base[None] * scale
        x = jax.random.normal(kx, (batch, width), jnp.float32)
        y = jax.random.normal(ky, (batch, width), jnp.float32)
        return w, opt.init(w), x, y

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(w, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(w, x, y)
        updates, opt_state = opt.update(g, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, loss

    return init, step


def footprint(compiled) -> int:
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def compiled_footprint(depth: int, width: int, batch: int) -> int:
    import jax

    init, step = build(depth, width, batch)
    shapes = jax.eval_shape(init, jax.random.key(0))
    return footprint(step.lower(*shapes).compile())


def size_model(target: int, width: int, batch: int) -> dict:
    """The depth whose compiled footprint (on CPU) is closest to ``target`` bytes, from below."""
    f2, f4 = compiled_footprint(2, width, batch), compiled_footprint(4, width, batch)
    per_layer = max(1, (f4 - f2) // 2)
    fixed = f2 - 2 * per_layer
    depth = max(2, int((target - fixed) // per_layer))
    return {
        "depth": depth, "width": width, "batch": batch,
        "estimated_bytes": fixed + depth * per_layer, "per_layer_bytes": per_layer,
    }


# --- child: one configuration ---------------------------------------------------------------

def child(cfg: dict) -> dict:
    if cfg.get("managed"):
        try:
            import jaxmem  # noqa: F401
        except ImportError:
            sys.path.insert(0, str(ROOT))
        import warnings

        from jaxmem import managed_memory

        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if cfg.get("dry_run") else "default")
            managed_memory.enable(oversubscription=cfg["pool"], preallocate=False)
    import jax

    out: dict = {"platform": jax.devices()[0].platform}
    m = cfg["model"]
    init, step = build(m["depth"], m["width"], m["batch"])
    t = time.perf_counter()
    shapes = jax.eval_shape(init, jax.random.key(0))
    compiled = step.lower(*shapes).compile()
    out["compile_s"] = time.perf_counter() - t
    out["compiled_footprint_bytes"] = footprint(compiled)

    t = time.perf_counter()
    w, opt_state, x, y = jax.block_until_ready(init(jax.random.key(0)))
    out["init_s"] = time.perf_counter() - t

    advise = None
    if cfg.get("advise"):
        from jaxmem import managed_memory

        def advise(w, opt_state, x, y):
            managed_memory.advise_train_state(w, (x, y), opt_state=opt_state)

    times, losses = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        t = time.perf_counter()
        if advise is not None:
            advise(w, opt_state, x, y)
        w, opt_state, loss = compiled(w, opt_state, x, y)
        losses.append(float(loss))  # blocks
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t)
        elif i == 0:
            out["first_step_s"] = time.perf_counter() - t
    out["step_s"] = times
    out["step_median_s"] = statistics.median(times) if times else None
    out["losses"] = losses
    out["success"] = all(math.isfinite(v) for v in losses)
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    out["bytes_limit"] = stats.get("bytes_limit")
    if cfg.get("managed"):
        from jaxmem import managed_memory

        st = managed_memory.status()
        out["managed_status"] = {"in_force": st.in_force, "note": st.note,
                                 "advised_buffers": st.advised_buffers,
                                 "cuda_runtime": st.cuda_runtime}
    return out


def probe() -> dict:
    import jax

    d = jax.devices()[0]
    stats = d.memory_stats() or {}
    return {
        "platform": d.platform, "device_kind": d.device_kind, "device_count": jax.device_count(),
        "bytes_limit": stats.get("bytes_limit"), "jax": jax.__version__,
    }


# --- parent ---------------------------------------------------------------------------------

def host_mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_child(arg: str, payload: dict, env: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(HERE), arg, json.dumps(payload)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"success": False, "error": f"timeout after {timeout:.0f} s"}
    wall = time.perf_counter() - t
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
            res["wall_s"] = wall
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
    oom = any("RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower() for s in tail)
    return {"success": False, "wall_s": wall, "returncode": proc.returncode,
            "error": ("out of memory: " if oom else "") + " | ".join(tail)[-1500:]}


def child_env(managed: bool, dry_run: bool, probe: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MEM_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if not managed:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # same growth policy as managed runs
    if probe:  # bytes_limit at fraction 1.0 = the device's whole memory
        env["XLA_CLIENT_MEM_FRACTION"] = "1.0"
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    return env


def fmt_gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def print_table(results: dict, device_bytes: int) -> None:
    print()
    print(f"{'config':<14}{'ok':<5}{'model GiB':>10}{'x dev':>7}{'peak GiB':>10}"
          f"{'compile s':>11}{'init s':>8}{'step s':>9}  note")
    for name, r in results.items():
        fp = r.get("compiled_footprint_bytes") or r.get("model", {}).get("estimated_bytes")
        step = r.get("step_median_s")
        note = "" if r.get("success") else (r.get("error") or "")[:60]
        print(f"{name:<14}{'yes' if r.get('success') else 'NO':<5}{fmt_gib(fp):>10}"
              f"{(fp / device_bytes if fp else 0):>7.2f}{fmt_gib(r.get('peak_bytes_in_use')):>10}"
              f"{r.get('compile_s', float('nan')):>11.1f}{r.get('init_s', float('nan')):>8.1f}"
              f"{(step if step is not None else float('nan')):>9.3f}  {note}")


def compare(results: dict) -> dict:
    def med(k):
        r = results.get(k, {})
        return r.get("step_median_s") if r.get("success") else None

    out = {}
    a, b = med("fit/plain"), med("fit/managed")
    if a and b:
        out["fit_managed_overhead_pct"] = 100.0 * (b / a - 1.0)
    a, b = med("big/managed"), med("big/advised")
    if a and b:
        out["big_advised_time_change_pct"] = 100.0 * (b / a - 1.0)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--child"], ["--probe"]):
        res = child(json.loads(argv[1])) if argv[0] == "--child" else probe()
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per config (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    ap.add_argument("--size-factor", type=float, default=1.5,
                    help=f"big model footprint / device memory, <= {MAX_SIZE_FACTOR}")
    ap.add_argument("--fit-factor", type=float, default=0.5,
                    help="fitting model footprint / device memory (default 0.5)")
    ap.add_argument("--width", type=int, default=0, help="layer width (default: by size)")
    ap.add_argument("--batch", type=int, default=0, help="batch size (default: by size)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per config")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run everything on CPU with a pretend 64 MiB device (tests the script)")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    if not 1.0 < args.size_factor <= MAX_SIZE_FACTOR:
        ap.error(f"--size-factor must be in (1, {MAX_SIZE_FACTOR}]: oversubscription with "
                 "managed memory must stay bounded")

    report: dict = {"script": "benchmarks/managed_memory_gpu.py", "argv": argv,
                    "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    info = run_child("--probe", {}, child_env(False, args.dry_run_cpu, probe=True), 180)
    report["device"] = info
    if args.dry_run_cpu:
        info["bytes_limit"] = 64 << 20
    elif info.get("platform") != "gpu" or not info.get("bytes_limit"):
        why = info.get("error") or f"JAX sees platform {info.get('platform')!r}"
        msg = (f"No NVIDIA GPU available to JAX ({why}); nothing to measure. This script is "
               "ready: run it on a machine with an NVIDIA GPU and the jax CUDA plugin.")
        print(msg)
        if args.out:
            report.update(status="skipped", reason=msg)
            args.out.write_text(json.dumps(report, indent=2))
        return 0
    device_bytes = int(info["bytes_limit"])

    # Size the models on the CPU (the parent never starts the GPU backend).
    os.environ["JAX_PLATFORMS"] = "cpu"
    size_factor = args.size_factor
    avail = host_mem_available()
    pool = size_factor + POOL_HEADROOM
    if not args.dry_run_cpu and avail is not None:
        excess = (pool - 1.0) * device_bytes * 1.25
        if excess > avail:
            size_factor = max(1.05, 1.0 + avail / (1.25 * device_bytes) - POOL_HEADROOM)
            pool = size_factor + POOL_HEADROOM
            print(f"note: host RAM available {fmt_gib(avail)} GiB cannot hold the excess of a "
                  f"{args.size_factor}x model; using {size_factor:.2f}x")
    report["host_mem_available"] = avail
    small = args.dry_run_cpu or device_bytes < 8 * GiB
    width = args.width or (256 if args.dry_run_cpu else 4096 if small else 8192)
    batch = args.batch or (256 if args.dry_run_cpu else 2048 if small else 4096)
    models = {
        "fit": size_model(int(args.fit_factor * device_bytes), width, batch),
        "big": size_model(int(size_factor * device_bytes), width, batch),
    }
    report.update(size_factor=size_factor, pool_fraction=pool, device_bytes=device_bytes,
                  models=models)
    print(f"device: {info.get('device_kind')} ({info.get('platform')}), bytes_limit "
          f"{fmt_gib(device_bytes)} GiB; host RAM available {fmt_gib(avail)} GiB")
    for k, m in models.items():
        print(f"model {k}: {m['depth']} layers x {m['width']}^2, batch {m['batch']}, "
              f"~{fmt_gib(m['estimated_bytes'])} GiB "
              f"({m['estimated_bytes'] / device_bytes:.2f} x device)")

    results: dict = {}
    for name in configs:
        size, mode = name.split("/")
        managed = mode != "plain"
        cfg = {
            "model": models[size], "managed": managed, "advise": mode == "advised",
            "pool": (pool if size == "big" else 1.0), "steps": args.steps,
            "warmup": args.warmup, "dry_run": args.dry_run_cpu,
        }
        print(f"running {name} ...", flush=True)
        r = run_child("--child", cfg, child_env(managed, args.dry_run_cpu), args.timeout)
        r["config"] = {k: v for k, v in cfg.items() if k != "model"}
        r["model"] = models[size]
        results[name] = r
        print(f"  {'ok' if r.get('success') else 'FAILED'}: step median "
              f"{r.get('step_median_s')} s {'' if r.get('success') else r.get('error', '')[:200]}",
              flush=True)
    report["results"] = results
    report["comparison"] = compare(results)
    report["status"] = "dry-run-cpu" if args.dry_run_cpu else "measured"
    print_table(results, device_bytes)
    for k, v in report["comparison"].items():
        print(f"{k}: {v:+.1f}%")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
