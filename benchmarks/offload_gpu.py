"""Host offload on a real GPU: ``python benchmarks/offload_gpu.py [--depth 16] [--out DIR]``.

Runs a residual MLP train step (wide hidden layers, so the residuals dominate) six ways, each
in its own subprocess so that ``memory_stats()['peak_bytes_in_use']`` is that variant's own
peak:

- ``plain``: ``jax.jit(step)``;
- ``auto``: ``jaxmem.optimize(step)`` (MEDL recompute, no offload);
- ``offload``: ``jaxmem.optimize(step, offload=True)`` (the auto plan plus offloads the cost
  model says hide under compute), prefetching one backward region early (the default);
- ``offload_noprefetch``: the same plan rewritten with ``prefetch=False`` (fetched in the
  region that reads it);
- ``tagged``: every block's hidden activation tagged with ``jaxmem.offload_name``;
- ``tagged_unsettled``: the same plan rewritten with ``settle_host=False`` (host copies not
  tied into the forward pass, :mod:`jaxmem.rewriting.settle`), to see what settling buys.

Per variant: real peak (``peak_bytes_in_use``; marked "(compile)" where compiling, which
autotunes on the device, reached it before the steps ran), compiled figures
(``memory_analysis``, with ``host_temp_size_in_bytes``), the number of ``pinned_host``
placements in the lowered text, median step time, and the cost model's predicted round-trip
and exposed transfer time on the detected profile. Overlap evidence: the measured step-time
difference ``offload - auto`` against the full round-trip time ``2 x bytes / host
bandwidth``; a difference well under the round trip means the copies ran under compute.
Writes ``offload_gpu.json`` and ``.md`` under ``--out`` (default ``results/offload_gpu``).

Exits 0 with a message when there is no GPU. Uses only public JAX API plus jaxmem, so it runs
unchanged on jax 0.10 and 0.11.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "auto", "offload", "offload_noprefetch", "tagged", "tagged_unsettled")


def _gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _workload(depth: int, batch: int, width: int, hidden: int, tag: bool) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    import jaxmem

    keys = jax.random.split(jax.random.PRNGKey(0), 2 * depth)
    ws = [(jax.random.normal(keys[2 * i], (width, hidden), jnp.bfloat16) / width ** 0.5,
           jax.random.normal(keys[2 * i + 1], (hidden, width), jnp.bfloat16) / hidden ** 0.5)
          for i in range(depth)]
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width), jnp.bfloat16)

    def loss(ws: Any, x: Any) -> Any:
        h = x
        for i, (w1, w2) in enumerate(ws):
            with jax.named_scope(f"block{i}"):
                a = h @ w1
                if tag:
                    a = jaxmem.offload_name(a, f"hidden{i}")
                h = h + jax.nn.gelu(a) @ w2
        return jnp.mean(h.astype(jnp.float32) ** 2)

    def step(ws: Any, x: Any) -> Any:
        val, g = jax.value_and_grad(loss)(ws, x)
        return jax.tree.map(lambda w, gw: w - 1e-3 * gw, ws, g), val

    return step, (ws, x)


def run_variant(name: str, depth: int, batch: int, width: int, hidden: int,
                iters: int) -> dict[str, Any]:
    import jax
    from jaxmem.measure import figures

    import jaxmem
    from jaxmem.planning.budget import CostModel

    step, args = _workload(depth, batch, width, hidden, tag=name.startswith("tagged"))
    out: dict[str, Any] = dict(variant=name, jax=jax.__version__,
                               device=jax.devices()[0].device_kind)
    plan = None
    if name == "plain":
        fn = jax.jit(step)
        lowered = fn.lower(*args)
    else:
        opt = jaxmem.optimize(step, offload=name in ("offload",), donate_argnums=())
        plan = opt.plan(*args)
        if name in ("offload_noprefetch", "tagged_unsettled"):
            if name == "offload_noprefetch":
                opt = jaxmem.optimize(step, offload=True, donate_argnums=())
                plan = opt.plan(*args)
            from jaxmem.rewriting.rewrite import rewrite

            prog = opt.analysis(*args).program
            res = frozenset(r.value for r in opt.analysis(*args).residuals)
            raw = jax.jit(rewrite(prog, plan.recompute, plan.offload, res,
                                  prefetch=name != "offload_noprefetch",
                                  settle_host=name != "tagged_unsettled"))
            flat = jax.tree.leaves(args)
            fn = lambda *a: raw(*jax.tree.leaves(a))  # noqa: E731
            lowered = raw.lower(*flat)
        else:
            fn = opt
            lowered = opt.lower(*args)
        analysis = opt.analysis(*args)
        model = CostModel(analysis)
        ev = model.evaluate(plan.recompute, plan.offload)
        p = model.profile
        out.update(profile=p.name, n_recompute=len(plan.recompute), n_offload=len(plan.offload),
                   offload_bytes=ev.offload_bytes,
                   pred_roundtrip_ms=1e3 * 2 * p.transfer_time(ev.offload_bytes),
                   pred_exposed_transfer_ms=1e3 * ev.transfer_time,
                   pred_recompute_ms=1e3 * (ev.time - ev.transfer_time),
                   pred_step_ms=1e3 * model.step_time)
    text = lowered.as_text()
    out["pinned_host_placements"] = text.count('_xla_buffer_placement = "pinned_host"')
    f = figures(lowered.compile())
    out.update(compiled_peak=f.peak, host_temp=f.host_temp, flops=f.flops)
    jax.block_until_ready(args)
    # compiling (autotuning) allocates too: the run's own peak is known only if it is higher
    out["peak_before_run"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    res = fn(*args)
    jax.block_until_ready(res)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    out["step_ms"] = 1e3 * statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--out", default="results/offload_gpu")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: one variant, JSON out
    ns = ap.parse_args(argv)
    if ns.variant:
        print("RESULT " + json.dumps(run_variant(ns.variant, ns.depth, ns.batch, ns.width,
                                                 ns.hidden, ns.iters)))
        return 0
    if not _gpu():
        print("offload_gpu.py: no GPU found (jax.devices('gpu') is empty); this benchmark "
              "measures real device peaks and transfer overlap and needs a CUDA GPU. On CPU, "
              "see tests/test_offload.py (cross-lowering for CUDA) and benchmarks/budget.py.")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    rows = []
    for v in ns.variants:
        cmd = [sys.executable, __file__, "--variant", v, "--depth", str(ns.depth), "--batch",
               str(ns.batch), "--width", str(ns.width), "--hidden", str(ns.hidden),
               "--iters", str(ns.iters)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            rows.append(dict(variant=v, error=(p.stderr or p.stdout)[-800:]))
            print(f"[{v}] failed:\n{(p.stderr or p.stdout)[-800:]}", file=sys.stderr)
            continue
        r = json.loads(line[7:])
        r["wall_s"] = round(time.perf_counter() - t, 1)
        rows.append(r)
        print(f"[{v}] {r}", file=sys.stderr, flush=True)
    by = {r["variant"]: r for r in rows if "error" not in r}
    gib = 2**30
    lines = ["| variant | real peak GiB | compiled peak GiB | host temp GiB | pinned_host | "
             "step ms | offloaded GiB | pred. round trip ms | pred. exposed ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | error | | | | | | | |")
            continue
        pk = r.get("peak_bytes_in_use")
        lines.append(
            f"| {r['variant']} | {pk / gib:.2f}"
            f"{' (compile)' if pk == r.get('peak_before_run') else ''} | "
            f"{r['compiled_peak'] / gib:.2f} | "
            f"{r['host_temp'] / gib:.2f} | {r['pinned_host_placements']} | {r['step_ms']:.2f} | "
            f"{r.get('offload_bytes', 0) / gib:.2f} | {r.get('pred_roundtrip_ms', 0):.2f} | "
            f"{r.get('pred_exposed_transfer_ms', 0):.2f} |" if pk is not None else
            f"| {r['variant']} | - | {r['compiled_peak'] / gib:.2f} | | | "
            f"{r['step_ms']:.2f} | | | |")
    for v in ("offload", "offload_noprefetch", "tagged"):
        if v in by and "auto" in by and by[v].get("offload_bytes"):
            d = by[v]["step_ms"] - by["auto"]["step_ms"]
            rt = by[v]["pred_roundtrip_ms"]
            lines.append(f"\n{v}: measured step time {d:+.2f} ms vs auto; a full round trip "
                         f"of {by[v]['offload_bytes'] / gib:.2f} GiB is {rt:.2f} ms at the "
                         f"profile's host bandwidth: {100 * max(d, 0) / rt:.0f}% of it exposed "
                         f"(model: {by[v]['pred_exposed_transfer_ms']:.2f} ms).")
    md = "\n".join(lines) + "\n"
    print(md)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload_gpu.json").write_text(json.dumps(dict(args=vars(ns), rows=rows), indent=1))
    (out / "offload_gpu.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
