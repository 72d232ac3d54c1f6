"""How long jaxmem.analyze takes on a large program (issue: < 1 s for 1,000 equations).

Run:  python benchmarks/analysis_speed.py [--depth 24]
      python -m benchmarks.analysis_speed --model corpus:tx_resnet18_ts --size bench \
          --target h100

Builds a deep residual MLP loss whose value_and_grad program has well over 1,000 equations,
then times trace + analyze (median of 5, after one warm-up) and the rewrite's tracing.

``--model`` (a zoo model or ``corpus:NAME``, as ``benchmarks.workload.load`` takes it):
instead, the work ``verify=True`` does on the first call beside its compiles, for each of
the step's candidate plans (:func:`jaxmem.compiling.choose.rewrite_candidates`): trace its
rewrite, build jaxmem's program of it (``from_jaxpr``) and run the liveness model on it
(:func:`jaxmem.compiling.choose.rewritten_peak`), each summed over the candidates; and the
same programs built without tracing (:meth:`jaxmem.compiling.steps.Step.rewritten`, what
``verify`` does since 2026-12-07), with how many give the traced one's liveness figures;
nothing is compiled.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jaxmem
from jaxmem.planning import strategies as planning


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--model", default=None)
    ap.add_argument("--size", default="bench")
    ap.add_argument("--target", default="cpu")
    args = ap.parse_args(argv)
    if args.model:
        return rewritten_steps(args.model, args.size, args.target)

    def loss(ws, x):
        h = x
        for w1, w2 in ws:
            z = jax.nn.gelu((h - h.mean(-1, keepdims=True)) @ w1)
            h = h + jnp.tanh(z @ w2)
        return jnp.mean(h ** 2)

    ws = [(jnp.ones((64, 128)), jnp.ones((128, 64))) for _ in range(args.depth)]
    x = jnp.ones((32, 64))
    vg = jax.value_and_grad(loss)
    a = jaxmem.analyze(vg, ws, x)  # warm-up (jax tracing caches)
    n_eqns = len(a.program.nodes)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a = jaxmem.analyze(vg, ws, x)
        times.append(time.perf_counter() - t)
    tp = []
    for _ in range(5):
        t = time.perf_counter()
        planning.plan_auto(a)
        tp.append(time.perf_counter() - t)
    print(f"program: {n_eqns} equations, {len(a.residuals)} residuals")
    print(f"trace + analyze: median {statistics.median(times):.3f} s over 5 runs")
    print(f"plan (auto):     median {statistics.median(tp):.3f} s over 5 runs")


def rewritten_steps(model: str, size: str, target: str) -> None:
    """Seconds to trace, build and analyse every candidate's rewritten step (see the
    module doc)."""
    from benchmarks.workload import load
    from jaxmem.analyzing.liveness import liveness
    from jaxmem.compiling import choose, predicted
    from jaxmem.tracing.program import from_jaxpr

    w = load(model, size, target)
    got = {}

    class Captured(BaseException):  # not an Exception: no fallback in jaxmem catches it
        pass

    def captured(plan, analysis, step, options):  # the candidates, before any compile
        got.update(step=step, cands=choose.rewrite_candidates(plan, analysis, step, options))
        raise Captured

    real = predicted.rewrite_candidates
    predicted.rewrite_candidates = captured
    try:
        jaxmem.optimize(w.step).lower(w.state, w.batch)
    except Captured:
        pass
    finally:
        predicted.rewrite_candidates = real
    step, cands = got["step"], got["cands"]
    t0 = time.perf_counter()
    jaxprs = [c.jitted.trace(*step.flat).jaxpr for c in cands]
    t1 = time.perf_counter()
    programs = [from_jaxpr(j) for j in jaxprs]
    t2 = time.perf_counter()
    for p in programs:
        liveness(p, donated=step.donate_flat, platform=step.platform)
    t3 = time.perf_counter()
    built = [step.rewritten(c.plan) for c in cands]
    t4 = time.perf_counter()
    same = sum(liveness(b, donated=step.donate_flat, platform=step.platform)
               == liveness(p, donated=step.donate_flat, platform=step.platform)
               for b, p in zip(built, programs, strict=True))
    print(f"{model} ({size}, {target}): {len(cands)} candidates, "
          f"{sum(len(p.nodes) for p in programs):,} equations in their rewrites")
    print(f"trace {t1 - t0:.2f} s, from_jaxpr {t2 - t1:.2f} s, liveness {t3 - t2:.2f} s")
    print(f"built without tracing (what verify does since 2026-12-07, "
          f"jaxmem.rewriting.symbolic) {t4 - t3:.2f} s; the same liveness figures on "
          f"{same} of {len(cands)}")


if __name__ == "__main__":
    main()
