"""The train state's leaves, as :mod:`~jaxmem.memory.state_offload` counts and pairs them.

Part of the memory box (``jaxmem.memory``, layer 6), behind
:mod:`~jaxmem.memory.state_offload`: a leaf's bytes on one device (its shard's under a
sharding that splits it, as with FSDP), the share of each leaf one device holds, the bytes of
the offloaded leaves the model reads too (the parameters), and each state input paired with
its new value among the step's outputs (the same pytree path below the argument index).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxmem.memory import param_offload
from jaxmem.tracing.program import Program


def _nbytes(x: Any) -> int:
    return int(getattr(x, "size", 0)) * getattr(getattr(x, "dtype", None), "itemsize", 0)


def _shard_bytes(x: Any) -> int:
    """Bytes of ``x`` on one device: its shard's under a sharding that splits it (FSDP),
    else all of it."""
    s = getattr(x, "sharding", None)
    try:
        shape = s.shard_shape(tuple(x.shape)) if s is not None else None
    except (AttributeError, TypeError, ValueError):
        shape = None
    if shape is None:
        return _nbytes(x)
    return math.prod(int(d) for d in shape) * getattr(getattr(x, "dtype", None), "itemsize", 0)


def _fractions(flat: Sequence[Any], inputs: Sequence[int]) -> dict[int, float]:
    """Flat position -> the fraction of the leaf one device holds (1.0 unsharded)."""
    return {i: _shard_bytes(flat[i]) / max(_nbytes(flat[i]), 1) for i in inputs}


def _strip(path: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    return tuple(path[n:])


def _pair_outputs(program: Program, in_leaves: list, out_leaves: list,
                  chosen: list[int]) -> dict[int, int]:
    """Input position -> output position of its new value: the same path below the argument
    (inputs: ``(args, kwargs)[i][...]``; outputs: ``out[j][...]`` or the whole output)."""
    by_path: dict[tuple[Any, ...], list[int]] = {}
    for j, (path, _) in enumerate(out_leaves):
        by_path.setdefault(_strip(path, 1), []).append(j)
        by_path.setdefault(tuple(path), []).append(j)
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    for p in chosen:
        path, leaf = in_leaves[p]
        cands = [j for j in by_path.get(_strip(path, 2), []) if j not in taken
                 and _same_aval(out_leaves[j][1], leaf)]
        if len(cands) == 1:
            pairs[p] = cands[0]
            taken.add(cands[0])
    return pairs


def _same_aval(a: Any, b: Any) -> bool:
    return (tuple(getattr(a, "shape", ())) == tuple(getattr(b, "shape", ()))
            and str(getattr(a, "dtype", "")) == str(getattr(b, "dtype", "")))


def _param_bytes(program: Program, inputs: Sequence[int], flat: Sequence[Any]) -> int:
    """Bytes of the offloaded leaves the forward or backward pass reads (the parameters)."""
    model = param_offload.model_reads(program)
    return sum(_shard_bytes(flat[i]) for i in inputs if program.inputs[i] in model)
