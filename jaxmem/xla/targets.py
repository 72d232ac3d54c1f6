"""Compile-only targets: the devices of GPUs and TPUs this machine does not have.

Where jaxmem compiles (the box after the rewrite in DESIGN.md's data flow): XLA's GPU and TPU
compilers run without the device (JAX's ahead-of-time path, as MaxText's ``train_compile``
does), given *topology devices* built from a target description. Arguments placed on such a
device (``jax.ShapeDtypeStruct`` with a sharding on it) make ``jax.jit(f).lower(...)`` lower
and compile for that target, and ``memory_analysis()`` reports what the real device would
allocate. A user on a laptop can then ask what a step's peak, plan and largest batch are on
an H100.

Named targets:

========  ========  ===========================================================
name      platform  device
========  ========  ===========================================================
h100      cuda      NVIDIA H100 SXM 80GB (HBM3, 3.35 TB/s)
h200      cuda      NVIDIA H200 141GB (HBM3e, 4.8 TB/s)
a100      cuda      NVIDIA A100 SXM4 80GB (2.04 TB/s)
v5e       tpu       TPU v5 lite, topology ``v5e:2x2``
v5p       tpu       TPU v5p, topology ``v5p:2x2x1``
v4        tpu       TPU v4, topology ``v4:2x2x1``
v6e       tpu       TPU v6 lite (Trillium), topology ``v6e:2x2``
cpu       cpu       this process's own CPU devices
========  ========  ===========================================================

What to install: GPU targets need JAX's CUDA plugin of the installed jax's version without
the CUDA libraries (``pip install "jaxmem[gpu-target]"``, i.e. ``jax[cuda12-local]``); TPU
targets need libtpu (``pip install "jaxmem[tpu-target]"``, i.e. ``jax[tpu]``). On a machine
without an NVIDIA driver the CUDA plugin refuses to start unless
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``; importing jaxmem sets it (only when no NVIDIA GPU is
visible and only if JAX has not started yet). With libtpu installed, set
``JAX_PLATFORMS=cpu`` on a machine without TPUs, or JAX spends seconds looking for one.

Example:
  >>> import jax, jax.numpy as jnp, jaxmem
  >>> args = jaxmem.targets.place((jnp.ones((128, 128)),), "cpu")
  >>> jaxmem.measure.measure(lambda w: (w @ w).sum(), *args).argument
  65536
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxmem import _jax

__all__ = ["Target", "TargetError", "available", "describe", "get", "names", "of", "place",
           "platform_of", "require"]

_CONFIG_DIR = Path(__file__).with_name("target_configs")

#: Name -> (platform, description, GPU config file or TPU topology, device profile).
_NAMED: dict[str, tuple[str, str, str, str]] = {
    "h100": ("cuda", "NVIDIA H100 SXM 80GB", "h100.pbtxt", "h100"),
    "h200": ("cuda", "NVIDIA H200 141GB", "h200.pbtxt", "h200"),
    "a100": ("cuda", "NVIDIA A100 SXM4 80GB", "a100.pbtxt", "a100"),
    "v5e": ("tpu", "TPU v5 lite", "v5e:2x2", "v5e"),
    "v5p": ("tpu", "TPU v5p", "v5p:2x2x1", "v5p"),
    "v4": ("tpu", "TPU v4", "v4:2x2x1", "v4"),
    "v6e": ("tpu", "TPU v6 lite", "v6e:2x2", "v6e"),
    "cpu": ("cpu", "this process's CPU", "", "cpu"),
}

GPU_INSTALL_HINT = (
    'pip install "jaxmem[gpu-target]" (JAX\'s CUDA plugin of the installed jax version, '
    'without the CUDA libraries: pip install "jax[cuda12-local]==$(python -c \'import jax; '
    'print(jax.__version__)\')")')
TPU_INSTALL_HINT = (
    'pip install "jaxmem[tpu-target]" (libtpu for the installed jax: pip install '
    '"jax[tpu]==$(python -c \'import jax; print(jax.__version__)\')"), and set '
    "JAX_PLATFORMS=cpu on machines without TPUs")


class TargetError(RuntimeError):
    """A compile target is unknown or cannot be set up here; the message says what to do."""


def _allow_deviceless_cuda() -> None:
    """Let JAX's CUDA plugin and libtpu sit installed on a machine without their device.

    The CUDA plugin checks the CUDA libraries and driver when JAX starts and raises without
    them: the check is skipped only where no NVIDIA GPU is visible, so a real GPU machine
    keeps JAX's own version checks. libtpu spends seconds looking for a TPU it cannot find:
    where neither an NVIDIA GPU nor a TPU chip is visible and no other JAX plugin is
    installed, JAX would end up on the CPU anyway, so JAX's platforms are set to ``cpu``
    (unless the user set ``JAX_PLATFORMS``). Nothing is changed once JAX has started.
    """
    if _jax.initialized_platforms():
        return
    gpu = _jax.has_visible_nvidia_gpu()
    if "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ and _jax.cuda_plugin_installed() \
            and not gpu:
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    if "JAX_PLATFORMS" not in os.environ and not gpu and not _jax.has_visible_tpu() \
            and not jax.config.jax_platforms and _jax.only_known_plugins() \
            and (_jax.libtpu_installed() or _jax.cuda_plugin_installed()):
        jax.config.update("jax_platforms", "cpu")  # jax read the environment on import


_allow_deviceless_cuda()


@dataclasses.dataclass(frozen=True)
class Target:
    """A device type jaxmem can compile for, with or without the device.

    Attributes:
      name: ``"h100"``, ``"v5e"``, ``"cpu"``, or ``"custom"`` for your own config.
      platform: ``"cuda"``, ``"tpu"`` or ``"cpu"``.
      description: what the device is.
      memory_bytes: device memory per device (the config's ``device_memory_size`` on GPU;
        None where the target does not say).
      topology: ``"1x1x<n>"`` for GPUs (n devices on one host), ``"v5e:2x2"`` etc. for TPUs.
      profile: the :class:`jaxmem.DeviceProfile` preset its costs are computed with.
      config: the GPU target's ``GpuTargetConfig`` text proto.
    """

    name: str
    platform: str
    description: str
    memory_bytes: int | None = None
    topology: str = ""
    profile: str = "cpu"
    config: str | None = dataclasses.field(default=None, repr=False)

    def devices(self) -> list[Any]:
        """The target's devices (topology devices: compile only, nothing runs on them)."""
        if self.platform == "cpu":
            return list(jax.devices("cpu"))
        return list(_topology_devices(self.platform, self.topology, self.config))

    def device(self, index: int = 0) -> Any:
        return self.devices()[index]

    def with_devices(self, n: int) -> Target:
        """The same GPU with ``n`` devices on one host (for sharded steps)."""
        if self.platform != "cuda":
            raise TargetError(f"with_devices is for GPU targets; give a TPU topology such as "
                              f"'{self.name}:4x4' to get(), got {self.name!r}")
        return dataclasses.replace(self, topology=f"1x1x{int(n)}")

    def with_memory(self, nbytes: int | str) -> Target:
        """The same GPU with ``nbytes`` of device memory.

        XLA:GPU rematerialises by itself when a program exceeds the target's memory
        (``HloRematerialization``); a smaller ``device_memory_size`` emulates a smaller
        device, so what the compiler does at that size can be measured here.
        """
        from jaxmem.xla.measure import parse_bytes

        if self.platform != "cuda" or self.config is None:
            raise TargetError(f"with_memory needs a GPU target config, got {self.name!r}")
        size = parse_bytes(nbytes, "device memory") if isinstance(nbytes, str) else int(nbytes)
        if size <= 0:
            raise TargetError(f"with_memory needs a positive size, got {nbytes!r}")
        cfg, n = re.subn(r"device_memory_size:\s*\d+", f"device_memory_size: {size}",
                         self.config)
        if not n:
            raise TargetError("the target config has no device_memory_size to change")
        return dataclasses.replace(self, config=cfg, memory_bytes=size)

    def place(self, tree: Any, sharding: Any = None) -> Any:
        """``tree`` as ``jax.ShapeDtypeStruct`` s on this target (default: on its first
        device), the arguments ``jax.jit(f).lower`` and :func:`jaxmem.optimize` compile for
        it with. ``sharding``: a ``jax.sharding.Sharding`` over :meth:`devices`, or a
        function ``leaf -> Sharding``."""
        return place(tree, self, sharding)

    def __str__(self) -> str:
        mem = "" if self.memory_bytes is None else f", {self.memory_bytes / 2**30:.1f} GiB"
        topo = f", topology {self.topology}" if self.topology else ""
        return f"{self.name} ({self.platform}: {self.description}{mem}{topo})"


def names() -> list[str]:
    """The named targets."""
    return list(_NAMED)


def _memory_of(config: str) -> int | None:
    m = re.search(r"device_memory_size:\s*(\d+)", config)
    return int(m.group(1)) if m else None


def _description_of(config: str) -> str:
    m = re.search(r'device_description_str:\s*"([^"]*)"', config)
    return m.group(1) if m else "custom GPU"


def get(spec: str | Target) -> Target:
    """A :class:`Target` from a name (:func:`names`), ``"<tpu>:<topology>"`` (``"v5e:4x4"``),
    a GPU name with a device count (``"h100:8"``), a ``GpuTargetConfig`` text proto, or the
    path of a file holding one.

    Example:
      >>> import jaxmem
      >>> t = jaxmem.targets.get("h100")
      >>> t.platform, t.memory_bytes
      ('cuda', 84929347584)
    """
    if isinstance(spec, Target):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a target is a name, a config text or a Target, got {type(spec)}")
    text = spec.strip()
    if "gpu_device_info" in text:
        return Target("custom", "cuda", _description_of(text), _memory_of(text), "1x1x1",
                      "h100", text)
    if text.endswith((".pbtxt", ".txtpb", ".textproto")) or os.path.sep in text:
        path = Path(text).expanduser()
        if not path.is_file():
            raise TargetError(f"no target config file at {path}")
        return get(path.read_text())
    name, _, rest = text.lower().partition(":")
    if name not in _NAMED:
        raise TargetError(f"unknown target {spec!r}; choose one of {names()}, give "
                          "'<tpu>:<topology>' (e.g. 'v5e:4x4'), 'h100:<n devices>', or a "
                          "GpuTargetConfig text proto / .pbtxt file")
    platform, desc, where, profile = _NAMED[name]
    if platform == "cpu":
        return Target("cpu", "cpu", desc, None, "", profile)
    if platform == "tpu":
        return Target(name, "tpu", desc, None, f"{name}:{rest}" if rest else where, profile)
    config = (_CONFIG_DIR / where).read_text()
    topology = "1x1x1"
    if rest:
        if not rest.isdigit() or int(rest) < 1:
            raise TargetError(f"{spec!r}: after the GPU name give a device count ('h100:8')")
        topology = f"1x1x{int(rest)}"
    return Target(name, "cuda", desc, _memory_of(config), topology, profile, config)


@functools.lru_cache(maxsize=32)
def _topology_devices(platform: str, topology: str, config: str | None) -> tuple[Any, ...]:
    from jax.experimental import topologies

    if platform == "cuda" and not _jax.cuda_plugin_installed():
        raise TargetError(f"compiling for a GPU target needs JAX's CUDA plugin: "
                          f"{GPU_INSTALL_HINT}")
    if platform == "tpu" and not _jax.libtpu_installed():
        raise TargetError(f"compiling for a TPU target needs libtpu: {TPU_INSTALL_HINT}")
    try:
        if platform == "cuda":
            desc = topologies.get_topology_desc("jaxmem", "cuda", target_config=config,
                                                topology=topology)
        else:
            desc = topologies.get_topology_desc(topology, "tpu")
    except NotImplementedError as e:
        raise TargetError(
            f"JAX could not build {platform} topology devices ({e}). JAX's {platform} plugin "
            "failed when JAX started: on a machine without the device, set "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (GPU) or JAX_PLATFORMS=cpu before the first "
            "JAX computation (importing jaxmem first does it for GPU targets)") from e
    except Exception as e:  # noqa: BLE001 - the plugin's own errors, reworded
        hint = GPU_INSTALL_HINT if platform == "cuda" else TPU_INSTALL_HINT
        raise TargetError(f"could not build {platform} topology {topology!r}: "
                          f"{type(e).__name__}: {e}. If the plugin does not match the "
                          f"installed jax: {hint}") from e
    return tuple(desc.devices)


def _leaf_sharding(leaf: Any) -> Any:
    return getattr(leaf, "sharding", None)


def place(tree: Any, target: str | Target | Any, sharding: Any = None) -> Any:
    """``tree``'s array leaves as ``jax.ShapeDtypeStruct`` s placed for ``target``.

    Args:
      tree: a pytree of arrays or ``ShapeDtypeStruct`` s (other leaves pass through).
      target: a target spec (see :func:`get`), or a device to place everything on.
      sharding: ``None`` (everything on the target's first device), a
        ``jax.sharding.Sharding`` for every leaf, or a function ``leaf -> Sharding``.

    Returns:
      The same structure with ``ShapeDtypeStruct`` leaves: pass them to ``jax.jit(f).lower``
      or to a :func:`jaxmem.optimize` step's ``.lower`` / ``.plan``.
    """
    if isinstance(target, str | Target):
        device = None if sharding is not None else get(target).device()
    else:
        device = target
    single = None if device is None else jax.sharding.SingleDeviceSharding(device)

    def one(x: Any) -> Any:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        s = sharding(x) if callable(sharding) else (sharding or single)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s,
                                    weak_type=getattr(x, "weak_type", False))

    return jax.tree.map(one, tree)


def platform_of(tree: Any) -> str | None:
    """The platform the array leaves of ``tree`` are placed on (``"cpu"``, ``"cuda"``,
    ``"tpu"``), or None when no leaf says (unplaced ``ShapeDtypeStruct`` s, Python
    scalars). Leaves on different platforms raise ``ValueError``."""
    found: set[str] = set()
    for leaf in jax.tree.leaves(tree):
        s = _leaf_sharding(leaf)
        devs = getattr(s, "device_set", None) if s is not None else None
        if devs:
            found.update(_platform_name(d) for d in devs)
    if len(found) > 1:
        raise ValueError(f"arguments are placed on several platforms {sorted(found)}; place "
                         "them all on one target (jaxmem.targets.place)")
    return found.pop() if found else None


def _platform_name(device: Any) -> str:
    p = str(getattr(device, "platform", "cpu")).lower()
    return "cuda" if p in ("gpu", "cuda") else p


def of(tree: Any) -> Target:
    """The :class:`Target` the leaves of ``tree`` live on (the default backend's when they
    do not say): its platform, device kind and memory, matched to a named target where one
    fits (an H100 topology device gives ``get("h100")``)."""
    platform = platform_of(tree) or _platform_name(jax.devices()[0])
    if platform == "cpu":
        return get("cpu")
    kind = ""
    for leaf in jax.tree.leaves(tree):
        s = _leaf_sharding(leaf)
        if s is not None and getattr(s, "device_set", None):
            kind = str(next(iter(s.device_set)).device_kind).lower().replace(" ", "")
            break
    if not kind:
        kind = str(jax.devices()[0].device_kind).lower().replace(" ", "")
    for name, (plat, _, _, _) in _NAMED.items():
        if plat == platform and _kind_matches(name, kind):
            return get(name)
    return Target("unknown", platform, kind or platform, None, "",
                  "h100" if platform == "cuda" else "cpu")


def _kind_matches(name: str, kind: str) -> bool:
    if name in ("h100", "h200", "a100"):
        return name in kind
    tpu = {"v5e": "v5lite", "v5p": "tpuv5", "v4": "tpuv4", "v6e": "v6lite"}[name]
    return tpu in kind and not (name == "v5p" and "lite" in kind)


def available(spec: str | Target) -> bool:
    """Whether this process can build ``spec``'s devices (its plugin is installed and
    started)."""
    try:
        get(spec).devices()
    except TargetError:
        return False
    return True


def require(spec: str | Target) -> Target:
    """:func:`get` and build its devices now, raising :class:`TargetError` with the install
    hint when that fails (for tests and scripts that must not skip silently)."""
    t = get(spec)
    t.devices()
    return t


def describe(targets: Sequence[str] = ()) -> str:
    """One line per target: name, platform, device, memory."""
    return "\n".join(str(get(n)) for n in (targets or names()))
