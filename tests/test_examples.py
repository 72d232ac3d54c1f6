"""Every example script runs at its CI size, and the quickstart notebook executes headlessly.

The scripts and the notebook run in subprocesses started together (compiles are mostly
single-threaded, so two CPU cores run two at once); each test then waits for its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._fast_compile import xla_flags

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = ["resnet_linen.py", "gpt_chunked_ce.py", "nnx_model.py"]
TIMEOUT = 300  # a hang guard, not a timing assertion


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("JAX_PLATFORMS", "cpu")
    # conftest.py's -O0 and XLA:CPU's loop emitters (tests/_fast_compile.py): these tests
    # read what the scripts print, not its figures; the scripts choose the same plans (their
    # peaks move by a few KiB) for 60% of the CPU time
    env["XLA_FLAGS"] = xla_flags("--xla_cpu_use_fusion_emitters=false")
    return env


_NOTEBOOK_RUNNER = """
import sys, nbformat, nbclient
nb = nbformat.read(sys.argv[1], as_version=4)
nbclient.NotebookClient(nb, kernel_name="python3", timeout=240,
                        resources={"metadata": {"path": sys.argv[2]}}).execute()
kinds = [o.output_type for c in nb.cells if c.cell_type == "code" for o in c.outputs]
images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
             for o in c.outputs)
html = sum("text/html" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
           for o in c.outputs)
print(f"OK outputs={len(kinds)} images={images} html={html}")
"""


@pytest.fixture(scope="module")
def runs():
    """Start every script and the notebook at once; ``runs[name]`` waits for one's output."""
    procs = {}
    for name in SCRIPTS:
        procs[name] = subprocess.Popen(
            [sys.executable, str(EXAMPLES / name), "--small"], cwd=ROOT, env=_env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if _have_notebook_tools():
        procs["quickstart.ipynb"] = subprocess.Popen(
            [sys.executable, "-c", _NOTEBOOK_RUNNER, str(EXAMPLES / "quickstart.ipynb"),
             str(EXAMPLES)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
    done: dict[str, tuple[int, str]] = {}

    def result(name: str) -> tuple[int, str]:
        if name not in done:
            out, _ = procs[name].communicate(timeout=TIMEOUT)
            done[name] = (procs[name].returncode, out)
        return done[name]

    yield result
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def _have_notebook_tools() -> bool:
    try:
        import ipykernel  # noqa: F401
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError:
        return False
    return True


def test_every_script_in_examples_is_covered():
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - {"demo.py"}
    assert scripts == set(SCRIPTS)


def test_resnet_linen(runs):
    rc, out = runs("resnet_linen.py")
    assert rc == 0, out
    assert "jaxmem.Plan" in out and "BatchNorm" in out
    assert "step 1: loss" in out
    assert "compiled peak: plain jit" in out


def test_gpt_chunked_ce(runs):
    rc, out = runs("gpt_chunked_ce.py")
    assert rc == 0, out
    assert "jaxmem.chunked_cross_entropy" in out and "full logits" in out
    assert "step 1: loss" in out


def test_nnx_model(runs):
    rc, out = runs("nnx_model.py")
    assert rc == 0, out
    # named_scopes put nnx module paths into the analysis
    assert "blocks/0/up" in out or "blocks/0" in out
    for wrapper in ("nnx.remat(Block)", "nnx.intercept(Block)", "nnx.chunked(head"):
        assert wrapper in out
    assert "step 1: loss" in out


def test_scripts_offer_make_step_for_the_cli():
    """``python -m jaxmem plan examples/x.py:make_step`` needs a ``make_step(batch=...)``."""
    import ast

    for name in SCRIPTS:
        tree = ast.parse((EXAMPLES / name).read_text())
        funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        assert "make_step" in funcs and "main" in funcs, name
        assert funcs["make_step"].args.args[0].arg == "batch", name


def test_python3_kernelspec_comes_with_ipykernel():
    """nbclient needs a ``python3`` kernelspec; ipykernel provides it without a manual install."""
    pytest.importorskip("ipykernel")
    kernelspec = pytest.importorskip("jupyter_client.kernelspec")
    spec = kernelspec.KernelSpecManager().get_kernel_spec("python3")
    assert "ipykernel" in " ".join(spec.argv)


def test_quickstart_notebook_executes(runs):
    if not _have_notebook_tools():
        pytest.skip("nbformat, nbclient and ipykernel are in the [test] extra")
    rc, out = runs("quickstart.ipynb")
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("OK "))
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert int(fields["images"]) >= 2  # the memory timeline and the comparison
    assert int(fields["html"]) >= 1  # the Analysis table
