"""The largest batch of a scanned Llama decoder that fits a device: plain jit, a MaxText
preset, jaxmem.

``python -m benchmarks.llm_maxbatch [--size 1b] [--target h100] [--presets full,save_qkv_proj]
[--layers N] [--seq N] [--attention cudnn] [--chunk-loss 8] [--offload]
[--offload-state auto] [--start N] [--max-batch 64] [--probe VARIANT:B1,B2] [--report]
[--out results/llm_maxbatch]``

Compile-only (abstract arguments, ``jaxmem.targets``): the budget is the target's device
memory (``device_memory_size`` of its config: 79.1 GiB on the H100 target), the step is the
zoo's ``llama_scan`` (sequence 4096 at ``1b``; adamw, state donated). For ``plain`` and each
preset (``nn.remat(policy=preset)`` around each scanned layer, as MaxText applies it) the
peak is compiled at batches 1 and 2; the largest batch that fits is predicted from those two
as if peaks were affine in the batch, and searched from there (galloping, then bisecting).
``jaxmem`` is ``jaxmem.optimize(step, budget=<device memory>)`` (with ``offload=True`` and
``offload_state=...`` where asked), searched the same way from the best preset's batch (a
batch fits when planning does not raise ``BudgetError``). ``floor`` is the bound computed
from the shapes (:func:`floor`). ``--attention cudnn`` is flash attention
(``jax.nn.dot_product_attention(implementation="cudnn")``; cuDNN must be importable,
docs/llm.md). Compiles at this size take minutes on a small CPU: every compile is appended
to ``<out>/points.jsonl`` as it finishes, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax

import jaxmem
from benchmarks import zoo
from benchmarks.maxbatch import DONATE, plan_under
from benchmarks.zoo.maxtext_presets import PRESETS
from jaxmem import measure

CHUNK_LOSS = 0  # --chunk-loss: the zoo Llama's loss by jaxmem.chunked_cross_entropy
OVERRIDES: dict[str, Any] = {}  # --attention, --seq: zoo config overrides
JAXMEM_OPTIONS: dict[str, Any] = {}  # --offload: jaxmem.optimize keywords


def _args(size: str, batch: int, policy: Any, target: str, layers: int | None) -> Any:
    over = {"layers": layers} if layers else {}
    over.update(OVERRIDES)
    if CHUNK_LOSS:
        over["chunk_loss"] = CHUNK_LOSS
    w = zoo._make("llama_scan", size, batch, policy, 0, abstract=True,  # noqa: SLF001
                  overrides=over)
    return w, jaxmem.targets.place(w.args, target)


def peak_of(variant: str, size: str, batch: int, target: str, budget: int,
            layers: int | None) -> tuple[int | None, str]:
    """Compiled peak (None: jaxmem raised BudgetError) and a note."""
    if variant == "jaxmem":
        w, args = _args(size, batch, None, target, layers)
        _, plan, error = plan_under(w.step, args, budget, **JAXMEM_OPTIONS)
        if error is not None:
            return None, f"BudgetError (minimum {measure.fmt_bytes(error.minimum_bytes)})"
        note = "; ".join(n for n in plan.notes if "scan bodies" in n or "optimizer state" in n)
        return plan.compiled.peak, note  # .plan() compiles the step that runs
    w, args = _args(size, batch, None if variant == "plain" else PRESETS[variant], target,
                    layers)
    jitted = jax.jit(w.step, donate_argnums=DONATE)
    return measure.figures(measure.compile(jitted.lower(*args))).peak, ""


def floor(size: str, target: str, budget: int, layers: int | None) -> dict[str, Any]:
    """The largest batch any plan could fit, from the shapes: what must be on the device at
    the backward pass's busiest moment with every layer recomputed from an input held in
    host memory.

    - the state (parameters, optimizer moments, step) and one gradient of the parameters;
    - per sequence: one layer's largest value (of the scan body's values at batch 1,
      jaxmem's ``body_values``, per layer): recomputing a layer makes it at least once;
    - per sequence: one chunk of the loss's logits in f32 (``sequence / chunks`` tokens
      times the vocabulary; the whole sequence without ``--chunk-loss``).

    ``batch_moments_on_host``: the same with the optimizer's moments in host memory.

    A lower bound on the memory of every plan (no cotangents, no workspace, nothing else
    of the layer), so an upper bound on its batch. (The sum of a layer's values is not a
    bound: a recomputed layer's backward does not hold them all at once, and MaxText's
    offloaded layer input fits more sequences than that sum allows.)
    """
    from jaxmem.memory.state_offload import MIN_BYTES
    from jaxmem.rewriting.scans import LAYER_KEY, body_values
    from jaxmem.tracing.primitives import nbytes
    from jaxmem.tracing.program import trace

    w, args = _args(size, 1, None, target, layers)
    state = sum(nbytes(x) for x in jax.tree.leaves(w.args[0]))
    params = sum(nbytes(x) for x in jax.tree.leaves(w.args[0]["params"]))
    values = [v for v in body_values(trace(w.step, *w.args)) if v.key != LAYER_KEY]
    cfg = zoo.config("llama_scan", size)
    cfg.update(OVERRIDES)
    n_layers = layers or cfg["layers"]
    layer = max(v.nbytes for v in values) // n_layers
    tokens = cfg["seq"] // CHUNK_LOSS if CHUNK_LOSS else cfg["seq"]
    loss = tokens * cfg["vocab"] * 4
    batch = max(int((budget - state - params) // (layer + loss)), 0)
    # With the optimizer's moments in host memory (offload_state=True): the parameters,
    # their gradient and the leaves too small to offload stay.
    moments = sum(nbytes(x) for x in jax.tree.leaves(w.args[0]["opt_state"])
                  if nbytes(x) >= MIN_BYTES)
    on_host = max(int((budget - state + moments - params) // (layer + loss)), 0)
    return {"variant": "floor", "batch": batch, "batch_moments_on_host": on_host,
            "state": state, "gradient": params, "moments": moments,
            "layer_per_sequence": layer, "loss_chunk_per_sequence": loss,
            "peak": state + params + batch * (layer + loss)}


def _offloaded_names(variant: str, note: str) -> tuple[str, ...]:
    if variant in PRESETS:
        return PRESETS[variant].offload
    if "offload: " not in note:
        return ()
    names = note.split("offload: ", 1)[1].split("; base", 1)[0]
    return tuple(n.strip() for n in names.split(",") if n.strip() not in ("", "-"))


def _state_link_bytes(note: str) -> int:
    """Bytes over the host link per step for the optimizer state, from the plan's note
    (``StateOffload.describe``: "... 119.66 GiB over the host link per step ..."); 0 when
    the state stays on the device."""
    import re

    m = re.search(r"optimizer state in host memory:.*?([\d.]+) (B|KiB|MiB|GiB|TiB) over the "
                  r"host link per step", note)
    if m is None:
        return 0
    unit = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}[m.group(2)]
    return int(float(m.group(1)) * unit)


def costs(variant: str, batch: int, note: str, size: str, target: str,
          layers: int | None) -> dict[str, Any]:
    """The predicted step time of ``variant``'s row at ``batch`` on the target's profile,
    from traces (no compile): its FLOPs (jaxmem's count, recompute included) against plain
    jit's at the same batch, its host-link bytes (the offloaded layer values' bytes, each
    way, and the optimizer state's fetch and write-back where it streams from host memory)
    and whether the step's compute covers their round trip. The jaxmem row's policy is read
    from its note."""
    from jaxmem.analyzing.costmodel import DeviceProfile
    from jaxmem.rewriting.scans import body_values
    from jaxmem.tracing.program import trace

    prof = DeviceProfile.get(jaxmem.targets.get(target).profile)
    w, _ = _args(size, batch, None, target, layers)
    plain = trace(w.step, *w.args)
    by_name = {v.key[1]: v.nbytes for v in body_values(plain) if v.key[0] == "name"}
    if variant == "jaxmem":
        from jaxmem import _jax
        from jaxmem.rewriting.scans import BodyPolicy
        keep = note.split("scan bodies keep: ", 1)[1].split(";", 1)[0] if "keep: " in note else ""
        policy = BodyPolicy("row", tuple(("name", n.strip()) for n in keep.split(",")
                                         if n.strip() not in ("", "-")),
                            tuple(("name", n) for n in _offloaded_names(variant, note)))
        with _jax.checkpointed_scan_bodies(policy):
            flops = trace(w.step, *w.args).flops
    elif variant == "plain":
        flops = plain.flops
    else:
        wv, _ = _args(size, batch, PRESETS[variant], target, layers)
        flops = trace(wv.step, *wv.args).flops
    host = sum(by_name.get(n, 0) for n in _offloaded_names(variant, note))
    state = _state_link_bytes(note)  # the optimizer state's fetch and write-back
    compute = flops / prof.flops_per_s
    link = prof.transfer_time(2 * host + state)
    base = plain.flops / prof.flops_per_s
    extra = (flops - plain.flops) / prof.flops_per_s + max(link - compute, 0.0)
    return {"flops": flops, "plain_flops": plain.flops, "host_bytes": host,
            "state_link_bytes": state,
            "compute_s": compute, "link_s": link, "hidden": link <= compute,
            "overhead": extra / base if base else 0.0, "profile": prof.name}


def report(out: Path, size: str, target: str, layers: int | None, seq: int) -> str:
    """``<out>/report.md``: each variant's largest batch from ``points.jsonl``, its peak, and
    its predicted step time (:func:`costs`), beside the floor (:func:`floor`)."""
    rows = [json.loads(line) for line in (out / "points.jsonl").open()]
    best: dict[str, dict[str, Any]] = {}
    after: dict[str, dict[str, Any]] = {}
    for r in rows:
        if (r.get("variant") != "floor" and r.get("fits") and r.get("peak")
                and r["batch"] > best.get(r["variant"], {"batch": 0})["batch"]):
            best[r["variant"]] = r
    for r in rows:
        b = best.get(r.get("variant"))
        if b and not r.get("fits") and r["batch"] == b["batch"] + 1:
            after[r["variant"]] = r
    summary = json.loads((out / "summary.json").read_text())
    bound = summary.get("floor") or floor(size, target, summary["budget"], layers)
    gib = 2 ** 30
    lines = ["| step | batch | tokens | peak GiB | next batch | FLOPs over plain | host link "
             "each way | round trip / compute | predicted overhead |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    table = []
    for v, r in sorted(best.items(), key=lambda kv: kv[1]["batch"]):
        c = costs(v, r["batch"], r.get("note", ""), size, target, layers)
        nxt = after.get(v)
        nxt_s = ("-" if nxt is None else f"{nxt['batch']}: " + (
            f"{nxt['peak'] / gib:.2f} GiB" if nxt.get("peak") else nxt.get("note", "")))
        table.append({"variant": v, "batch": r["batch"], "peak": r["peak"], **c})
        lines.append(
            f"| {v} | {r['batch']} | {r['batch'] * seq:,} | {r['peak'] / gib:.2f} | {nxt_s} | "
            f"{100 * (c['flops'] / c['plain_flops'] - 1):+.1f}% | "
            f"{c['host_bytes'] / gib:.2f} GiB"
            + (f" + state {c['state_link_bytes'] / 2 / gib:.2f} GiB" if c["state_link_bytes"]
               else "")
            + f" | {1e3 * c['link_s']:.0f} / "
            f"{1e3 * c['compute_s']:.0f} ms | {100 * c['overhead']:+.1f}% |")
    lines.append(f"| floor (from the shapes) | {bound['batch']} | {bound['batch'] * seq:,} | "
                 f"{bound['peak'] / gib:.2f} | moments in host memory: "
                 f"{bound['batch_moments_on_host']} | | | | |")
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"rows": table, "floor": bound}, indent=2))
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_maxbatch",
                                description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1b")
    p.add_argument("--target", default="h100")
    p.add_argument("--presets", default="full")
    p.add_argument("--layers", type=int, help="override the size's layer count")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--no-jaxmem", action="store_true")
    p.add_argument("--chunk-loss", type=int, default=0, help="token chunks of the loss "
                   "(jaxmem.chunked_cross_entropy in place of the logits' cross-entropy)")
    p.add_argument("--attention", default="softmax", help="the zoo Llama's attention: "
                   "softmax (materialised scores) or cudnn (flash attention; needs cuDNN, "
                   "docs/llm.md)")
    p.add_argument("--seq", type=int, help="override the size's sequence length")
    p.add_argument("--offload", action="store_true",
                   help="jaxmem.optimize(..., offload=True): residuals and layer inputs may go "
                   "to pinned_host")
    p.add_argument("--offload-state", default=None, choices=["auto", "opt", "all"],
                   help="jaxmem.optimize(..., offload_state=...): 'auto' lets the budget "
                   "move adam's moments to pinned_host when nothing else fits")
    p.add_argument("--start", type=int, help="the jaxmem search's first batch (default: the "
                   "best preset's)")
    p.add_argument("--probe", metavar="VARIANT:B1,B2,...", help="no search: compile VARIANT "
                   "(plain, a preset, jaxmem) at each batch and append the points")
    p.add_argument("--report", action="store_true", help="no search: write <out>/report.md "
                   "from <out>/points.jsonl, with each row's predicted step time")
    p.add_argument("--out", type=Path, default=Path("results/llm_maxbatch"))
    a = p.parse_args(argv)
    global CHUNK_LOSS
    CHUNK_LOSS = a.chunk_loss
    OVERRIDES.clear()
    if a.attention != "softmax":
        OVERRIDES["attention"] = a.attention
    if a.seq:
        OVERRIDES["seq"] = a.seq
    JAXMEM_OPTIONS.clear()
    if a.offload:
        JAXMEM_OPTIONS["offload"] = True
    if a.offload_state:
        JAXMEM_OPTIONS["offload_state"] = a.offload_state
    setting = {"attention": a.attention, "seq": a.seq, "offload": a.offload,
               "offload_state": a.offload_state}
    if a.report:
        seq = a.seq or zoo.config("llama_scan", a.size)["seq"]
        print(report(a.out, a.size, a.target, a.layers, seq))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    budget = int(jaxmem.targets.get(a.target).memory_bytes)
    points = a.out / "points.jsonl"
    best: dict[str, int] = {}

    def point(variant: str, batch: int) -> bool:
        t = time.perf_counter()
        peak, note = peak_of(variant, a.size, batch, a.target, budget, a.layers)
        fits = peak is not None and peak <= budget
        row = {"variant": variant, "size": a.size, "layers": a.layers, "target": a.target,
               "chunk_loss": a.chunk_loss, **setting,
               "batch": batch, "peak": peak, "budget": budget, "fits": fits, "note": note,
               "seconds": round(time.perf_counter() - t, 1)}
        with points.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), file=sys.stderr, flush=True)
        if fits:
            best[variant] = max(best.get(variant, 0), batch)
        return fits

    def search(variant: str, lo: int, b: int) -> None:
        """The largest batch that fits, from ``lo`` (fits, or 0) and a first guess ``b``:
        gallop up while it fits (+1, +2, +4, ...), then bisect. Peaks are not affine in
        the batch at this size (XLA:GPU's own rematerialisation, the offloads), so the
        affine guess from batches 1 and 2 is only where the search starts."""
        hi, step = a.max_batch + 1, 1
        while lo < b < hi:
            if point(variant, b):
                lo, b, step = b, min(b + step, hi), step * 2
            else:
                hi = b
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if point(variant, mid):
                lo = mid
            else:
                hi = mid

    if a.probe:
        variant, batches = a.probe.split(":", 1)
        for b in batches.split(","):
            point(variant, int(b))
        return 0
    for variant in ["plain", *[s for s in a.presets.split(",") if s]]:
        p1, _ = peak_of(variant, a.size, 1, a.target, budget, a.layers)
        p2, _ = peak_of(variant, a.size, 2, a.target, budget, a.layers)
        for b, pk in ((1, p1), (2, p2)):
            with points.open("a") as f:
                f.write(json.dumps({"variant": variant, "chunk_loss": a.chunk_loss, **setting,
                                    "batch": b, "peak": pk,
                                    "budget": budget, "fits": pk <= budget}) + "\n")
            if pk <= budget:
                best[variant] = max(best.get(variant, 0), b)
        slope = max(p2 - p1, 1)
        guess = min(max(int((budget - p1) // slope) + 1, 0), a.max_batch)
        lo = 2 if p2 <= budget else (1 if p1 <= budget else 0)
        if lo == 2 and guess > 2:
            search(variant, lo, guess)
    bound = floor(a.size, a.target, budget, a.layers)
    with points.open("a") as f:
        f.write(json.dumps({**bound, "size": a.size, "layers": a.layers, "target": a.target,
                            "chunk_loss": a.chunk_loss, **setting, "budget": budget}) + "\n")
    print(json.dumps(bound), file=sys.stderr, flush=True)
    if not a.no_jaxmem:
        start = a.start or max(best.values(), default=1)
        search("jaxmem", 0, min(start, a.max_batch))
    (a.out / "summary.json").write_text(json.dumps(
        {"size": a.size, "target": a.target, "budget": budget, "layers": a.layers,
         "chunk_loss": a.chunk_loss, **setting,
         "max_batch": best, "floor": bound}, indent=2))
    print(json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
