"""Per-target fusion rules: which elementwise producers XLA duplicates into their consumers.

Part of the liveness model (:mod:`jaxmem.liveness`, second box of the data flow). XLA's
instruction fusion duplicates a cheap elementwise producer into every consumer, backward ones
included, so such a value never gets a buffer; it refuses to duplicate an *expensive* one
(``InstructionFusion::IsExpensive``), which is then stored. What counts as expensive depends
on the backend:

- **XLA:CPU** (and the default): floating-point divide, square roots, exponentials,
  logarithms, ``tanh``, ``logistic``, ``erf``, powers and the trigonometric functions.
- **XLA:GPU**: its priority fusion decides with a cost model, not that list, and duplicates
  any elementwise producer whose operands are in memory into every consumer (re-computing a
  ``tanh`` or an ``exp`` is cheaper there than writing and re-reading its result); only
  random-bit generation is never duplicated.

The rules are the compilers' own, not a fit to measured peaks.
"""

from __future__ import annotations

__all__ = ["PLATFORMS", "is_expensive", "normalise_platform"]

#: Floating-point primitives XLA's base fusion pass will not duplicate.
_EXPENSIVE = frozenset({
    "div", "rem", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "expm1", "log", "log1p", "pow",
    "tanh", "logistic", "erf", "erfc", "erf_inv", "atan2", "sin", "cos", "tan", "lgamma",
    "digamma", "random_bits", "threefry2x32",
})

#: What XLA:GPU never duplicates.
_GPU_EXPENSIVE = frozenset({"random_bits", "threefry2x32"})

#: The platforms with a rule set of their own; others use the default (CPU) rules.
PLATFORMS = ("cpu", "cuda", "tpu")


def normalise_platform(platform: str | None) -> str:
    """``"gpu"``/``"cuda"``/``"rocm"`` -> ``"cuda"``; ``None`` -> ``"cpu"``."""
    p = (platform or "cpu").lower()
    return "cuda" if p in ("gpu", "cuda", "rocm") else p


def is_expensive(primitive: str, dtype: str, platform: str = "cpu") -> bool:
    """Whether XLA on ``platform`` refuses to duplicate ``primitive`` (with ``dtype``
    elements) into its consumers."""
    if primitive not in _EXPENSIVE:
        return False
    if normalise_platform(platform) == "cuda":
        return primitive in _GPU_EXPENSIVE
    return True
