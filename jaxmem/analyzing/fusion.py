"""Per-target fusion rules: which elementwise producers XLA duplicates into their consumers.

Part of the liveness model (:mod:`jaxmem.analyzing.liveness`, second box of the data flow). XLA's
instruction fusion duplicates a cheap elementwise producer into every consumer, backward ones
included, so such a value never gets a buffer; it refuses to duplicate an *expensive* one
(``InstructionFusion::IsExpensive``), which is then stored. What counts as expensive depends
on the backend:

- **XLA:CPU** (and the default): floating-point divide, square roots, exponentials,
  logarithms, ``tanh``, ``logistic``, ``erf``, powers and the trigonometric functions.
- **XLA:GPU**: its priority fusion decides with a cost model, not that list, and duplicates
  any elementwise producer whose operands are in memory into every consumer (re-computing a
  ``tanh`` or an ``exp`` is cheaper there than writing and re-reading its result). Random
  bits included: XLA:GPU expands ``RngBitGenerator`` into elementwise hashing, so a dropout
  mask is re-generated from its key in the backward pass rather than stored.

Some primitives that jaxmem counts as cheap are no elementwise op to XLA:CPU (and TPU) and
never fuse into their readers: ``random_bits`` on an ``rbg`` key is ``RngBitGenerator``,
whose bits are a buffer of their own (a dropout mask is then stored as those 32-bit words,
and the comparison that makes the mask is fused into each reader).

XLA:CPU has no bf16/f16 matmul or convolution: it converts their half-precision operands to
f32 and computes in f32. Common-subexpression elimination then shares one f32 copy of an
operand between the forward matmul and the backward ones that read it, so the copy (twice
the bf16 bytes) lives from the first matmul reading it to the last (:func:`upcast_bytes`).

XLA:CPU also expands max-pooling's gradient (``select_and_scatter_add``) into an argmax
over the window: one s32 ``iota`` per dimension of the pooled operand, and a variadic
reduce-window whose outputs are the window maximum and its position, one s32 index per
dimension (:func:`expansion_bytes`). XLA:GPU makes the same argmax (without the iotas)
and scatters into a zeroed copy of the padded operand where a window starts before it
(equinox's padded pooling: 18 MiB of the 80 at its BatchNorm CNN's peak).

XLA:GPU's convolutions (cuDNN) take symmetric padding only: for a convolution padded more on
one side than the other (a stride-2 ``SAME`` convolution of an even-sized image), XLA pads
the input explicitly, and the forward convolution and the backward one that reads the same
input share the padded copy (:func:`padded_bytes`).

XLA:GPU runs every convolution through cuDNN in one layout, ``b01f_o01i->b01f`` (features
innermost; the kernel's output features outermost), f32 and bf16 alike on the H100
target. What the program computes is laid out so by XLA's layout assignment at no cost,
but an argument keeps the caller's layout: a kernel stored HWIO (flax, haiku, keras) or
OIHW (equinox), or an NCHW input, is copied into cuDNN's layout, one copy read by the
forward convolution, by the input gradient's (which reads the kernel itself: the ``rev``
JAX's gradient applies is folded into cuDNN's backward-input convolution,
:func:`folds_into_conv`) and by the optimizer's update of the parameter
(:func:`conv_operand_copies`; transformers' ResNet18: 42.6 MiB of copies, 29 to 38 MiB
of them live at XLA's peak, which the model did not count before).

XLA places each temporary buffer at an aligned offset of its temp allocation: 256 bytes
on XLA:GPU, 64 on XLA:CPU (:func:`aligned_bytes`; it weighs on steps of a few hundred
KiB, whose buffers are small).

XLA:GPU splits the contraction of a matmul whose output has too few tiles to fill the
device (``SplitkRewriter``, before its Triton GEMM fusion): it picks ``split_k`` from a
closed-form cost of the shapes, pads both operands along the contraction to a multiple of
``split_k`` times 16 bytes when needed (each pad a buffer of its own) and computes
``split_k`` f32 partial products that a reduction sums (:func:`split_k_bytes`). The input
gradient of a large-vocabulary language-model head is one: transformers' GPT-2 small on the
H100 target pads the logits' gradient and the tied embedding from 50257 to 50272 rows, 343.66
MiB at the peak.

The rules are the compilers' own, not a fit to measured peaks.
"""

from __future__ import annotations

import math

__all__ = ["PLATFORMS", "aligned_bytes", "conv_operand_copies", "expansion_bytes",
           "folds_into_conv", "folds_into_dot", "fuses_into_gemm", "is_expensive",
           "makes_buffer", "normalise_platform", "padded_bytes", "pooled_in_kernel",
           "split_k", "split_k_bytes", "upcast_bytes"]

#: Floating-point primitives XLA's base fusion pass will not duplicate.
_EXPENSIVE = frozenset({
    "div", "rem", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "expm1", "log", "log1p", "pow",
    "tanh", "logistic", "erf", "erfc", "erf_inv", "atan2", "sin", "cos", "tan", "lgamma",
    "digamma", "random_bits", "threefry2x32",
})


#: The platforms with a rule set of their own; others use the default (CPU) rules.
PLATFORMS = ("cpu", "cuda", "tpu")


def normalise_platform(platform: str | None) -> str:
    """``"gpu"``/``"cuda"``/``"rocm"`` -> ``"cuda"``; ``None`` -> ``"cpu"``."""
    p = (platform or "cpu").lower()
    return "cuda" if p in ("gpu", "cuda", "rocm") else p


#: Where XLA's buffer assignment places each temporary buffer in the temp allocation
#: (offsets are multiples of this): read from ``--xla_dump_to``'s buffer assignment,
#: ``offset=`` of each value (XLA:GPU 256 bytes, XLA:CPU 64). TPU: not read, no rounding.
_TEMP_ALIGN = {"cuda": 256, "cpu": 64}


def aligned_bytes(nbytes: int, platform: str = "cpu") -> int:
    """Bytes a temporary buffer of ``nbytes`` takes in XLA's temp allocation on
    ``platform``: its size rounded up to the allocation's alignment."""
    align = _TEMP_ALIGN.get(normalise_platform(platform), 1)
    return -(-nbytes // align) * align


def is_expensive(primitive: str, dtype: str, platform: str = "cpu") -> bool:
    """Whether XLA on ``platform`` refuses to duplicate ``primitive`` (with ``dtype``
    elements) into its consumers."""
    return primitive in _EXPENSIVE and normalise_platform(platform) != "cuda"


def makes_buffer(primitive: str, input_dtypes: tuple[str, ...], platform: str = "cpu") -> bool:
    """Whether an otherwise fusible primitive is an op of its own to XLA on ``platform`` (its
    output always has a buffer): ``random_bits`` on an ``rbg``/``unsafe_rbg`` key
    (``RngBitGenerator``), except on XLA:GPU, which expands it into elementwise code."""
    return (primitive == "random_bits" and normalise_platform(platform) != "cuda"
            and any("rbg" in d for d in input_dtypes))


def fuses_into_gemm(primitive: str, dtype: str, from_inputs: tuple[bool, ...],
                    platform: str = "cpu") -> bool:
    """Whether XLA on ``platform`` fuses ``primitive`` (output ``dtype``) into the matmuls
    that read it instead of storing it: on XLA:GPU, a conversion to half precision of a
    value the program computes (attention probabilities cast to bf16), which its Triton
    GEMM fusion reads in f32 and converts in the kernel. A conversion of a program input
    (a weight's bf16 cast, shared by the forward and backward matmuls) is stored."""
    return (normalise_platform(platform) == "cuda" and primitive == "convert_element_type"
            and dtype in _HALF and not any(from_inputs))


def folds_into_dot(primitive: str, platform: str = "cpu") -> bool:
    """Whether XLA on ``platform`` folds a ``primitive`` value into the matmuls that read
    it instead of storing it: on XLA:GPU, a transpose, which the GEMM fusion (Triton or
    cuBLAS) reads in the layout it has (``gemm_fusion_dot`` with the weight as a
    ``bitcast`` operand). transformers' Flax GPT-2 multiplies by ``kernel.T`` in each of
    its 48 projections and by the tied embedding's transpose for the logits; its compiled
    module on the H100 target keeps none of those transposes (``python -m
    benchmarks.prediction_why``'s dumps), where storing them was 470 MiB of the plain
    step's 485 MiB over-prediction."""
    return normalise_platform(platform) == "cuda" and primitive == "transpose"


#: Max-pooling, forward and gradient: XLA:GPU emits both as reduce-window fusions.
_MAX_POOLING = frozenset({"reduce_window_max", "select_and_scatter_add"})


def pooled_in_kernel(readers: tuple[str, ...], platform: str = "cpu") -> bool:
    """Whether XLA on ``platform`` computes a value read by ``readers`` (their primitives),
    a cheap elementwise or layout value, inside its readers' kernels instead of storing it,
    where max-pooling is all that reads it: on XLA:GPU the pooling's ``reduce-window`` and
    the reduce-window its gradient (``select_and_scatter_add``) expands into are fusions
    that compute their operand from its own inputs. A max-pool's input, a ReLU of a
    BatchNorm of a convolution's output, is recomputed from that output (kept for the
    BatchNorm's gradient anyway) in the forward pooling and again in its gradient, never
    stored: equinox's BatchNorm CNN (its two pools, 24 MiB), transformers' ResNet18 (the
    stem's, 16 MiB) and the zoo's ``cnn_bn`` on the H100 target, each read from XLA's
    live set at its peak (``python -m benchmarks.prediction_why MODEL plain --target
    h100``). XLA:CPU stores it."""
    return (normalise_platform(platform) == "cuda" and bool(readers)
            and all(r in _MAX_POOLING for r in readers))


#: Primitives XLA:CPU computes in f32 whatever their operands' precision.
_F32_ONLY_ON_CPU = frozenset({"dot_general", "conv_general_dilated"})
_HALF = frozenset({"bfloat16", "float16"})


#: The primitives whose operands :func:`upcast_bytes` or :func:`padded_bytes` may copy
#: (for every other primitive both are 0).
COPIES_OPERANDS = _F32_ONLY_ON_CPU | {"conv_general_dilated"}


def upcast_bytes(primitive: str, dtype: str, nbytes: int, platform: str = "cpu") -> int:
    """Bytes of the f32 copy XLA on ``platform`` makes of an operand (``dtype``, ``nbytes``)
    of ``primitive``: twice a half-precision operand of a matmul or convolution on XLA:CPU,
    else 0."""
    if (normalise_platform(platform) == "cpu" and primitive in _F32_ONLY_ON_CPU
            and dtype in _HALF):
        return 2 * nbytes
    return 0


def expansion_bytes(primitive: str, operand: tuple[int, ...], out: tuple[int, ...],
                    platform: str = "cpu", padding: tuple = (), itemsize: int = 4,
                    stored: bool = True) -> int:
    """Working set XLA on ``platform`` adds when it expands ``primitive`` (operand shape
    ``operand``, result shape ``out``, the pooling's ``padding`` per dimension) beyond the
    result's own buffer: both expand max-pooling's gradient (``select_and_scatter_add``)
    into an argmax over the window, a variadic reduce-window whose outputs are the window
    maximum and its position, one s32 index per dimension. XLA:CPU also keeps an s32 iota
    of the operand per dimension. XLA:GPU scatters into the result where no window starts
    before the operand (no low padding); otherwise into a zeroed copy of the padded operand
    (the scatter in place), sliced into the result after the indices are dead, or into its
    readers where the result is fused (``stored`` False): read from the compiled modules of
    pooling gradients on the H100 target. 0 elsewhere."""
    if primitive != "select_and_scatter_add":
        return 0
    rank = len(operand)
    n_in = int(math.prod(operand))
    n_out = int(math.prod(out))  # the source (window) shape
    where = normalise_platform(platform)
    if where == "cpu":
        return 4 * (rank * n_in + (rank + 1) * n_out)
    if where != "cuda":
        return 0
    if not any(lo > 0 for lo, _ in padding):
        return (4 * rank + itemsize) * n_out
    padded = int(math.prod(d + lo + hi for d, (lo, hi) in zip(operand, padding, strict=True)))
    indices = 4 * rank * n_out
    return padded * itemsize + (max(indices - n_in * itemsize, 0) if stored else indices)


def padded_bytes(primitive: str, params: dict, lhs_shape: tuple[int, ...], itemsize: int,
                 platform: str = "cpu") -> int:
    """Bytes of the explicitly padded copy of a convolution's input XLA on ``platform``
    makes: on XLA:GPU, for padding that is not the same on both sides of a spatial
    dimension. 0 elsewhere."""
    if primitive != "conv_general_dilated" or normalise_platform(platform) != "cuda":
        return 0
    pads = params.get("padding")
    if not pads or isinstance(pads, str) or all(lo == hi for lo, hi in pads):
        return 0
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        return 0
    dims = list(lhs_shape)
    spatial = params["dimension_numbers"].lhs_spec[2:]
    for d, (lo, hi) in zip(spatial, pads, strict=False):
        dims[d] += lo + hi
    return int(math.prod(dims)) * itemsize


def conv_operand_copies(params: dict, platform: str = "cpu") -> tuple[bool, bool]:
    """Whether XLA on ``platform`` reads a convolution's input (``lhs``) and kernel
    (``rhs``) through a copy in another layout when they are the program's arguments.

    XLA:GPU runs every convolution through cuDNN in one layout, ``b01f_o01i->b01f`` (batch
    major and features minor; the kernel output-features major and input-features minor),
    on the H100 target for f32 and bf16 alike (read from the compiled module's
    ``dim_labels``). Values the program computes get that layout from XLA's layout
    assignment at no cost, but an argument's layout is the caller's: a kernel stored HWIO
    (flax, haiku, keras) or OIHW (equinox), or an NCHW input, is transposed into a buffer of
    its own (``wrapped_transpose`` of the parameter), read by the forward convolution, by
    the input gradient's and by the optimizer's update of the parameter (transformers'
    ResNet18 on the H100 target: 29 to 38 MiB of such copies live at the peak)."""
    if normalise_platform(platform) != "cuda":
        return False, False
    dn = params.get("dimension_numbers")
    if dn is None or not hasattr(dn, "rhs_spec"):
        return False, False
    return not _cudnn_layout(dn.lhs_spec), not _cudnn_layout(dn.rhs_spec)


def folds_into_conv(primitive: str, platform: str = "cpu") -> bool:
    """Whether XLA on ``platform`` folds a ``primitive`` value read as a convolution's
    kernel into that convolution: XLA:GPU's cuDNN rewrite turns a convolution of a
    spatially reversed kernel (JAX's input gradient reads ``rev`` of the forward's kernel)
    into cuDNN's backward-input convolution of the kernel itself; no reversed copy is
    stored."""
    return normalise_platform(platform) == "cuda" and primitive == "rev"


def _cudnn_layout(spec: tuple[int, ...]) -> bool:
    """Whether an operand with dimension spec ``spec`` (``(batch, feature, spatial...)`` or
    ``(out, in, spatial...)``) is laid out as cuDNN reads it: the two named dimensions the
    outermost and innermost, the spatial ones in order between. Either way round: JAX's
    gradients of a convolution are convolutions with the two swapped (the weight
    gradient's ``x`` is ``(feature, batch, ...)``, the input gradient's kernel ``(in,
    out, ...)``), which XLA's cuDNN rewrite maps back onto the same layouts."""
    spec = tuple(spec)
    ends = {spec[0], spec[1]} == {0, len(spec) - 1}
    return ends and list(spec[2:]) == sorted(spec[2:])


# -- XLA:GPU's split-K rewrite ------------------------------------------------------------------
# xla/backends/gpu/transforms/splitk_rewriter.cc (the XLA of jaxlib 0.10.2): GetCostWeights for
# compute capability >= 9.0 (H100, H200: the targets jaxmem measures) and their 132 SMs.
_SPLIT_K_WEIGHTS = (100.0, 0.194136, 193.1384, 4.36e7)  # compute, memory, reduction, launch
_SPLIT_K_CORES = 132
_SPLIT_K_TILE = 128
_SPLIT_K_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def _split_k_cost(b: int, m: int, n: int, k: int, s: int, lhs_bits: int, rhs_bits: int,
                  out_bits: int, acc_bits: int) -> float:
    """``EstimateGemmCostAfterSplitK``: the cost XLA:GPU gives a ``[b, m, k] x [b, k, n]``
    matmul split ``s`` ways along ``k``."""
    cw, mw, rw, launch = _SPLIT_K_WEIGHTS
    mt, nt = min(m, _SPLIT_K_TILE), min(n, _SPLIT_K_TILE)
    tiles = b * s * -(-m // _SPLIT_K_TILE) * -(-n // _SPLIT_K_TILE)
    waves = max(1.0, tiles / (_SPLIT_K_CORES * (_SPLIT_K_TILE * _SPLIT_K_TILE) / (mt * nt)))
    compute = 2.0 * mt * nt * -(-k // s) * waves * cw
    written = b * s * m * n * (acc_bits if s > 1 else out_bits) / 8
    memory = (b * k * (m * lhs_bits + n * rhs_bits) / 8 + written) * mw
    cost = max(compute, memory)
    if s == 1:
        return cost
    return cost + launch + (b * s * m * n * acc_bits / 8 + b * m * n * out_bits / 8) * rw


def split_k(b: int, m: int, n: int, k: int, lhs_bits: int, rhs_bits: int, out_bits: int,
            platform: str = "cpu") -> int:
    """How many ways XLA on ``platform`` splits the contraction of a ``[b, m, k] x [b, k, n]``
    matmul (operand element widths ``lhs_bits``/``rhs_bits``, result ``out_bits``): on
    XLA:GPU the candidate of lowest ``EstimateGemmCostAfterSplitK`` (the first among equals);
    1 elsewhere.

    >>> split_k(1, 1024, 768, 50257, 32, 32, 32, "cuda")  # GPT-2 small's lm-head dx
    4
    >>> split_k(1, 16384, 768, 50257, 32, 32, 32, "cuda"), split_k(1, 1024, 768, 50257, 32, 32, 32)
    (1, 1)
    """
    if normalise_platform(platform) != "cuda" or min(b, m, n, k) <= 0:
        return 1
    acc = max(32, out_bits)
    costs = [_split_k_cost(b, m, n, k, s, lhs_bits, rhs_bits, out_bits, acc)
             for s in _SPLIT_K_CANDIDATES]
    return _SPLIT_K_CANDIDATES[costs.index(min(costs))]


def split_k_bytes(b: int, m: int, n: int, k: int, lhs_bits: int, rhs_bits: int,
                  out_bits: int, platform: str = "cpu") -> tuple[int, int]:
    """``(operand pads, partial products)``: the bytes XLA on ``platform`` adds around a
    split ``[b, m, k] x [b, k, n]`` matmul (:func:`split_k`). The contraction is padded to a
    multiple of ``split_k * 128 / min(128, lhs_bits, rhs_bits)`` elements; if that changes
    it, both operands are copied, padded (the pads are loop fusions of their own, not fused
    into the GEMM). The partial products are ``f32[b, split_k, m, n]`` (the accumulator's
    width), summed by a reduction into the result. ``(0, 0)`` for a matmul not split.

    >>> pads, partials = split_k_bytes(1, 1024, 768, 50257, 32, 32, 32, "cuda")
    >>> pads / 2**20, partials / 2**20   # f32[1024, 50272] + f32[50272, 768]; f32[4, 1024, 768]
    (343.65625, 12.0)
    """
    s = split_k(b, m, n, k, lhs_bits, rhs_bits, out_bits, platform)
    if s == 1:
        return 0, 0
    multiple = s * 128 // min(128, lhs_bits, rhs_bits)
    padded = -(-k // multiple) * multiple
    pads = 0 if padded == k else b * padded * (m * lhs_bits + n * rhs_bits) // 8
    return pads, b * s * m * n * max(32, out_bits) // 8
