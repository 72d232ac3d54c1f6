"""Memory and FLOP figures read from XLA's compiled executable.

This is the ground truth every jaxmem claim is checked against. The peak figure is
``argument + output + temp - alias`` of ``Compiled.memory_analysis()`` (per device): temp
alone undercounts, because XLA places temporaries inside output allocations.

On CPU, XLA's ``cse_barrier_expander`` pass deletes ``optimization_barrier``s and with them
every rematerialisation; :func:`compile` disables that pass there so that what is measured on
CPU is what a GPU would run. Every variant that is compared (the plain-jit baseline included)
must be compiled through :func:`compile` so that the comparison is fair.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax

#: Compiler options that keep optimisation barriers (and therefore remat) on CPU.
CPU_BARRIER_OPTIONS: dict[str, str] = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """The compiler options jaxmem compiles with on ``platform`` (default: the default backend)."""
    platform = platform or jax.default_backend()
    return dict(CPU_BARRIER_OPTIONS) if platform == "cpu" else {}


def _platform_of(lowered: Any) -> str:
    from jaxmem import _jax

    return _jax.lowered_platform(lowered) or jax.default_backend()


def compile(lowered: Any, options: dict[str, Any] | None = None) -> Any:  # noqa: A001
    """Compile a ``jax.stages.Lowered`` with jaxmem's options (barrier flag on CPU); the
    memory the compile freed is handed back to the system (:func:`release_freed`)."""
    opts = compiler_options(_platform_of(lowered))
    if options:
        opts.update(options)
    try:
        return lowered.compile(compiler_options=opts) if opts else lowered.compile()
    finally:
        release_freed()


_LIBC: list[Any] = []  # [glibc's handle] once loaded; [None] where there is none


def release_freed() -> None:
    """Return the memory the allocator holds freed to the system (glibc's ``malloc_trim``).

    A compile's transient memory (XLA's passes, LLVM) is freed when it ends, but glibc keeps
    the pages, one arena per compiling thread, and the next compile grows on top of them: a
    cold ``jaxmem.optimize`` compiles several programs, so the process's peak host memory
    grew with their number (issue 37). Trimming after each compile keeps the peak near one
    compile's transient above what planning holds: zoo GPT at bench size, CPU, a cold
    ``optimize``'s peak RSS 1444 MiB against 1529-1552 without (``jax.jit``: 847-861;
    ``python -m benchmarks.first_call --model transformer --size bench --modes
    plain,cold``). A no-op off glibc, or with ``JAXMEM_MALLOC_TRIM=0``."""
    import os

    if os.environ.get("JAXMEM_MALLOC_TRIM", "1") == "0":
        return
    if not _LIBC:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            _LIBC.append(libc if hasattr(libc, "malloc_trim") else None)
        except OSError:
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0].malloc_trim(0)


@dataclasses.dataclass(frozen=True)
class Figures:
    """What XLA says a compiled program needs, per device, in bytes (and FLOPs).

    Attributes:
      argument, output, temp, alias: the ``memory_analysis()`` fields.
      host_temp: temporaries XLA placed in host memory (offload on GPU/TPU).
      flops: ``cost_analysis()['flops']``; a scan/while body is counted once by XLA. Where
        the compiler gives no count (XLA:GPU compiling for a target without the device),
        jaxmem's own count of the program (:func:`count_flops`, loops times their trip
        count), and ``flops_source`` says so.
      bytes_accessed: ``cost_analysis()['bytes accessed']``.
      flops_source: ``"xla"`` or ``"jaxmem"`` (see ``flops``).
      platform: what it was compiled for (``cpu``, ``cuda``, ``tpu``), when known.
    """

    argument: int
    output: int
    temp: int
    alias: int
    host_temp: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    flops_source: str = "xla"
    platform: str = ""

    @property
    def peak(self) -> int:
        """``argument + output + temp - alias``: the figure jaxmem plans and budgets against."""
        return self.argument + self.output + self.temp - self.alias

    def __str__(self) -> str:
        return (
            f"peak {fmt_bytes(self.peak)} (arg {fmt_bytes(self.argument)}, out "
            f"{fmt_bytes(self.output)}, temp {fmt_bytes(self.temp)}, alias "
            f"{fmt_bytes(self.alias)}), {self.flops / 1e9:.3f} GFLOP"
            + (" (jaxmem count)" if self.flops_source == "jaxmem" else "")
            + (f" [{self.platform}]" if self.platform and self.platform != "cpu" else "")
        )


def figures(compiled: Any, *, flops: float | None = None, platform: str = "") -> Figures:
    """Read :class:`Figures` from a ``jax.stages.Compiled``.

    ``flops``: the count to report when the compiler gives none (see :func:`count_flops`).
    """
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax returned one dict per device
        cost = cost[0] if cost else {}
    cost = cost or {}
    if "flops" not in cost and flops is not None:
        return dataclasses.replace(figures(compiled, platform=platform), flops=float(flops),
                                   flops_source="jaxmem")
    return Figures(
        argument=int(m.argument_size_in_bytes),
        output=int(m.output_size_in_bytes),
        temp=int(m.temp_size_in_bytes),
        alias=int(m.alias_size_in_bytes),
        host_temp=int(getattr(m, "host_temp_size_in_bytes", 0)),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        platform=platform,
    )


PEAK_TIE = 1e-4
"""Compiled peaks within this fraction of the lowest count as equal when jaxmem picks among
candidate plans (:func:`lowest`). On the H100 target the bottleneck ResNet's two selective
plans compile 512 bytes apart (0.0013%) at +5.0% and +4.3% FLOPs: the bytes are layout
noise, the FLOPs are not."""


def lowest(figs: Sequence[Figures]) -> int:
    """Index of the figures with the lowest compiled peak, peaks within :data:`PEAK_TIE` of
    it counting as equal: the fewest FLOPs among those, then the lower peak, then the
    first."""
    if not figs:
        raise ValueError("lowest: no figures to choose from")
    low = min(f.peak for f in figs)
    near = [i for i, f in enumerate(figs) if f.peak <= low + low * PEAK_TIE]
    return min(near, key=lambda i: (figs[i].flops, figs[i].peak, i))


def count_flops(fn: Any, *args: Any, **kwargs: Any) -> float:
    """jaxmem's own FLOP count of ``fn(*args)``: the one its planner uses
    (:mod:`jaxmem.primitives` per equation, loop bodies times their trip count, recompute
    inside ``jax.checkpoint`` included), over the equations an output depends on. For
    compilers that report none (XLA:GPU compiling for a target without the device); it
    counts a scan body per iteration, XLA once.

    Example:
      >>> import jax.numpy as jnp
      >>> count_flops(lambda x: x @ x, jnp.ones((4, 4)))
      128.0
    """
    from jaxmem import _jax
    from jaxmem.tracing.program import from_jaxpr

    # the equations no output depends on are not counted: XLA removes them before it runs
    # anything (a rewrite's dropped residuals, still made in its forward pass: 213 MFLOP of
    # a BERT-base block plan, as much as its recompute over transformers' own per-layer remat)
    live = _jax.live_only(jax.make_jaxpr(fn)(*args, **kwargs))
    return float(from_jaxpr(live).flops)


def measure(fn: Any, *args: Any, **kwargs: Any) -> Figures:
    """Compile ``fn`` (jitting it if needed) for ``args`` the jaxmem way and return its figures.

    Example:
      >>> import jax.numpy as jnp, jaxmem
      >>> f = jaxmem.measure.measure(lambda x: (x @ x).sum(), jnp.ones((64, 64)))
      >>> f.argument
      16384
    """
    lower = getattr(fn, "lower", None)
    if lower is None:
        fn = jax.jit(fn)
        lower = fn.lower
    lowered = lower(*args, **kwargs)
    return compiled_figures(compile(lowered), fn, args, kwargs, _platform_of(lowered))


def compiled_figures(compiled: Any, fn: Any, args: Any, kwargs: Any | None = None,
                     platform: str = "") -> Figures:
    """:func:`figures` of ``compiled`` (``fn`` compiled for ``args``), with jaxmem's FLOP
    count of ``fn`` where the compiler reports none."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    if cost and "flops" in cost:
        return figures(compiled, platform=platform)
    return figures(compiled, flops=count_flops(fn, *args, **(kwargs or {})),
                   platform=platform)


_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(?[a-z0-9]+\[[^\]]*\])")
_HLO_DOT = re.compile(r"=\s*[a-z0-9]+\[([^\]]*)\]\S*\s+dot\(%?([\w.\-]+),")
_HLO_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


def _dims(shape: str) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", shape.split("[", 1)[-1])]


def _hlo_shapes(text: str) -> dict[str, list[int]]:
    """Instruction name -> its (first) result's dimensions, from HLO text."""
    shapes: dict[str, list[int]] = {}
    for line in text.splitlines():
        m = _HLO_DEF.match(line)
        if m:
            shapes[m.group(1)] = _dims(m.group(2))
    return shapes


def hlo_dot_flops(compiled: Any) -> float:
    """Matmul FLOPs in a compiled program's optimised HLO: ``2 x output elements x
    contracted size`` of every ``dot`` instruction, fused ones and the copies XLA's own
    rematerialisation made included.

    For comparing what compilers do to the same step where ``cost_analysis()`` reports
    nothing (XLA:GPU without the device): jaxmem's count (:func:`count_flops`) sees the
    program before XLA rewrites it, this sees it after. It counts matmuls only (no
    elementwise work, no convolutions, which XLA:GPU lowers to cuDNN calls) and a loop
    body once.
    """
    text = compiled.as_text()
    shapes = _hlo_shapes(text)
    total = 0.0
    for line in text.splitlines():
        m = _HLO_DOT.search(line)
        c = _HLO_CONTRACT.search(line)
        if not m or not c:
            continue
        out = 1
        for d in re.findall(r"\d+", m.group(1)):
            out *= int(d)
        lhs = shapes.get(m.group(2))
        if lhs is None:
            continue
        k = 1
        for i in (int(x) for x in c.group(1).split(",") if x):
            k *= lhs[i]
        total += 2.0 * out * k
    return total


_HLO_CONV = re.compile(
    r"=\s*\(?[a-z0-9]+\[([^\]]*)\][^=]*?\s(convolution|custom-call)\(%?([\w.\-]+),\s*%?([\w.\-]+)"
    r".*?dim_labels=([a-z0-9]+)_([a-z0-9]+)->([a-z0-9]+)")
_CUDNN_TARGET = re.compile(r'custom_call_target="__cudnn\$conv(\w*)"')


def hlo_conv_flops(compiled: Any) -> float:
    """Convolution FLOPs in a compiled program's optimised HLO: ``2 x forward output
    elements x (kernel elements / output features)`` of every convolution, whether XLA kept
    it as ``convolution`` (CPU) or lowered it to a cuDNN call (XLA:GPU's
    ``__cudnn$convForward``, ``...BackwardInput`` and ``...BackwardFilter``, each as many
    FLOPs as the forward convolution it belongs to). Fused convolution+bias+activation
    calls count their convolution only; a loop body is counted once."""
    text = compiled.as_text()
    shapes = _hlo_shapes(text)
    total = 0.0
    for line in text.splitlines():
        m = _HLO_CONV.search(line)
        if not m:
            continue
        result = _dims("[" + m.group(1) + "]")
        op, a, b, kernel_labels = m.group(2), m.group(3), m.group(4), m.group(6)
        kind = "Forward"
        if op == "custom-call":
            t = _CUDNN_TARGET.search(line)
            if not t:
                continue
            kind = t.group(1)
        if kind == "BackwardInput":     # (d_output, kernel) -> d_input
            out, kernel = shapes.get(a), shapes.get(b)
        elif kind == "BackwardFilter":  # (input, d_output) -> d_kernel
            out, kernel = shapes.get(b), result
        else:                           # (input, kernel[, bias, ...]) -> output
            out, kernel = result, shapes.get(b)
        if not out or not kernel or len(kernel) != len(kernel_labels) or "o" not in kernel_labels:
            continue
        o = kernel[kernel_labels.index("o")]
        total += 2.0 * math.prod(out) * math.prod(kernel) / max(o, 1)
    return total


_UNITS = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]

_SIZE_UNITS = {
    "b": 1, "": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, what: str = "size") -> int:
    """``"6GiB" -> 6442450944``: a positive byte count written with a unit (B, KB, MB, GB,
    TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024) or none (bytes).

    Example:
      >>> parse_bytes("1.5 GB"), parse_bytes("500MiB")
      (1500000000, 524288000)
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot parse {what} {text!r}: expected a number with a unit such as "
            "'6GiB', '500MB', '1.5 GB' or '1024' (bytes); units B, KB, MB, GB, TB "
            "(powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)")
    n = float(m.group(1)) * _SIZE_UNITS[unit]
    if n <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return int(n)


def fmt_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; binary units, as XLA and nvidia-smi report them."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in _UNITS:
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
