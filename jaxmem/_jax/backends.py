"""Backends, devices and PJRT plugins, looked at without starting anything (bottom layer,
:mod:`jaxmem._jax`).

Whether an XLA backend exists in this process yet and for which platforms, the GPU client
options jaxlib would derive from the environment, which accelerators are visible (JAX's own
checks: NVIDIA device nodes, TPU chips on the PCI bus), which PJRT plugins and compilers are
installed, and which platform a ``jax.stages.Lowered`` compiles for. Used by
:mod:`jaxmem.xla.targets`, :mod:`jaxmem.xla.measure` and the managed-memory setup.
"""

from __future__ import annotations

from typing import Any


def default_backend_initialized() -> bool:
    """Whether an XLA backend has already been created in this process."""
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", {}))


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
