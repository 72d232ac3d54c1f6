"""One process of the two-process ``jax.distributed`` test (tests/test_distributed.py).

Run as ``python tests/_distributed_worker.py PROCESS_ID PORT MODE``; prints one JSON line.
A batch-sharded step under ``jaxmem.optimize`` with and without a budget; then, with MODE
``mismatch``, a third step that process 1 plans differently (its MEDL rule patched to keep
everything), which must raise ``jaxmem.PlanMismatchError`` on both processes. Importing
this module (pytest's doctest collection does) runs nothing.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def loss_fn(ws: Any, x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    h = x
    for w1, w2 in ws:
        h = h + jnp.tanh(jax.nn.gelu(h @ w1) @ w2)
    return jnp.mean(h ** 2)


def step(ws: Any, x: Any) -> Any:
    import jax

    loss, g = jax.value_and_grad(loss_fn)(ws, x)
    return jax.tree.map(lambda w, d: w - 0.1 * d, ws, g), loss


def main(pid: int, port: str, mode: str) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxmem
    from jaxmem.planning import strategies

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))

    def placed(a: np.ndarray, spec: P) -> jax.Array:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                            lambda i: a[i])

    def local(a: jax.Array) -> float:
        return float(np.asarray(a.addressable_data(0)))

    rng = np.random.default_rng(0)
    ws = [(placed((0.1 * rng.normal(size=(32, 128))).astype(np.float32), P()),
           placed((0.1 * rng.normal(size=(128, 32))).astype(np.float32), P()))
          for _ in range(3)]
    x = placed(rng.normal(size=(256, 32)).astype(np.float32), P("data"))

    out: dict = {"process": jax.process_index(), "devices": jax.device_count()}
    out["ref"] = local(jax.jit(step)(ws, x)[1])
    for name, kw in (("auto", {}), ("budget", {"budget": 0.9})):
        opt = jaxmem.optimize(step, donate_argnums=(), **kw)
        loss = local(opt(ws, x)[1])
        plan = opt.plan(ws, x)
        out[name] = {"loss": loss, "fingerprint": plan.fingerprint(),
                     "recompute": len(plan.recompute), "strategy": plan.strategy}
    if mode == "mismatch":
        if pid == 1:  # from here on this process plans differently from process 0
            strategies.plan_auto = lambda analysis, **kw: strategies.plan_none(analysis)
        try:
            jaxmem.optimize(step, donate_argnums=(), verify=False)(ws, x)
            out["mismatch"] = {"error": None}
        except jaxmem.PlanMismatchError as e:
            out["mismatch"] = {"error": str(e), "fingerprints": e.fingerprints}
    return out


if __name__ == "__main__":
    result = main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    print("RESULT " + json.dumps(result), flush=True)
