"""The Llama decoder's adam train step on one H100-80GB: optimizer state in host memory.

Compile only, on the deviceless H100 target (:mod:`jaxmem.targets`), with abstract state
(``jax.ShapeDtypeStruct``): nothing runs, nothing is initialised. For each size of the zoo's
Llama decoder (``llama``: unrolled layers, f32 parameters and adamw moments, bf16 compute)
at sequence 4096, batch 1, it compiles

- **plain**: ``jax.jit(step)``, the state donated (jaxmem's baseline compile);
- **jaxmem**: ``jaxmem.optimize(step)`` (residual recompute, state on the device);
- **jaxmem + state**: ``jaxmem.optimize(step, offload_state=True)`` (adam's moments in
  ``pinned_host``, streamed per layer, :mod:`jaxmem.memory.state_offload`);
- **jaxmem + state + params**: ``offload_state="all"`` (the f32 parameters in host memory
  too, fetched before each use, :mod:`jaxmem.memory.param_offload`; ``--variants`` picks it);

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
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxmem.measure import fmt_bytes

import jaxmem
from benchmarks import zoo
from jaxmem import measure
from jaxmem.analyzing.costmodel import DeviceProfile

VARIANTS = ("plain", "jaxmem", "jaxmem + state", "jaxmem + state + params", "remat",
            "remat + state")
DEFAULT = ("plain", "jaxmem", "jaxmem + state", "remat", "remat + state")


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
                   largest_group=info.largest_group, param_bytes=info.param_bytes,
                   fetch_bytes=info.fetch_bytes,
                   transfer_s_h100=info.transfer_time("h100"),
                   transfer_s_h200=info.transfer_time("h200"))
    return row


def fsdp_sharding(mesh: Any, axis: str = "data") -> Any:
    """``leaf -> NamedSharding`` for FSDP on ``mesh``: each leaf split over ``axis`` along
    its largest dimension the axis size divides (the batch along its first), else
    replicated; parameters, gradients and moments alike."""
    n = mesh.shape[axis]

    def spec(x: Any) -> Any:
        shape = tuple(getattr(x, "shape", ()))
        for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[d] >= n and shape[d] % n == 0:
                return NamedSharding(mesh, P(*([None] * d), axis))
        return NamedSharding(mesh, P())
    return spec


def fsdp_args(target: Any, args: Any) -> Any:
    """``args`` placed on all of ``target``'s devices, FSDP-sharded (:func:`fsdp_sharding`
    over a ``data`` axis)."""
    return target.place(args, fsdp_sharding(Mesh(np.array(target.devices()), ("data",))))


def measure_size(size: str, target: str = "h100", seq: int = 4096, batch: int = 1,
                 layers: int | None = None, verify: bool = False, remat: bool = True,
                 variants: tuple[str, ...] = DEFAULT, fsdp: int = 0) -> dict:
    """Plain, jaxmem and jaxmem + state offload for one Llama size on ``target``; with
    ``remat``, also each layer under ``nn.remat(nothing_saveable)`` (MaxText's ``"full"``
    remat policy: only layer inputs kept), plain and with the state offloaded.

    ``fsdp=N``: on ``N`` devices of the target, the state sharded over them
    (:func:`fsdp_sharding`) and ``batch`` sequences per device; peaks are per device."""
    t = jaxmem.targets.require(f"{target}:{fsdp}" if fsdp else target)
    over = dict(seq=seq) | ({} if layers is None else dict(layers=layers))
    w = zoo.make("llama", size=size, batch=batch * max(fsdp, 1), abstract=True, **over)
    args = fsdp_args(t, w.args) if fsdp else t.place(w.args)
    n_params = sum(x.size for x in jax.tree.leaves(w.state["params"]))
    rows = []
    for variant, mode in (("jaxmem + state", True), ("jaxmem + state + params", "all")):
        if variant not in variants:
            continue
        t0 = time.perf_counter()
        opt = jaxmem.optimize(w.step, offload_state=mode, verify=verify)
        plan = opt.plan(*args)  # compiles the step and plain jax.jit (its baseline)
        secs = time.perf_counter() - t0
        rows.append(_row(variant, opt.lower(*args).compile(), secs, t.memory_bytes,
                         plan.state_offload))
        print(f"{size} {layers} layers {variant}: {fmt_bytes(rows[-1]['peak'])}", flush=True)
        if "plain" in variants and not any(r["variant"] == "plain" for r in rows):
            rows.insert(0, _plain_row(plan.baseline, t.memory_bytes))
    if "jaxmem" in variants:
        t0 = time.perf_counter()
        kept = jaxmem.optimize(w.step, verify=verify).lower(*args).compile()
        rows.insert(int(rows[0]["variant"] == "plain") if rows else 0,
                    _row("jaxmem", kept, time.perf_counter() - t0, t.memory_bytes))
    if remat and "remat" in variants:
        rw = w.with_remat(jax.checkpoint_policies.nothing_saveable)
        t0 = time.perf_counter()
        ropt = jaxmem.optimize(rw.step, offload_state=True, strategy="none")
        rplan = ropt.plan(*args)
        rows.append(_plain_row(rplan.baseline, t.memory_bytes, "remat"))
        rows.append(_row("remat + state", ropt.lower(*args).compile(),
                         time.perf_counter() - t0, t.memory_bytes, rplan.state_offload))
    return dict(model="llama", size=size, layers=layers or w.n_blocks, params=int(n_params),
                seq=seq, batch=batch, target=target, capacity=t.memory_bytes, rows=rows,
                fsdp=fsdp)


def _plain_row(fig: Any, capacity: int, variant: str = "plain") -> dict:
    return dict(variant=variant, peak=fig.peak, argument=fig.argument, temp=fig.temp, host=0,
                fits=fig.peak <= capacity, compile_s=None, link_bytes=0,
                transfer_s_h100=0.0, transfer_s_h200=0.0)


def extrapolate(a: dict, b: dict, layers: int, params: int) -> dict:
    """Rows at ``layers`` layers, linear in the layer count from two measured results of
    the same size (every layer of the unrolled decoder is the same)."""
    rows = []
    for ra, rb in zip(a["rows"], b["rows"], strict=True):
        def at(key: str, ra: dict = ra, rb: dict = rb) -> float:
            slope = (rb.get(key, 0) - ra.get(key, 0)) / (b["layers"] - a["layers"])
            return ra.get(key, 0) + slope * (layers - a["layers"])
        row = dict(ra, compile_s=None)
        for key in ("peak", "argument", "temp", "host", "link_bytes", "transfer_s_h100",
                    "transfer_s_h200", "state_bytes", "param_bytes", "fetch_bytes"):
            if key in ra:
                row[key] = at(key)
        row["fits"] = row["peak"] <= a["capacity"]
        rows.append(row)
    return dict(a, layers=layers, params=params, rows=rows,
                extrapolated_from=[a["layers"], b["layers"]])


def table(results: list[dict]) -> str:
    """Markdown: one row per size and variant."""
    h100, h200 = DeviceProfile.get("h100"), DeviceProfile.get("h200")
    fsdp = results[0].get("fsdp", 0) if results else 0
    where = (f"FSDP over {fsdp} H100-80GB devices (state sharded, {results[0]['batch']} "
             "sequence(s) per device; peaks and host memory per device)" if fsdp else
             "batch 1, the H100-80GB target")
    lines = [f"Llama decoder adam(w) train step, seq {results[0]['seq'] if results else 4096}, "
             f"{where}, compiled without the device (compile only). Host link "
             f"{h100.host_bw / 1e9:.0f} GB/s (h100 profile), {h200.host_bw / 1e9:.0f} GB/s "
             "(h200).", "",
             "| size | params | variant | device peak | fits 80 GB | host memory | "
             "host link / step | transfer H100 | transfer H200 | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        how = (f", linear from {r['extrapolated_from'][0]} and {r['extrapolated_from'][1]}"
               if "extrapolated_from" in r else "")
        for row in r["rows"]:
            lines.append(
                f"| {r['size']} ({r['layers']} layers{how}) | {r['params'] / 1e9:.2f} B | "
                f"{row['variant']} | {fmt_bytes(int(row['peak']))} | "
                f"{'yes' if row['fits'] else 'no'} | {fmt_bytes(int(row['host']))} | "
                f"{fmt_bytes(int(row['link_bytes']))} | {1e3 * row['transfer_s_h100']:.0f} ms | "
                f"{1e3 * row['transfer_s_h200']:.0f} ms | {row['compile_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="test,bench,1b,8b")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", default=None,
                    help="override the layer count; two counts 'a,b' also extrapolate each "
                         "size linearly to its full depth (a full 8b compile takes long)")
    ap.add_argument("--verify", action="store_true",
                    help="let optimize compile its auto candidates (slow at 8B)")
    ap.add_argument("--no-remat", action="store_true", help="skip the per-layer remat rows")
    ap.add_argument("--variants", default=",".join(DEFAULT),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (remat: both remat rows)")
    ap.add_argument("--fsdp", type=int, default=0,
                    help="shard the state over N devices of the target (FSDP), one sequence "
                         "per device; figures per device")
    ap.add_argument("--out", default=None, help="folder for results.json and results.md")
    a = ap.parse_args(argv)
    counts = [None] if a.layers is None else [int(x) for x in a.layers.split(",")]
    results = []
    for size in a.sizes.split(","):
        mine = [measure_size(size, a.target, a.seq, layers=n, verify=a.verify,
                             remat=not a.no_remat, variants=tuple(a.variants.split(",")),
                             fsdp=a.fsdp)
                for n in counts]
        results += mine
        if len(mine) == 2:
            cfg = zoo.llama.model_config(size)
            results.append(extrapolate(mine[0], mine[1], cfg.layers,
                                       zoo.llama.param_count(cfg)))
        print(table(results[-len(mine) - (len(mine) == 2):]), flush=True)
        if a.out:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            meta = dict(jax=jax.__version__, date=datetime.date.today().isoformat(),
                        command="python -m benchmarks.state_offload " + " ".join(argv or [])
                        if argv else "python -m benchmarks.state_offload")
            (out / "results.json").write_text(json.dumps(dict(meta=meta, results=results),
                                                         indent=1))
            (out / "results.md").write_text(table(results) + "\n")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
