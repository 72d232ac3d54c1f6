"""A step by name for the benchmarks' child processes: a zoo model or a corpus entry.

``load("transformer", "bench", "h100")`` gives the zoo GPT's train step, state and batch,
the arguments placed on the H100 target's topology devices (compile-only); a name
``corpus:NAME`` is the entry of :mod:`benchmarks.external.corpus` (another project's train
step, ``step(state, batch)``); target ``cpu`` leaves the arguments where they are.
"""

from __future__ import annotations

from types import SimpleNamespace


def load(name: str, size: str, target: str = "cpu") -> SimpleNamespace:
    """``step``, ``state`` and ``batch`` of the zoo model or corpus entry ``name``."""
    if name.startswith("corpus:"):
        from benchmarks.external import corpus

        e = corpus.make(name.split(":", 1)[1], size)
        w = SimpleNamespace(step=e.make_step(), state=e.state, batch=e.batch)
    else:
        from benchmarks import zoo

        z = zoo.make(name, size=size)
        w = SimpleNamespace(step=z.step, state=z.state, batch=z.batch)
    if target != "cpu":
        import jaxmem

        w.state, w.batch = jaxmem.targets.place((w.state, w.batch), target)
    return w
