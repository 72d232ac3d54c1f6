"""One compile of the 8B Llama step on the H100 target at the given layer counts: checks
benchmarks/state_offload.py's extrapolation.

    nice python -m benchmarks.state_offload_check 8 32            # remat + state
    nice python -m benchmarks.state_offload_check --params 32     # jaxmem + state + params
    nice python -m benchmarks.state_offload_check --fsdp 8 32     # FSDP over 8 GPUs

The default variant is each layer under ``nn.remat(nothing_saveable)`` with the moments in
host memory (``offload_state=True, strategy="none"``); ``--params`` is jaxmem's own plan
(``verify=False``, no user remat) with the moments and the parameters in host memory
(``offload_state="all"``). ``--fsdp N``: the state sharded over ``N`` devices of the target
(:func:`benchmarks.state_offload.fsdp_args`), one sequence per device; figures per device.
"""

from __future__ import annotations

import sys
import time

import jax

import jaxmem
from benchmarks import zoo
from benchmarks.state_offload import fsdp_args
from jaxmem import measure


def main(counts: list[int], params: bool = False, fsdp: int = 0) -> None:
    t = jaxmem.targets.require(f"h100:{fsdp}" if fsdp else "h100")
    for n in counts:
        remat = {} if params else dict(remat_policy=jax.checkpoint_policies.nothing_saveable)
        w = zoo.make("llama", size="8b", batch=max(fsdp, 1), abstract=True, seq=4096,
                     layers=n, **remat)
        args = fsdp_args(t, w.args) if fsdp else t.place(w.args)
        t0 = time.perf_counter()
        opt = (jaxmem.optimize(w.step, offload_state="all", verify=False) if params else
               jaxmem.optimize(w.step, offload_state=True, strategy="none"))
        c = opt.lower(*args).compile()
        f = measure.figures(c)
        host = c.memory_analysis().host_argument_size_in_bytes
        name = ("jaxmem + state + params" if params else "remat + state") + (
            f", FSDP over {fsdp} devices (per device)" if fsdp else "")
        print(f"8b {name}, {n} layers: device peak {measure.fmt_bytes(f.peak)} "
              f"(fits {measure.fmt_bytes(t.memory_bytes)}: {f.peak <= t.memory_bytes}), host "
              f"arguments {measure.fmt_bytes(host)}, compile {time.perf_counter() - t0:.0f} s",
              flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    fsdp = int(argv[argv.index("--fsdp") + 1]) if "--fsdp" in argv else 0
    if fsdp:
        del argv[argv.index("--fsdp"):argv.index("--fsdp") + 2]
    main([int(x) for x in argv if x != "--params"] or [32], params="--params" in argv,
         fsdp=fsdp)
