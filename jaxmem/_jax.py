"""The one home for JAX internals that jaxmem relies on.

Everything jaxmem needs from JAX that is not a documented public API lives here, so that a
JAX upgrade is a one-file change. The tested range is pinned in ``pyproject.toml``
(jax 0.10.x on CPU machines, 0.11.x on the GPU machine). Public JAX API used elsewhere in
jaxmem (``jax.make_jaxpr``, ``jax.checkpoint``, ``jax.ad_checkpoint``, ``jax.extend.core``)
is imported directly where it is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend  # noqa: F401  (plain `import jax` does not expose jax.extend)
import jax.extend.core as jcore
from jax._src import source_info_util as _siu
from jax._src.ad_checkpoint import saved_residuals as _saved_residuals

ClosedJaxpr = jcore.ClosedJaxpr
Jaxpr = jcore.Jaxpr
JaxprEqn = jcore.JaxprEqn
Var = jcore.Var
Literal = jcore.Literal
DropVar = jcore.DropVar
Primitive = jcore.Primitive
primitives = jcore.primitives
jaxprs_in_params = jcore.jaxprs_in_params

name_p = primitives.name_p
optimization_barrier_p = getattr(primitives, "optimization_barrier_p", None)
if optimization_barrier_p is None:  # pragma: no cover - depends on the jax version
    from jax._src.lax.lax import optimization_barrier_p  # type: ignore[no-redef]

# Control-flow / call primitives whose nested jaxprs jaxmem walks. Names, not objects, so a
# renamed primitive (pjit -> jit in 0.7) only needs this table updated.
JIT_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call"})
REMAT_NAMES = frozenset({"remat", "remat2", "checkpoint"})
CUSTOM_NAMES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
LOOP_NAMES = frozenset({"scan", "while"})
COND_NAMES = frozenset({"cond"})


# --- name stacks --------------------------------------------------------------------------

def name_stack(eqn: JaxprEqn) -> Any:
    """The equation's ``NameStack`` (semi-private ``source_info.name_stack``)."""
    return eqn.source_info.name_stack


def transforms(eqn: JaxprEqn) -> tuple[str, ...]:
    """Names of the transforms in an equation's name stack, outermost first."""
    return tuple(
        s.name for s in name_stack(eqn).stack if type(s).__name__ == "Transform"
    )


def scopes(eqn: JaxprEqn) -> tuple[str, ...]:
    """User scopes (flax module paths, ``jax.named_scope``) in an equation's name stack."""
    out = []
    for s in name_stack(eqn).stack:
        if type(s).__name__ == "Scope":
            out.extend(p for p in s.name.split("/") if p)
    return tuple(out)


def name_stack_str(eqn: JaxprEqn) -> str:
    return str(name_stack(eqn))


def is_backward(eqn: JaxprEqn) -> bool:
    """True for equations made by transposition (the backward pass)."""
    return "transpose" in transforms(eqn)


def is_forward(eqn: JaxprEqn) -> bool:
    """True for equations made by the JVP that are not transposed (the forward pass)."""
    t = transforms(eqn)
    return "jvp" in t and "transpose" not in t


@contextlib.contextmanager
def source_context(eqn: JaxprEqn) -> Iterator[None]:
    """Re-emit under the equation's traceback and name stack, so profiles keep reading."""
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack(eqn)):
        yield


@contextlib.contextmanager
def extend_name_stack(name: str) -> Iterator[None]:
    with _siu.extend_name_stack(name):
        yield


# --- binding ------------------------------------------------------------------------------

def bind_params(eqn: JaxprEqn) -> dict[str, Any]:
    """Params to re-bind an equation's primitive (``get_bind_params`` returns one dict)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # pragma: no cover - jax < 0.7 returned (subfuns, params)
        subfuns, params = params
        if subfuns:
            raise NotImplementedError(f"cannot rebind {eqn.primitive} with subfuns")
    return params


def bind(eqn: JaxprEqn, *args: Any) -> list[Any]:
    out = eqn.primitive.bind(*_match_varying(eqn, args), **bind_params(eqn))
    return list(out) if eqn.primitive.multiple_results else [out]


def _match_varying(eqn: JaxprEqn, args: Sequence[Any]) -> Sequence[Any]:
    """``args`` cast up to the manual axes the most varying of them varies over, where the
    traced equation's inputs all varied alike but the re-bound ones do not.

    Inside ``shard_map`` an optimisation barrier makes all its operands vary over the same
    axes, so a parameter re-created behind one varies where the traced program had it
    invariant; JAX inserts that cast itself for most primitives, not all
    (``random_fold_in``). The values are the same (the cast is a type change). Outside
    ``shard_map`` nothing varies and nothing changes."""
    if len(args) < 2:
        return args
    kinds = [varying_axes(a) for a in args]
    if len(set(kinds)) <= 1 or len({_aval_varying(v.aval) for v in eqn.invars}) > 1:
        return args
    union = frozenset().union(*kinds)
    from jax import lax

    return [a if k == union else lax.pcast(a, tuple(sorted(union - k, key=str)), to="varying")
            for a, k in zip(args, kinds, strict=True)]


def _aval_varying(aval: Any) -> frozenset[Any]:
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes a value varies over inside ``shard_map`` (empty outside)."""
    return _aval_varying(jax.typeof(x))


# --- residual introspection ---------------------------------------------------------------

def saved_residuals(fn: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, str]]:
    """JAX's own residual list for ``fn``: ``[(aval, description)]`` (semi-private)."""
    return list(_saved_residuals(fn, *args, **kwargs))


def aval_memory_space(aval: Any) -> Any:
    return getattr(aval, "memory_space", None)


def host_space() -> Any:
    return jax.memory.Space.Host


def memory_kinds(device: Any = None) -> frozenset[str]:
    """Memory kinds of ``device`` (default: the default device): ``device``,
    ``pinned_host``, ... A GPU's compile-only topology device lists none, but XLA:GPU
    compiles host placement for it as for a real GPU: ``device`` and ``pinned_host``."""
    device = device if device is not None else jax.devices()[0]
    try:
        kinds = frozenset(m.kind for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - a backend without the memories API
        kinds = frozenset()
    if not kinds and str(getattr(device, "platform", "")).lower() in ("gpu", "cuda"):
        kinds = frozenset({"device", "pinned_host"})
    return kinds


def default_backend_initialized() -> bool:
    """Whether an XLA backend has already been created in this process."""
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", {}))


def literal_value(x: Any) -> Any:
    return x.val if isinstance(x, Literal) else None


def is_literal(x: Any) -> bool:
    return isinstance(x, Literal)


def is_dropvar(x: Any) -> bool:
    return isinstance(x, DropVar)


def sub_jaxprs(eqn: JaxprEqn) -> Sequence[Jaxpr]:
    """Open jaxprs nested in an equation's params (jit, scan, cond branches, while, ...)."""
    return list(jaxprs_in_params(eqn.params))


def concat_name_stack(outer: Any, inner: Any) -> Any:
    """The name stack of an equation inlined from a nested jaxpr (outer + inner)."""
    import dataclasses

    return dataclasses.replace(outer, stack=tuple(outer.stack) + tuple(inner.stack))


def transforms_of(stack: Any) -> tuple[str, ...]:
    return tuple(s.name for s in stack.stack if type(s).__name__ == "Transform")


def scopes_of(stack: Any) -> tuple[str, ...]:
    out: list[str] = []
    for s in stack.stack:
        if type(s).__name__ == "Scope":
            out.extend(p for p in s.name.split("/") if p)
    return tuple(out)


@contextlib.contextmanager
def user_context(traceback: Any, stack: Any) -> Iterator[None]:
    """Bind primitives under a given traceback and name stack."""
    with _siu.user_context(traceback, name_stack=stack):
        yield


def call_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
    """The closed jaxpr a call equation (:data:`JIT_NAMES`) runs: ``jit``'s ``jaxpr``,
    ``closed_call``'s ``call_jaxpr`` (what JAX's partial evaluation of a checkpointed loss
    leaves), or ``core_call``'s open one, closed."""
    p = eqn.params
    j = p["jaxpr"] if "jaxpr" in p else p["call_jaxpr"]
    return j if hasattr(j, "consts") else closed_jaxpr(j)


def jit_inlinable(eqn: JaxprEqn) -> bool:
    """A nested ``jit`` can be inlined when it pins no shardings or layouts of its own."""
    p = eqn.params
    for key in ("in_shardings", "out_shardings"):
        if any(type(s).__name__ != "UnspecifiedValue" for s in p.get(key, ())):
            return False
    for key in ("in_layouts", "out_layouts"):
        if any(lay is not None for lay in p.get(key, ())):
            return False
    return not p.get("compiler_options_kvs")


# --- shardings -----------------------------------------------------------------------------

def shards(aval: Any) -> int:
    """Into how many pieces an array of ``aval`` is split across devices, by the mesh axes
    its type names (sharding in types: ``Explicit`` mesh axes in its spec); 1 where the type
    says nothing (``Auto`` axes, where XLA chooses, or no mesh)."""
    try:
        sharding = getattr(aval, "sharding", None)
    except Exception:  # noqa: BLE001 - avals without a sharding (tokens)
        return 1
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if not spec or mesh is None:
        return 1
    explicit = set(getattr(mesh, "explicit_axes", ()) or ())
    n = 1
    for entry in spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis is not None and axis in explicit:
                n *= int(mesh.shape[axis])
    return n


# --- jaxpr surgery (jaxmem.compiling.shard_map)
# ------------------------------------------------------

def closed_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any] = ()) -> ClosedJaxpr:
    return ClosedJaxpr(jaxpr, list(consts))


def replace_params(eqn: JaxprEqn, params: dict[str, Any]) -> JaxprEqn:
    """``eqn`` with new params (same inputs, outputs, effects and source info)."""
    return eqn.replace(params=dict(params))


def with_eqns(jaxpr: Jaxpr, eqns: Sequence[JaxprEqn]) -> Jaxpr:
    """``jaxpr`` with its equations replaced (same inputs, outputs and effects)."""
    return jaxpr.replace(eqns=list(eqns))


def shard_map_kwargs(eqn: JaxprEqn) -> dict[str, Any]:
    """``jax.shard_map`` keyword arguments that re-create a ``shard_map`` equation (its
    params: ``mesh``, ``in_specs``, ``out_specs``, ``check_vma``, ``newly_manual_axes``)."""
    p = eqn.params
    kw: dict[str, Any] = dict(mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                              out_specs=tuple(p["out_specs"]))
    if "check_vma" in p:
        kw["check_vma"] = p["check_vma"]
    elif "check_rep" in p:  # pragma: no cover - older jax
        kw["check_vma"] = p["check_rep"]
    axes = p.get("newly_manual_axes", p.get("manual_axes"))
    if axes is not None:
        kw["axis_names"] = set(axes)
    return kw


def jaxpr_fun(closed: ClosedJaxpr) -> Any:
    """``closed`` as a function of its flat inputs returning its flat outputs."""
    return jcore.jaxpr_as_fun(closed)


# --- managed memory (jaxmem.managed_memory) -----------------------------------------------

def initialized_platforms() -> tuple[str, ...]:
    """Platforms whose XLA backend this process has already created (starts nothing)."""
    from jax._src import xla_bridge

    return tuple(getattr(xla_bridge, "_backends", {}) or ())


def gpu_client_options_from_env() -> dict[str, Any] | None:
    """The PJRT GPU plugin options jaxlib derives from the environment, or None if unknown.

    ``jaxlib.xla_client.generate_pjrt_gpu_plugin_options`` reads the ``XLA_*`` variables
    when the CUDA backend is created; calling it only reads ``os.environ``. Raises what it
    raises (``ValueError`` when both memory-fraction names are set).
    """
    from jaxlib import xla_client

    fn = getattr(xla_client, "generate_pjrt_gpu_plugin_options", None)
    return None if fn is None else dict(fn())


def has_visible_nvidia_gpu() -> bool:
    """True if an NVIDIA device node is visible (JAX's own check; starts nothing)."""
    try:
        from jax._src import hardware_utils

        return bool(hardware_utils.has_visible_nvidia_gpu())
    except (ImportError, AttributeError):  # pragma: no cover - depends on the jax version
        import os

        return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))


def cuda_plugin_installed() -> bool:
    """True if a jax CUDA PJRT plugin (``jax-cuda12-pjrt`` / ``jax-cuda13-pjrt``) is installed."""
    import importlib.util

    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def lowered_platform(lowered: Any) -> str | None:
    """The platform a ``jax.stages.Lowered`` compiles for (``cpu``, ``cuda``, ``rocm``,
    ``tpu``), or None if this jax does not say. Arguments on topology devices lower for
    their target, not for the default backend."""
    low = getattr(lowered, "_lowering", None)
    platforms = getattr(low, "_platforms", None)
    if platforms:
        return str(platforms[0]).lower()
    backend = getattr(low, "compile_args", {}).get("backend") if low is not None else None
    name = getattr(backend, "platform", None)
    if name:
        return "cuda" if name == "gpu" else str(name)
    return None


def has_visible_tpu() -> bool:
    """True if a TPU chip is visible on the PCI bus (JAX's own check; starts nothing)."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # noqa: BLE001 - depends on the jax version; assume one may be there
        return True


def only_known_plugins() -> bool:
    """True if the only JAX PJRT plugins installed are the CUDA ones (``jax_plugins.xla_cuda*``)
    and libtpu, whose devices :func:`has_visible_nvidia_gpu` / :func:`has_visible_tpu` see."""
    import importlib.util
    import pkgutil

    # jax_plugins is the namespace package plugins install into, not a dependency: look it
    # up without importing it.
    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or not spec.submodule_search_locations:
        return True
    names = {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)}
    return names <= {"xla_cuda12", "xla_cuda13"}


def libtpu_installed() -> bool:
    """True if libtpu (TPU compiler and runtime, ``jax[tpu]``) is installed."""
    import importlib.util

    try:
        return importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        return False


def shard_buffers(x: Any) -> list[tuple[Any, int, int]]:
    """``[(device, raw pointer, bytes on device)]`` for each addressable shard of an array.

    ``unsafe_buffer_pointer()`` refuses sharded arrays, so this goes shard by shard.
    """
    out = []
    for s in x.addressable_shards:
        data = s.data
        size = getattr(data, "on_device_size_in_bytes", None)
        nbytes = int(size()) if callable(size) else int(data.nbytes)
        out.append((s.device, int(data.unsafe_buffer_pointer()), nbytes))
    return out


def device_space() -> Any:
    return jax.memory.Space.Device


# --- jaxmem.checkpoint (jaxmem.rewriting.remat)
# -----------------------------------------------------

def current_name_stack() -> Any:
    """The name stack JAX is binding under right now (outer transforms and scopes)."""
    return _siu.current_name_stack()


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


_SCAN_PATCH_LOCK = __import__("threading").RLock()


def tracing() -> bool:
    """Whether JAX is tracing right now (inside ``jit``, ``make_jaxpr``, a transform)."""
    from jax._src import core

    return not core.trace_state_clean()


def under_differentiation() -> bool:
    """Whether JAX is tracing for a derivative right now (a JVP or linearize trace)."""
    from jax._src import core
    from jax._src.interpreters import ad

    kinds = tuple(k for k in (getattr(ad, "JVPTrace", None), getattr(ad, "LinearizeTrace", None))
                  if k is not None)
    return isinstance(core.trace_ctx.trace, kinds)


@contextlib.contextmanager
def checkpointed_scan_bodies(policy: Any, plan_body: Any = None) -> Iterator[None]:
    """While tracing, run every ``lax.scan`` body under ``jax.checkpoint(policy=policy)``.

    The joint-jaxpr rewrite keeps a scan whole, so per-layer remat inside a scanned stack
    (``nn.scan``, ``nnx.scan``, hand-written ``lax.scan``) must be asked for before AD runs.
    JAX has no global hook for that; this swaps ``jax.lax.scan`` (and the ``scan`` that
    ``fori_loop`` calls) for a wrapper for the duration of one trace, under a lock, and
    always restores it. Callers that imported ``scan`` by name before this runs are not
    affected (flax and jaxmem look it up on ``jax.lax`` at call time).

    ``plan_body(f, init, xs, kwargs)``, if given, is asked first about every scan met outside
    differentiation; a function it returns replaces the body (a body that holds its own
    forward and backward: gradient accumulation), ``None`` keeps the policy.
    """
    import functools

    from jax._src.lax.control_flow import loops

    original, original_loops = jax.lax.scan, loops.scan

    def wrap(orig: Any) -> Any:
        @functools.wraps(orig)
        def scan(f: Any, *args: Any, **kwargs: Any) -> Any:
            if plan_body is not None and not under_differentiation():
                planned = plan_body(f, args, kwargs)
                if planned is not None:
                    return orig(planned, *args, **kwargs)
            return orig(jax.checkpoint(f, policy=policy, prevent_cse=False), *args, **kwargs)
        return scan

    with _SCAN_PATCH_LOCK:
        jax.lax.scan, loops.scan = wrap(original), wrap(original_loops)
        try:
            yield
        finally:
            jax.lax.scan, loops.scan = original, original_loops


_GRAD_PATCH_LOCK = __import__("threading").RLock()


@contextlib.contextmanager
def checkpointed_losses(policy: Any, checkpoint: Any = None) -> Iterator[list[str]]:
    """While tracing, differentiate every loss under ``jax.checkpoint(policy=policy)``.

    What a user does by hand to save memory without editing the model: ``jax.value_and_grad
    (jax.checkpoint(loss, policy=...))``. A train step already calls ``jax.value_and_grad``
    (or ``jax.grad``; flax nnx, equinox and optax-style steps do so through them), so for the
    duration of one trace this swaps the two for wrappers that differentiate the loss under
    ``jax.checkpoint`` instead, under a lock, and always restores them. Only a
    differentiation started outside any other is wrapped (a gradient taken inside the loss is
    left alone). Yields the names of the losses wrapped: empty when the step calls neither
    (``jax.vjp`` by hand), so the trace is the plain step's.

    ``checkpoint(fun, policy, found)``: how to checkpoint the loss instead of
    ``jax.checkpoint(fun, policy=policy)``, e.g. each block under its own
    (:func:`jaxmem.rewriting.blockwise.checkpoint_blocks`); a trace that appends ``None`` to
    ``found``
    ran the loss as written, and the loss is not named.
    """
    import functools

    wrapped: list[str] = []
    originals = {"grad": jax.grad, "value_and_grad": jax.value_and_grad}
    depth = [0]  # inside a wrapped differentiation: its loss's own gradients stay as written

    def wrap(orig: Any) -> Any:
        @functools.wraps(orig)
        def transform(fun: Any, *args: Any, **kwargs: Any) -> Any:
            plain = orig(fun, *args, **kwargs)
            found: list[int | None] = []
            remat = orig(checkpoint(fun, policy, found) if checkpoint is not None
                         else jax.checkpoint(fun, policy=policy), *args, **kwargs)

            @functools.wraps(plain)
            def call(*a: Any, **k: Any) -> Any:
                if depth[0] or under_differentiation():
                    return plain(*a, **k)
                depth[0] += 1
                try:
                    out = remat(*a, **k)
                finally:
                    depth[0] -= 1
                if not found or found[-1] is not None:
                    wrapped.append(getattr(fun, "__name__", type(fun).__name__))
                return out
            return call
        return transform

    with _GRAD_PATCH_LOCK:
        jax.grad, jax.value_and_grad = (wrap(originals["grad"]),
                                        wrap(originals["value_and_grad"]))
        try:
            yield wrapped
        finally:
            jax.grad, jax.value_and_grad = originals["grad"], originals["value_and_grad"]
