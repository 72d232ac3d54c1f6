"""One model, three ways to spread it over 8 devices: ``python -m benchmarks.distributed``.

A residual MLP (``h + tanh(gelu(h @ W1) @ W2)`` per block; residual-dominated sizes) as

- ``jit batch``: ``jax.jit`` with the batch sharded over 8 devices, parameters replicated;
- ``shard_map DP``: data parallelism written by hand, forward and backward inside a
  ``jax.shard_map`` body, ``pmean`` of the loss and gradients;
- ``jit FSDP``: ``jax.jit`` with the parameters sharded over the 8 devices too (XLA
  gathers them for the forward and backward, and reduce-scatters the gradients);
- ``shard_map FSDP``: the same by hand, ``all_gather`` of each weight in the body;
- ``jit 2-D``: a data x model mesh (4 x 2), the hidden dimension sharded over ``model``.

Each is planned by ``jaxmem.optimize`` (state donated) and compiled for 8 CPU host devices
(``--xla_force_host_platform_device_count=8``, set here before JAX starts). The table gives
XLA's per-device compiled peak (argument + output + temp - alias) of the plain step and of
jaxmem's, the saving, and the saving as a share of the batch-sharded jit step's.
Partial rows are printed as they come. ``--small`` runs the test sizes; ``--zoo`` adds the
zoo GPT's loss and gradients (jit batch, ``shard_map`` data parallel, jit FSDP);
``--zoo-only`` runs those alone.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # host devices must be asked for before JAX starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

SIZES = {"bench": dict(depth=6, width=256, hidden=1024, batch=8192),
         "small": dict(depth=3, width=32, hidden=128, batch=256)}


def loss_fn(ws: list[tuple[Any, Any]], x: Any) -> Any:
    h = x
    for w1, w2 in ws:
        h = h + jnp.tanh(jax.nn.gelu(h @ w1) @ w2)
    return jnp.mean(h ** 2)


def _update(ws: Any, g: Any) -> Any:
    return jax.tree.map(lambda w, d: w - 0.1 * d, ws, g)


def jit_step(ws: Any, x: Any) -> Any:
    loss, g = jax.value_and_grad(loss_fn)(ws, x)
    return _update(ws, g), loss


def shard_map_dp(mesh: Any) -> Callable[..., Any]:
    """Data parallelism by hand: each device's loss and gradients, averaged by ``pmean``."""
    def body(ws: Any, x: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(ws, x)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(g, "data")

    def step(ws: Any, x: Any) -> Any:
        loss, g = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")),
                                out_specs=(P(), P()))(ws, x)
        return _update(ws, g), loss
    return step


def shard_map_fsdp(mesh: Any) -> Callable[..., Any]:
    """FSDP by hand: each weight's shard all-gathered in the body; the gradient of the
    gather is a reduce-scatter, so each device gets its shard's gradient summed."""
    n = mesh.shape["data"]

    def body(shards: Any, x: Any) -> Any:
        def local_loss(shards: Any) -> Any:
            ws = jax.tree.map(lambda w: jax.lax.all_gather(w, "data", tiled=True), shards)
            return loss_fn(ws, x)
        loss, g = jax.value_and_grad(local_loss)(shards)
        return jax.lax.pmean(loss, "data"), jax.tree.map(lambda d: d / n, g)

    def step(ws: Any, x: Any) -> Any:
        loss, g = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                out_specs=(P(), P("data")))(ws, x)
        return _update(ws, g), loss
    return step


def arrays(size: str = "bench") -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    s = SIZES[size]
    rng = np.random.default_rng(0)
    ws = [((rng.normal(size=(s["width"], s["hidden"])) / np.sqrt(s["width"])).astype(np.float32),
           (rng.normal(size=(s["hidden"], s["width"])) / np.sqrt(s["hidden"])).astype(np.float32))
          for _ in range(s["depth"])]
    return ws, rng.normal(size=(s["batch"], s["width"])).astype(np.float32)


def cases(size: str = "bench") -> dict[str, tuple[Callable[..., Any], Any, Any]]:
    """name -> (step, params, batch), placed on the 8 host devices."""
    ws, x = arrays(size)
    auto = AxisType.Auto
    m1 = jax.make_mesh((8,), ("data",), axis_types=(auto,))
    m2 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))

    def put(mesh: Any, s1: P, s2: P) -> tuple[Any, Any]:
        params = [(jax.device_put(a, NamedSharding(mesh, s1)),
                   jax.device_put(b, NamedSharding(mesh, s2))) for a, b in ws]
        return params, jax.device_put(x, NamedSharding(mesh, P("data")))

    return {
        "jit batch": (jit_step, *put(m1, P(), P())),
        "shard_map DP": (shard_map_dp(m1), *put(m1, P(), P())),
        "jit FSDP": (jit_step, *put(m1, P("data"), P("data"))),
        "shard_map FSDP": (shard_map_fsdp(m1), *put(m1, P("data"), P("data"))),
        "jit 2-D": (jit_step, *put(m2, P(None, "model"), P("model", None))),
    }


def zoo_cases(size: str = "bench", per_device: int = 4
              ) -> dict[str, tuple[Callable[..., Any], Any, Any]]:
    """The zoo GPT's loss and gradients (``Workload.loss_and_grads``: dropout, adamw state
    passed through) jitted with the batch sharded, as a ``shard_map`` data-parallel body
    (``pmean``), and jitted with every parameter whose first dimension divides 8 sharded
    (FSDP-style), on 8 host devices, ``per_device`` sequences per device."""
    from benchmarks import zoo

    w = zoo.make("transformer", size=size, batch=8 * per_device)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def dp(state: Any, batch: Any) -> Any:
        body = lambda s, b: jax.lax.pmean(w.loss_and_grads(s, b), "data")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")),
                             out_specs=P())(state, batch)

    def fsdp(a: Any) -> Any:
        ok = getattr(a, "ndim", 0) and a.shape[0] % 8 == 0
        return jax.device_put(a, rows if ok else rep)

    batch = jax.device_put(w.batch, rows)
    return {
        "zoo GPT, jit batch": (w.loss_and_grads, jax.device_put(w.state, rep), batch),
        "zoo GPT, shard_map DP": (dp, jax.device_put(w.state, rep), batch),
        "zoo GPT, jit FSDP": (w.loss_and_grads, jax.tree.map(fsdp, w.state), batch),
    }


def main(argv: list[str] | None = None) -> None:
    import warnings

    from jaxmem.measure import fmt_bytes

    import jaxmem

    argv = sys.argv[1:] if argv is None else argv
    size = "small" if "--small" in argv else "bench"
    what = ("zoo GPT (transformer), 4 sequences per device" if "--zoo-only" in argv
            else f"residual MLP {SIZES[size]}" + (" and the zoo GPT" if "--zoo" in argv else ""))
    print(f"{what}, 8 CPU host devices, per-device compiled peaks (jax {jax.__version__})")
    print("| step | plain jit | jaxmem | saved | share of jit batch's saving | plan |")
    print("|---|---|---|---|---|---|")
    ref = None
    every = {} if "--zoo-only" in argv else dict(cases(size))
    if "--zoo" in argv or "--zoo-only" in argv:
        every = {**every, **zoo_cases("test" if size == "small" else "bench")}
    for name, (step, ws, x) in every.items():
        if name == "zoo GPT, jit batch":
            ref = None  # the zoo rows compare with the zoo's own jit batch row
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = jaxmem.optimize(step).plan(ws, x)
        saved = plan.baseline.peak - plan.compiled.peak
        ref = saved if ref is None else ref
        share = f"{100 * saved / ref:.0f}%" if ref else "-"
        print(f"| {name} | {fmt_bytes(plan.baseline.peak)} | {fmt_bytes(plan.compiled.peak)} | "
              f"{100 * plan.saved_fraction:.1f}% | {share} | "
              f"{(plan.inner[0].strategy if plan.inner else plan.strategy)} |", flush=True)


if __name__ == "__main__":
    main()
