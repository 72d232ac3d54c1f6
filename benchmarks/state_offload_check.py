"""One compile of the 8B Llama step with per-layer remat and the state in host memory, on the
H100 target, at the given layer counts: checks benchmarks/state_offload.py's extrapolation.

    nice python -m benchmarks.state_offload_check 8 32
"""

from __future__ import annotations

import sys
import time

import jax

import jaxmem
from benchmarks import zoo
from jaxmem import measure


def main(counts: list[int]) -> None:
    t = jaxmem.targets.require("h100")
    for n in counts:
        w = zoo.make("llama", size="8b", batch=1, abstract=True, seq=4096, layers=n,
                     remat_policy=jax.checkpoint_policies.nothing_saveable)
        args = t.place(w.args)
        t0 = time.perf_counter()
        c = jaxmem.optimize(w.step, offload_state=True, strategy="none").lower(*args).compile()
        f = measure.figures(c)
        host = c.memory_analysis().host_argument_size_in_bytes
        print(f"8b remat + state, {n} layers: device peak {measure.fmt_bytes(f.peak)} "
              f"(fits {measure.fmt_bytes(t.memory_bytes)}: {f.peak <= t.memory_bytes}), host "
              f"arguments {measure.fmt_bytes(host)}, compile {time.perf_counter() - t0:.0f} s",
              flush=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [32])
