"""What each JAX primitive costs, and whether its output is worth keeping.

Read by the first box of the data flow (``fn + args -> Program``), which gives every node
its :class:`Kind` and FLOPs. The classification is MEDL's: outputs of *heavy* layers
(matmuls, convolutions) are expensive to recompute and are kept; outputs of *utility* layers
(activations, normalisation arithmetic, dropout masks, adds, pooling, concatenation) are
cheap and are recomputed in the backward pass; *free* primitives (reshape, broadcast,
convert, slicing) do no arithmetic at all. One table, easy to extend with :func:`register`.

An unknown primitive is classified ``"unknown"``: jaxmem keeps its output (the
conservative choice) and reports it in :attr:`jaxmem.Analysis.unknown_primitives`.
What is done with each kind (MEDL's rule) lives in :mod:`jaxmem.planning.strategies`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

from jaxmem import _jax


class Kind(enum.StrEnum):
    """What a node (or a value, by its producer) is, for recompute decisions.

    A ``str`` enum: ``Kind.HEAVY == "heavy"``, and it prints and formats as its value, so
    comparisons with strings and printed tables read as before.
    """

    HEAVY = "heavy"          # matmul, convolution, FFT, decompositions: expensive to redo
    UTILITY = "utility"      # elementwise, activations, reductions, pooling, RNG bits
    FREE = "free"            # reshape, broadcast, convert, slicing: no arithmetic
    CONTROL = "control"      # a control-flow or custom-derivative unit, kept whole
    UNKNOWN = "unknown"      # in no table: kept, and reported
    ARGUMENT = "argument"    # a value no node makes: a program input ...
    CONSTANT = "constant"    # ... or a constant

    def __repr__(self) -> str:  # dataclass reprs and doctests show 'heavy', not <Kind...>
        return repr(self.value)


#: Kinds that do elementwise or layout work only: cheap to recompute (MEDL's utility
#: layers) and fused by XLA into their readers.
CHEAP: frozenset[Kind] = frozenset({Kind.UTILITY, Kind.FREE})

HEAVY: set[str] = {
    "dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general", "fft",
    "cholesky", "triangular_solve", "lu", "qr", "householder_product", "eig", "eigh",
    "svd", "schur", "hessenberg", "tridiagonal", "tridiagonal_solve",
    "custom_call", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "top_k", "argsort",
}

#: cuDNN's fused (flash) attention, as ``jax.nn.dot_product_attention(...,
#: implementation="cudnn")`` binds it (``jax/_src/cudnn/fused_attention_stablehlo.py``): a
#: differentiated step holds the ``*_wrapper`` pair (the custom_vjp already resolved), whose
#: forward returns the output and the softmax statistics (float32 logsumexp, [B, N, T]), the
#: residuals its backward reads besides q, k, v; the unwrapped primitives are what the wrappers
#: lower through. Each is one heavy layer, like a ``dot_general``. (JAX has no primitive named
#: ``dot_product_attention``: its XLA implementation is plain einsums and a softmax.)
ATTENTION_FWD: frozenset[str] = frozenset({
    "dot_product_attention_fwd", "dot_product_attention_fwd_wrapper",
    "dot_product_attention_fp8_fwd", "dot_product_attention_fp8_fwd_wrapper",
})
ATTENTION_BWD: frozenset[str] = frozenset({
    "dot_product_attention_bwd", "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_bwd", "dot_product_attention_fp8_bwd_wrapper",
})
HEAVY |= ATTENTION_FWD | ATTENTION_BWD

UTILITY: set[str] = {
    # elementwise arithmetic and activations
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "sign", "abs", "max", "min", "pow",
    "integer_pow", "square", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh",
    "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv", "lgamma", "digamma",
    "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "bessel_i0e", "bessel_i1e",
    "regularized_incomplete_beta", "polygamma", "zeta", "round", "floor", "ceil",
    "is_finite", "nextafter", "clamp", "select_n", "reduce_precision", "real", "imag",
    "conj", "complex", "not", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
    "clz", "stop_gradient", "copy", "copy_p",
    # reductions and normalisation statistics
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "reduce",
    # pooling, concatenation, padding, scatter-add gradients
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "select_and_gather_add", "concatenate", "pad",
    "scatter-add", "scatter_add", "scatter", "scatter_mul", "scatter_min", "scatter_max",
    # random bits (dropout masks): deterministic given the key, cheap to regenerate
    "random_bits", "random_seed", "random_fold_in", "random_split", "threefry2x32",
    "random_wrap", "random_unwrap", "iota",
}

FREE: set[str] = {
    "reshape", "broadcast_in_dim", "convert_element_type", "transpose", "squeeze",
    "expand_dims", "slice", "dynamic_slice", "dynamic_update_slice", "gather", "rev",
    "bitcast_convert_type", "name", "pvary", "sharding_constraint", "mesh_cast",
    "reshard", "copy_to_host", "device_put", "optimization_barrier", "axis_index",
    "split",
}

CONTROL: set[str] = {
    "jit", "pjit", "closed_call", "core_call", "scan", "while", "cond", "remat", "remat2",
    "checkpoint", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "custom_lin", "shard_map", "xla_pmap", "run_state",
}

# Collectives move data; they are never recomputed (a second all-reduce is not free).
UNKNOWN_SAFE: set[str] = {"psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute"}


def register(name: str, kind: Kind | str) -> None:
    """Classify primitive ``name`` as ``kind`` (``"heavy"``, ``"utility"`` or ``"free"``).

    Example:
      >>> import jaxmem.primitives as P
      >>> P.register("my_fused_matmul", "heavy")
      >>> P.classify("my_fused_matmul")
      'heavy'
    """
    tables = {Kind.HEAVY: HEAVY, Kind.UTILITY: UTILITY, Kind.FREE: FREE}
    if kind not in tables:
        raise ValueError(f"kind must be 'heavy', 'utility' or 'free', got {kind!r}")
    for table in tables.values():
        table.discard(name)
    tables[Kind(kind)].add(name)


def classify(name: str) -> Kind:
    """The kind of primitive ``name``; ``"unknown"`` if it is in no table."""
    if name in HEAVY:
        return Kind.HEAVY
    if name in FREE:
        return Kind.FREE
    if name in UTILITY:
        return Kind.UTILITY
    if name in CONTROL:
        return Kind.CONTROL
    return Kind.UNKNOWN


def size(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    return int(math.prod(shape)) if shape else 1


def nbytes(aval: Any) -> int:
    """Bytes of one array of ``aval`` on one device (0 for tokens and other non-arrays):
    the whole array, or one shard where its type says it is sharded (``Explicit`` mesh
    axes; :func:`jaxmem._jax.shards`)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        itemsize = dtype.itemsize
    except AttributeError:  # extended dtypes (PRNG keys)
        itemsize = getattr(dtype, "itemsize", 8) or 8
    return size(aval) * int(itemsize) // _jax.shards(aval)


def flops(name: str, in_avals: Sequence[Any], out_avals: Sequence[Any],
          params: dict[str, Any]) -> float:
    """Estimated FLOPs of one primitive application (a multiply-add counts as 2)."""
    out_size = sum(size(a) for a in out_avals)
    if name == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        k = math.prod(in_avals[0].shape[d] for d in lhs_contract) if lhs_contract else 1
        return 2.0 * out_size * k
    if name == "conv_general_dilated":
        rhs = in_avals[1].shape
        spec = params["dimension_numbers"].rhs_spec  # (out feature, in feature, *spatial)
        k = math.prod(rhs[d] for d in spec[1:])
        return 2.0 * out_size * k
    if name in ATTENTION_FWD or name in ATTENTION_BWD:
        return _attention_flops(name, in_avals, params)
    if classify(name) is Kind.FREE:
        return 0.0
    if name in ("random_bits", "threefry2x32"):
        # Threefry hashing: XLA's cost model counts 45 FLOPs per generated 32-bit word.
        return 45.0 * out_size
    if name.startswith("reduce_window") or name.startswith("select_and"):
        window = params.get("window_dimensions", ())
        return float(out_size * (math.prod(window) if window else 1))
    if name.startswith("reduce") or name.startswith("arg"):
        return float(sum(size(a) for a in in_avals[:1]))
    if name in ("sort", "argsort", "top_k"):
        n = size(in_avals[0])
        return float(n * max(1.0, math.log2(max(n, 2))))
    if name in ("cholesky", "lu", "qr", "eigh", "svd", "triangular_solve"):
        shape = in_avals[0].shape
        m = shape[-1] if shape else 1
        batch = size(in_avals[0]) // max(m * m, 1)
        return float(batch * m**3)
    return float(out_size)


def _attention_flops(name: str, in_avals: Sequence[Any], params: dict[str, Any]) -> float:
    """FLOPs of one cuDNN fused attention call (in_avals start with query, key, value).

    Forward: ``4·B·N·T·S·H``, the two matmuls ``Q·Kᵀ`` ([B, N, T, S], contraction H) and
    ``P·V`` (2 FLOPs a multiply-add each); the softmax is left out (O(B·N·T·S), not ×H).
    Backward: 2.5 times that, five such matmuls (``Q·Kᵀ`` again, ``dO·Vᵀ``, ``Pᵀ·dO``,
    ``dS·K``, ``dSᵀ·Q``). A causal mask halves both (flash attention skips the masked
    blocks); a sliding window is not counted.
    """
    q, k = in_avals[0].shape, in_avals[1].shape
    if len(q) != 4 or len(k) != 4:
        return float(size(in_avals[0]))
    if int(params.get("layout", 0)) == 1:  # BNTH (cudnn AttentionLayout.BNTH)
        b, n, t, h = q
        s = k[2]
    else:                                 # BTNH, jax.nn.dot_product_attention's layout
        b, t, n, h = q
        s = k[1]
    total = 4.0 * b * n * t * s * h
    if name in ATTENTION_BWD:
        total *= 2.5
    if "CAUSAL" in str(params.get("mask_type", "")).upper():  # CAUSAL, PADDING_CAUSAL
        total /= 2
    return total
