"""How long jaxmem.analyze takes on a large program (issue: < 1 s for 1,000 equations).

Run:  python benchmarks/analysis_speed.py [--depth 24]

Builds a deep residual MLP loss whose value_and_grad program has well over 1,000 equations,
then times trace + analyze (median of 5, after one warm-up) and the rewrite's tracing.
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
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    main()
