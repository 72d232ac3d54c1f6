"""The heap that exists before a cache miss, kept out of Python's cyclic garbage collector
while the miss is built. Beside :mod:`.build` in the fifth box (:mod:`jaxmem.compiling`).

Planning allocates hundreds of thousands of small objects (the trace, each candidate's
rewritten program built node by node, the liveness model's buffers), and each time enough
of them are allocated CPython's collector walks its generations; its full collections walk
everything the process holds: the user's model, JAX's caches, the traced jaxprs.
:func:`frozen` moves the objects that exist when a build starts into the collector's
permanent generation (:func:`gc.freeze`) and back when it ends (:func:`gc.unfreeze`):
objects made during the build are collected as before, none that existed before are
scanned, and nothing is kept that would otherwise be freed (the collector is not turned
off; host memory is unchanged).

Measured (``python -m benchmarks.first_call --target h100 --modes plain,cold``, before and
after; docs/first_call.md, "The collector's walks of the heap"): on transformers'
ResNet18, the candidates' rewritten steps took 3.48 s to build and analyse with the
collector walking the heap and 2.37 s frozen, the plan's compile starting 1.5 s sooner, the
process's peak host memory the same (1143 and 1142 MiB).

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
