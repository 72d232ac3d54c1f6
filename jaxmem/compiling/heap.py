"""The heap that exists before a cache miss, kept out of Python's cyclic garbage collector
while the miss is built. Beside :mod:`.build` in the fifth box (:mod:`jaxmem.compiling`).

Planning allocates hundreds of thousands of small objects (the trace, each candidate's
rewritten program built node by node, the liveness model's buffers), and each time enough
of them are allocated CPython's collector walks its generations; its full collections walk
everything the process holds: the user's model, JAX's caches, the traced jaxprs.
:func:`frozen` moves the objects that exist when a build starts into the collector's
permanent generation (:func:`gc.freeze`) and back when it ends (:func:`gc.unfreeze`):
objects made during the build are collected as before; those that existed before are not
scanned, so one of them that becomes cyclic garbage during the build is freed after it
(the collector is not turned off; host memory is unchanged).

Measured (``python -m benchmarks.planning_phases --model corpus:tx_resnet18_ts --size
bench --target h100 --heap both --repeat 3``; docs/first_call.md, "The collector's walks of
the heap"): transformers' ResNet18's twelve candidates' rewritten steps took 3.36 s to
build and analyse with the heap walked and 2.04 s frozen, the plan's compile starting
6.34 s and 4.55 s into the first call, the process's peak host memory 1147 and 1118 MiB
(turning the collector off instead cut as much time and grew it by 66 MiB).

Where the caller froze objects itself (:func:`gc.get_freeze_count` is not 0), or turned
the collector off, nothing is done: :func:`gc.unfreeze` would release its objects too.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["frozen"]


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Inside: the objects that existed on entry are not scanned by the collector."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
