"""The Llama decoder's adam train step on one H100-80GB: optimizer state in host memory.

Compile only, on the deviceless H100 target (:mod:`jaxmem.targets`), with abstract state
(``jax.ShapeDtypeStruct``): nothing runs, nothing is initialised. For each size of the zoo's
Llama decoder (``llama``: unrolled layers, f32 parameters and adamw moments, bf16 compute)
at sequence 4096, batch 1, it compiles

- **plain**: ``jax.jit(step, donate_argnums=0)``;
- **jaxmem**: ``jaxmem.optimize(step)`` (residual recompute, state on the device);
- **jaxmem + state**: ``jaxmem.optimize(step, offload_state=True)`` (adam's moments in
  ``pinned_host``, streamed per layer, :mod:`jaxmem.state_offload`);

and records the compiled device peak (``argument + output + temp - alias``), the host bytes,
the bytes over the host link per step and their predicted time on the H100 and H200 device
profiles (:class:`jaxmem.DeviceProfile`), and whether the step fits the device's memory.

    nice python -m benchmarks.state_offload --sizes test,bench,1b,8b \\
        --out benchmarks/results/state_offload
    nice python -m benchmarks.state_offload --sizes 8b --layers 2   # a quick check first
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any

import jax

import jaxmem
from benchmarks import zoo
from jaxmem import measure
from jaxmem.costmodel import DeviceProfile
from jaxmem.measure import fmt_bytes

VARIANTS = ("plain", "jaxmem", "jaxmem + state")


def _row(variant: str, compiled: Any, secs: float, capacity: int, info: Any = None) -> dict:
    f = measure.figures(compiled)
    stats = compiled.memory_analysis()
    host = int(getattr(stats, "host_argument_size_in_bytes", 0)
               + getattr(stats, "host_output_size_in_bytes", 0)
               - getattr(stats, "host_alias_size_in_bytes", 0)
               + getattr(stats, "host_temp_size_in_bytes", 0))
    row = dict(variant=variant, peak=f.peak, argument=f.argument, temp=f.temp, host=host,
               fits=f.peak <= capacity, compile_s=round(secs, 1), link_bytes=0,
               transfer_s_h100=0.0, transfer_s_h200=0.0)
    if info is not None:
        row.update(link_bytes=info.link_bytes, state_bytes=info.nbytes, groups=info.groups,
                   largest_group=info.largest_group,
                   transfer_s_h100=info.transfer_time("h100"),
                   transfer_s_h200=info.transfer_time("h200"))
    return row


def measure_size(size: str, target: str = "h100", seq: int = 4096, batch: int = 1,
                 layers: int | None = None, verify: bool = False) -> dict:
    """Plain, jaxmem and jaxmem + state offload for one Llama size on ``target``."""
    t = jaxmem.targets.require(target)
    over = dict(seq=seq) | ({} if layers is None else dict(layers=layers))
    w = zoo.make("llama", size=size, batch=batch, abstract=True, **over)
    args = t.place(w.args)
    n_params = sum(x.size for x in jax.tree.leaves(w.state["params"]))
    rows = []
    t0 = time.perf_counter()
    rows.append(_row("plain", measure.compile(jax.jit(w.step, donate_argnums=0).lower(*args)),
                     time.perf_counter() - t0, t.memory_bytes))
    for variant, off in (("jaxmem", False), ("jaxmem + state", True)):
        t0 = time.perf_counter()
        opt = jaxmem.optimize(w.step, offload_state=off, verify=verify)
        lowered = opt.lower(*args)
        compiled = lowered.compile()
        plan = opt.plan(*args) if off else None
        rows.append(_row(variant, compiled, time.perf_counter() - t0, t.memory_bytes,
                         plan.state_offload if plan is not None else None))
    return dict(model="llama", size=size, layers=layers or w.n_blocks, params=int(n_params),
                seq=seq, batch=batch, target=target, capacity=t.memory_bytes, rows=rows)


def table(results: list[dict]) -> str:
    """Markdown: one row per size and variant."""
    h100, h200 = DeviceProfile.get("h100"), DeviceProfile.get("h200")
    lines = [f"Llama decoder adam(w) train step, seq {results[0]['seq'] if results else 4096}, "
             f"batch 1, compiled for the H100-80GB target (compile only). Host link "
             f"{h100.host_bw / 1e9:.0f} GB/s (h100 profile), {h200.host_bw / 1e9:.0f} GB/s "
             "(h200).", "",
             "| size | params | variant | device peak | fits 80 GB | host memory | "
             "host link / step | transfer H100 | transfer H200 | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["rows"]:
            lines.append(
                f"| {r['size']} ({r['layers']} layers) | {r['params'] / 1e9:.2f} B | "
                f"{row['variant']} | {fmt_bytes(row['peak'])} | "
                f"{'yes' if row['fits'] else 'no'} | {fmt_bytes(row['host'])} | "
                f"{fmt_bytes(row['link_bytes'])} | {1e3 * row['transfer_s_h100']:.0f} ms | "
                f"{1e3 * row['transfer_s_h200']:.0f} ms | {row['compile_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="test,bench,1b,8b")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--verify", action="store_true",
                    help="let optimize compile its auto candidates (slow at 8B)")
    ap.add_argument("--out", default=None, help="folder for results.json and results.md")
    a = ap.parse_args(argv)
    results = []
    for size in a.sizes.split(","):
        results.append(measure_size(size, a.target, a.seq, layers=a.layers, verify=a.verify))
        print(table(results[-1:]), flush=True)
        if a.out:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            meta = dict(jax=jax.__version__, date=datetime.date.today().isoformat(),
                        command="python -m benchmarks.state_offload " + " ".join(argv or []))
            (out / "results.json").write_text(json.dumps(dict(meta=meta, results=results),
                                                         indent=1))
            (out / "results.md").write_text(table(results) + "\n")


if __name__ == "__main__":
    main()
