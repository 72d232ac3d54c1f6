"""jaxmem.managed_memory: environment, conflicts, enable/status, advise, the cudart binding.

The XLA client reads its settings once, when the backend starts, so the tests of
``enable()`` itself run in a fresh subprocess (two of them). Everything else runs here.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxmem import _jax
from jaxmem import managed_memory as mm

ROOT = Path(__file__).resolve().parents[1]


def _fresh_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in mm.ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"  # deterministic everywhere, GPU machines included
    return env


def _run_fresh(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a new interpreter (no backend yet); it prints one JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env or _fresh_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def clean_env(monkeypatch):
    for k in mm.ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(mm, "_WARNED", set())
    return monkeypatch


# --- pure parts -----------------------------------------------------------------------------

def test_environment_values_and_validation():
    assert mm.environment(1.5) == {
        "TF_FORCE_UNIFIED_MEMORY": "1",
        "XLA_CLIENT_MEM_FRACTION": "1.5",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    assert mm.environment(1, preallocate=True)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert mm.ENV_FRACTION_DEPRECATED not in mm.environment(2.0)
    with pytest.raises(ValueError, match="device_memory \\* max\\(1, fraction\\)"):
        mm.environment(0.8)
    with pytest.raises(ValueError, match=">= 1"):
        mm.environment(float("nan"))
    with pytest.raises(TypeError, match="oversubscription"):
        mm.environment("lots")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "environ, pattern",
    [
        ({"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
         "are both set"),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"}, "deprecated name"),
        ({"XLA_CLIENT_MEM_FRACTION": "0.75"}, "below 1 it caps"),
        ({"XLA_CLIENT_MEM_FRACTION": "2.0"}, "but 1.5 was requested"),
        ({"TF_FORCE_UNIFIED_MEMORY": "false"}, "turns managed memory off"),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, "PREALLOCATE=true is already set"),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, "BFC allocator"),
    ],
)
def test_conflicts_are_reported(environ, pattern):
    problems = mm.conflicts(mm.environment(1.5), environ)
    assert any(re.search(pattern, p) for p in problems), problems
    assert all(("unset" in p.lower() or "override" in p) for p in problems)  # says what to do


def test_equal_settings_are_not_conflicts():
    same = {"TF_FORCE_UNIFIED_MEMORY": "true", "XLA_CLIENT_MEM_FRACTION": "1.50",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "False", "XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}
    assert mm.conflicts(mm.environment(1.5), same) == []


# --- enable / status in a fresh process -----------------------------------------------------

def test_enable_sets_exactly_what_the_xla_client_reads():
    out = _run_fresh(
        """
        import json, os, warnings
        from jaxlib import xla_client
        import jaxmem.managed_memory as mm
        from jaxmem import _jax
        res = {}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            st = mm.enable(oversubscription=1.5)
        res["warnings"] = [str(x.message) for x in w]
        res["opts"] = xla_client.generate_pjrt_gpu_plugin_options()
        res["status_opts"] = st.client_options
        res["env"] = {k: os.environ.get(k) for k in mm.ENV_VARS}
        res["pending"] = st.in_force is None and not _jax.default_backend_initialized()
        st2 = mm.enable(oversubscription=1.25, preallocate=True)  # our own values: no conflict
        res["opts2"] = xla_client.generate_pjrt_gpu_plugin_options()
        import jax.numpy as jnp
        float(jnp.ones(3).sum())                                  # the backend starts here
        res["after"] = mm.status().in_force
        env_before = dict(os.environ)
        try:
            mm.enable(oversubscription=2.0)
            res["late"] = None
        except mm.ManagedMemoryError as e:
            res["late"] = str(e)
        res["env_unchanged"] = dict(os.environ) == env_before
        res["again"] = mm.enable(oversubscription=1.25, preallocate=True).requested
        print(json.dumps(res))
        """
    )
    opts = out["opts"]
    assert opts["memory_fraction"] == 1.5 and opts["preallocate"] is False
    assert out["status_opts"] == opts
    assert out["env"] == {
        "TF_FORCE_UNIFIED_MEMORY": "1",
        "XLA_CLIENT_MEM_FRACTION": "1.5",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": None,  # never both names
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_ALLOCATOR": None,
    }
    assert out["pending"]
    assert out["opts2"]["memory_fraction"] == 1.25 and out["opts2"]["preallocate"] is True
    assert any("no effect" in w for w in out["warnings"])  # JAX_PLATFORMS=cpu here
    assert out["after"] is False  # a CPU backend: not in force
    late = out["late"]
    assert late and "before the first JAX operation" in late
    assert "export TF_FORCE_UNIFIED_MEMORY=1" in late
    assert "export XLA_CLIENT_MEM_FRACTION=2.0" in late
    assert "python -m jaxmem managed-memory --oversubscription 2.0 -- python" in late
    assert out["env_unchanged"]
    assert out["again"] is True  # same settings again after start: fine, not an error


def test_enable_reports_conflicts_instead_of_overwriting():
    out = _run_fresh(
        """
        import json, os, warnings
        import jaxmem.managed_memory as mm
        from jaxlib import xla_client
        warnings.simplefilter("ignore")
        cases = {
            "both": {"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
            "below1": {"XLA_CLIENT_MEM_FRACTION": "0.75"},
            "deprecated": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"},
        }
        res = {}
        for name, env in cases.items():
            for k in mm.ENV_VARS:
                os.environ.pop(k, None)
            os.environ.update(env)
            try:
                mm.enable(oversubscription=1.5)
                res[name] = {"error": None}
            except mm.ManagedMemoryError as e:
                res[name] = {"error": str(e)}
            res[name]["untouched"] = {k: os.environ.get(k) for k in env} == env and (
                "TF_FORCE_UNIFIED_MEMORY" not in os.environ)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                mm.enable(oversubscription=1.5, override=True)
            res[name]["override_warned"] = any("replaced" in str(x.message) for x in w)
            res[name]["opts"] = xla_client.generate_pjrt_gpu_plugin_options()
            mm._REQUESTED = None
        print(json.dumps(res))
        """
    )
    assert "are both set" in out["both"]["error"]
    assert "below 1 it caps" in out["below1"]["error"]
    assert "deprecated name" in out["deprecated"]["error"]
    for case in out.values():
        assert "nothing was changed" in case["error"] and "override=True" in case["error"]
        assert case["untouched"]
        assert case["override_warned"]
        assert case["opts"]["memory_fraction"] == 1.5  # and XLA no longer sees two names


# --- in this process (backend already started) ----------------------------------------------

def test_enable_after_backend_start_raises_and_changes_nothing(clean_env):
    jnp.zeros(1).block_until_ready()
    assert _jax.default_backend_initialized()
    with pytest.raises(mm.ManagedMemoryError, match="before the first JAX operation") as ei:
        mm.enable(oversubscription=1.5)
    assert "python -m jaxmem managed-memory" in str(ei.value)
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=false" in str(ei.value)
    assert all(k not in os.environ for k in mm.ENV_VARS)


def test_status_after_start_on_cpu(clean_env):
    jnp.zeros(1).block_until_ready()
    st = mm.status()
    assert st.backend_initialized and "cpu" in st.platforms
    assert st.in_force is False and not st.unified_memory
    assert "managed memory" in str(st)


# --- advise --------------------------------------------------------------------------------

def test_advise_on_cpu_warns_once_and_returns_tree(clean_env):
    tree = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4), "step": 3}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert mm.advise(tree, "params") is tree
        mm.advise(tree, "inputs")
        mm.advise_train_state(tree, jnp.ones((2, 4)), opt_state=tree)
    msgs = [x for x in w if issubclass(x.category, mm.ManagedMemoryWarning)]
    assert len(msgs) == 1 and "not on a CUDA GPU" in str(msgs[0].message)
    assert mm.advise({}, "params") == {}


def test_advise_argument_errors(clean_env):
    x = jnp.ones(3)
    with pytest.raises(ValueError, match="unknown kind 'weights'.*params"):
        mm.advise(x, "weights")
    with pytest.raises(ValueError, match="fixes its own locations"):
        mm.advise(x, "params", location="host")
    with pytest.raises(ValueError, match="location must be"):
        mm.advise(x, "preferred_location", location="gpu")
    y = jax.jit(lambda a: a + 1, donate_argnums=0)
    z = jnp.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU may not honour donation
        y(z)
    if z.is_deleted():
        with pytest.raises(ValueError, match="donated"):
            mm.advise(z, "params")


class _FakeDevice:
    platform = "gpu"

    def __init__(self, i: int) -> None:
        self.id = self.local_hardware_id = i


class _FakeRuntime:
    path, version = "fake", 13000

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mem_advise(self, ptr, nbytes, advice, location, device):
        self.calls.append((ptr, nbytes, mm.Advice(advice).name, location, device))


def test_advise_maps_kinds_per_shard_and_caches(clean_env):
    """The GPU path with a fake runtime: per shard, the three-type mapping, no repeats."""
    rt = _FakeRuntime()
    shards = {
        "p": [(_FakeDevice(0), 0x1000, 256), (_FakeDevice(1), 0x9000, 256)],
        "x": [(_FakeDevice(0), 0x2000, 64)],
        "o": [(_FakeDevice(0), 0x3000, 32)],
    }
    arrays = {k: jnp.ones(i + 1) for i, k in enumerate(shards)}
    lookup = {id(v): shards[k] for k, v in arrays.items()}
    clean_env.setattr(_jax, "shard_buffers", lambda a: lookup[id(a)])
    clean_env.setattr(mm, "_RUNTIME", rt)
    clean_env.setattr(mm, "_APPLIED", set())
    clean_env.setattr(mm, "_ADVISED", {})
    clean_env.setattr(mm, "_ADVISED_BYTES", {})
    clean_env.setenv("TF_FORCE_UNIFIED_MEMORY", "1")

    mm.advise_train_state({"w": arrays["p"]}, arrays["x"], opt_state=[arrays["o"]])
    assert rt.calls == [
        (0x1000, 256, "SET_READ_MOSTLY", "device", 0),
        (0x9000, 256, "SET_READ_MOSTLY", "device", 1),
        (0x2000, 64, "SET_ACCESSED_BY", "device", 0),
        (0x2000, 64, "SET_ACCESSED_BY", "host", 0),
        (0x3000, 32, "SET_PREFERRED_LOCATION", "device", 0),
    ]
    mm.advise_train_state({"w": arrays["p"]}, arrays["x"], opt_state=[arrays["o"]])
    assert len(rt.calls) == 5  # buffers that did not move are not advised again
    mm.advise(arrays["x"], "preferred_location", location="host")
    assert rt.calls[-1] == (0x2000, 64, "SET_PREFERRED_LOCATION", "host", 0)
    st = mm.status()
    assert st.advised_buffers == {"params": 2, "inputs": 1, "intermediates": 1,
                                  "preferred_location": 1}
    assert st.advised_bytes["params"] == 512


def test_advise_without_managed_memory_warns(clean_env):
    clean_env.setattr(_jax, "shard_buffers", lambda a: [(_FakeDevice(0), 0x1000, 8)])
    clean_env.setattr(mm, "_RUNTIME", _FakeRuntime())
    with pytest.warns(mm.ManagedMemoryWarning, match="not managed memory.*enable\\(\\)"):
        mm.advise(jnp.ones(2), "params")


def test_shard_buffers_on_a_real_array():
    x = jnp.arange(16, dtype=jnp.float32)
    [(device, ptr, nbytes)] = _jax.shard_buffers(x)
    assert device == x.devices().pop() and ptr > 0 and nbytes == 64


# --- the ctypes binding ------------------------------------------------------------------

def _header_last_param(lib: str) -> str | None:
    """The last parameter of ``cudaMemAdvise`` in the toolkit header next to ``lib``."""
    root = Path(os.path.realpath(lib)).parent
    for cand in (root.parent / "include", root.parent.parent / "include"):
        header = cand / "cuda_runtime_api.h"
        if header.exists():
            m = re.search(r"cudaMemAdvise\(([^)]*)\);", header.read_text(errors="replace"))
            if m:
                return m.group(1).split(",")[-1].strip()
    return None


def _check_binding(path: str) -> None:
    rt = mm.CudaRuntime(path)
    assert rt.version >= 11000
    fn = rt.lib.cudaMemAdvise
    assert fn.argtypes[:3] == [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if rt.version >= 13000:
        assert rt.signature == "location" and fn.argtypes[3] is mm._MemLocation
        assert ctypes.sizeof(mm._MemLocation) == 8
    else:
        assert rt.signature == "device" and fn.argtypes[3] is ctypes.c_int
    last = _header_last_param(path)
    if last is not None:  # the toolkit header agrees with the binding
        assert ("cudaMemLocation" in last) == (rt.signature == "location"), last
    # A real call through the binding: a host buffer is not managed memory (and there may be
    # no driver), so CUDA must answer with an error code, and we must turn it into CudaError.
    buf = ctypes.create_string_buffer(4096)
    rc = rt.mem_advise_rc(ctypes.addressof(buf), 4096, mm.Advice.SET_READ_MOSTLY, "device", 0)
    assert rc != 0
    with pytest.raises(mm.CudaError, match="cudaMemAdvise.*failed: cudaError") as ei:
        rt.mem_advise(ctypes.addressof(buf), 4096, mm.Advice.SET_ACCESSED_BY, "host", 0)
    assert ei.value.code != 0


_TOOLKIT_LIBS = sorted(
    p for p in glob.glob("/usr/local/cuda*/lib64/libcudart.so.*") if re.search(r"\.so\.\d+$", p)
)


@pytest.mark.skipif(not _TOOLKIT_LIBS, reason="no CUDA toolkit libcudart under /usr/local/cuda*")
@pytest.mark.parametrize("path", _TOOLKIT_LIBS or ["none"])
def test_binding_against_toolkit_cudart(path):
    _check_binding(path)


_WHEEL_LIBS = [p for p in mm.nvidia_wheel_cudarts() if re.search(r"\.so\.\d+$", p)]


@pytest.mark.skipif(not _WHEEL_LIBS, reason="the nvidia-cuda-runtime wheel is not installed")
@pytest.mark.parametrize("path", _WHEEL_LIBS or ["none"])
def test_binding_against_wheel_cudart(path):
    _check_binding(path)


def test_advise_signature_by_version():
    assert mm.advise_signature(13000) == "location" and mm.advise_signature(13020) == "location"
    assert mm.advise_signature(12080) == "device" and mm.advise_signature(11080) == "device"


# --- the GPU benchmark script -----------------------------------------------------------------

@pytest.mark.skipif(
    _jax.cuda_plugin_installed() and _jax.has_visible_nvidia_gpu(),
    reason="a GPU is present: the script would run the real benchmark (minutes)",
)
def test_gpu_benchmark_exits_cleanly_without_gpu(tmp_path):
    out = tmp_path / "mm.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "managed_memory_gpu.py"), "--out", str(out)],
        env=_fresh_env() | {"JAX_PLATFORMS": ""}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "No NVIDIA GPU" in proc.stdout and "ready" in proc.stdout
    assert json.loads(out.read_text())["status"] == "skipped"
