"""The CUDA runtime (``libcudart``) through ctypes: ``cudaMemAdvise`` and where to find it.

Part of the memory box (``jaxmem.memory``, layer 6), behind :mod:`jaxmem.managed_memory`
(which re-exports every name here). ``cudaMemAdvise`` changed its last parameter in CUDA 13
(a ``struct cudaMemLocation`` instead of a device ordinal); :class:`CudaRuntime` reads the
runtime's version and binds the signature that version exports. :func:`cudart_candidates`
lists the libraries to try, the one the jax CUDA plugin already loaded first. Loading one is
``jaxmem.managed_memory.cuda_runtime()``'s job (it caches the result).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import glob
import importlib.util
import os

from jaxmem.memory.managed_errors import CudaError

__all__ = ["Advice", "CudaRuntime", "advise_signature", "cudart_candidates",
           "nvidia_wheel_cudarts"]

ENV_CUDART = "JAXMEM_CUDART"
"""Set to a ``libcudart.so`` path to choose the CUDA runtime :func:`advise` uses."""


class Advice(enum.IntEnum):
    """``enum cudaMemoryAdvise`` (identical in CUDA 12 and 13)."""

    SET_READ_MOSTLY = 1
    UNSET_READ_MOSTLY = 2
    SET_PREFERRED_LOCATION = 3
    UNSET_PREFERRED_LOCATION = 4
    SET_ACCESSED_BY = 5
    UNSET_ACCESSED_BY = 6


class _MemLocation(ctypes.Structure):
    """``struct cudaMemLocation { enum cudaMemLocationType type; int id; }``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_LOCATION_TYPE = {"device": 1, "host": 2}  # cudaMemLocationTypeDevice / ...Host
_CPU_DEVICE_ID = -1  # cudaCpuDeviceId, the CUDA <= 12 way to say "host"


def advise_signature(version: int) -> str:
    """Which ``cudaMemAdvise`` a CUDA runtime of ``version`` (e.g. 12080, 13000) exports.

    - ``"location"``: CUDA >= 13, ``cudaMemAdvise(const void*, size_t, enum
      cudaMemoryAdvise, struct cudaMemLocation)``;
    - ``"device"``: CUDA <= 12, ``cudaMemAdvise(const void*, size_t, enum
      cudaMemoryAdvise, int device)``, ``-1`` (``cudaCpuDeviceId``) for the host.

    >>> advise_signature(13000), advise_signature(12080)
    ('location', 'device')
    """
    return "location" if version >= 13000 else "device"


class CudaRuntime:
    """A ``libcudart`` loaded with ctypes, with ``cudaMemAdvise`` bound to the right signature.

    >>> rt = CudaRuntime("/usr/local/cuda-13.0/lib64/libcudart.so.13")  # doctest: +SKIP
    >>> rt.version, rt.signature                                        # doctest: +SKIP
    (13000, 'location')
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = ctypes.CDLL(path)
        v = ctypes.c_int(0)
        get_version = self.lib.cudaRuntimeGetVersion
        get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
        get_version.restype = ctypes.c_int
        rc = get_version(ctypes.byref(v))
        if rc != 0 or v.value <= 0:
            raise OSError(f"{path}: cudaRuntimeGetVersion failed (error {rc})")
        self.version: int = v.value
        self.signature: str = advise_signature(self.version)
        self._error_string = self.lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p
        self._error_name = self.lib.cudaGetErrorName
        self._error_name.argtypes = [ctypes.c_int]
        self._error_name.restype = ctypes.c_char_p
        fn = self.lib.cudaMemAdvise
        last = _MemLocation if self.signature == "location" else ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, last]
        fn.restype = ctypes.c_int
        self._mem_advise = fn

    def __repr__(self) -> str:
        return f"CudaRuntime({self.path!r}, version={self.version}, signature={self.signature!r})"

    def error_text(self, code: int) -> str:
        name = (self._error_name(code) or b"?").decode(errors="replace")
        text = (self._error_string(code) or b"?").decode(errors="replace")
        return f"{name} ({text})"

    def mem_advise_rc(
        self, ptr: int, nbytes: int, advice: Advice | int, location: str, device: int
    ) -> int:
        """Raw ``cudaMemAdvise``; returns the ``cudaError_t`` (0 is success)."""
        if location not in _LOCATION_TYPE:
            raise ValueError(f"location must be 'device' or 'host', got {location!r}")
        if self.signature == "location":
            loc = _MemLocation(_LOCATION_TYPE[location], device if location == "device" else 0)
            return int(self._mem_advise(ptr, nbytes, int(advice), loc))
        dev = device if location == "device" else _CPU_DEVICE_ID
        return int(self._mem_advise(ptr, nbytes, int(advice), dev))

    def mem_advise(
        self, ptr: int, nbytes: int, advice: Advice | int, location: str, device: int
    ) -> None:
        """``cudaMemAdvise`` on ``[ptr, ptr + nbytes)``; raises :class:`CudaError` on failure."""
        rc = self.mem_advise_rc(ptr, nbytes, advice, location, device)
        if rc != 0:
            raise CudaError(
                f"cudaMemAdvise({Advice(advice).name}, {location}, device {device}) on "
                f"{nbytes} bytes at {ptr:#x} failed: {self.error_text(rc)}. If this is "
                "cudaErrorInvalidValue, the buffer is not managed memory: call "
                "jaxmem.managed_memory.enable() before the first JAX operation.",
                rc,
            )


def cudart_candidates() -> list[str]:
    """Paths to try for ``libcudart``, best first.

    Order: ``$JAXMEM_CUDART``; the libcudart already mapped into this process (the one the
    jax CUDA plugin loaded); the ``nvidia-cuda-runtime`` wheels (``nvidia/cu13/lib``,
    ``nvidia/cuda_runtime/lib``); ``$CUDA_HOME``; the system library path; ``/usr/local/cuda*``.
    """
    out: list[str] = []
    if os.environ.get(ENV_CUDART):
        out.append(os.environ[ENV_CUDART])
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            path = line.rsplit(" ", 1)[-1].strip()
            if "/libcudart.so" in path:
                out.append(path)
    out.extend(nvidia_wheel_cudarts())
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.extend(sorted(glob.glob(os.path.join(os.environ[var], "lib*", "libcudart.so*"))))
    found = ctypes.util.find_library("cudart")
    if found:
        out.append(found)
    for pattern in ("/usr/local/cuda/lib64/libcudart.so*", "/usr/local/cuda-*/lib64/libcudart.so*"):
        out.extend(sorted(glob.glob(pattern), reverse=True))
    return [p for p in dict.fromkeys(out) if p and not p.endswith((".a", ".py"))]


def nvidia_wheel_cudarts() -> list[str]:
    """``libcudart.so*`` files shipped by installed ``nvidia-cuda-runtime`` wheels."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    out: list[str] = []
    for root in spec.submodule_search_locations or ():
        out.extend(sorted(glob.glob(os.path.join(root, "*", "lib", "libcudart.so*"))))
    return out
