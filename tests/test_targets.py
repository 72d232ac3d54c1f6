"""Compile-only targets (jaxmem.targets): GPU and TPU compilers run here without the device.

These tests compile for an H100 and a TPU v5e *target* (deviceless, XLA:GPU / XLA:TPU) and
assert relations between compiled figures, which are deterministic. They never skip: the
test extra installs JAX's CUDA plugin and libtpu, and without them ``targets.require`` fails
with the install command.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import measure, targets

# Its tests compile the same steps and plans again: each distinct program once (conftest.py).
COMPILE_ONCE = True


@pytest.fixture(scope="module")
def h100():
    return targets.require("h100")  # fails (TargetError with the pip command) without plugin


def _mlp_step():
    """A tiny residual MLP step whose activations dominate its memory (tanh/gelu chains)."""
    def loss(params, x):
        h = x
        for w1, w2 in params:
            h = h + jnp.tanh(jax.nn.gelu(h @ w1) @ w2)
        return jnp.mean(h ** 2)

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    k = jax.random.split(jax.random.key(0), 5)
    params = [(jax.random.normal(k[i], (64, 256)) * 0.1,
               jax.random.normal(k[i + 1], (256, 64)) * 0.1) for i in (0, 2)]
    x = jax.random.normal(k[4], (512, 64))
    return step, (params, x)


def test_named_targets_describe_their_device():
    assert {"h100", "h200", "a100", "v5e", "v5p", "v4", "v6e", "cpu"} <= set(targets.names())
    h = targets.get("h100")
    assert (h.platform, h.memory_bytes) == ("cuda", 84929347584)
    assert targets.get("h200").memory_bytes > h.memory_bytes
    assert targets.get("h100:4").topology == "1x1x4"
    assert targets.get("v5e:4x4").topology == "v5e:4x4"
    assert targets.get(h.config).platform == "cuda"  # a GpuTargetConfig text proto
    small = h.with_memory("100MiB")
    assert small.memory_bytes == 100 * 2**20 and "device_memory_size: 104857600" in small.config
    with pytest.raises(targets.TargetError, match="unknown target"):
        targets.get("h1000")
    with pytest.raises(targets.TargetError, match="device count"):
        targets.get("h100:x")


def test_place_and_platform_of(h100):
    tree = {"w": jnp.ones((4, 4)), "n": 3}
    placed = targets.place(tree, h100)
    assert isinstance(placed["w"], jax.ShapeDtypeStruct) and placed["n"] == 3
    assert targets.platform_of(placed) == "cuda"
    assert targets.of(placed).name == "h100"
    assert targets.platform_of(tree) == "cpu"
    assert targets.of({"w": jax.ShapeDtypeStruct((2,), jnp.float32)}).platform == "cpu"


def test_missing_plugin_fails_with_the_install_command(monkeypatch):
    monkeypatch.setattr(jaxmem._jax, "cuda_plugin_installed", lambda: False)
    targets._topology_devices.cache_clear()
    try:
        with pytest.raises(targets.TargetError, match=r"pip install .*gpu-target"):
            targets.get("a100").devices()
    finally:
        targets._topology_devices.cache_clear()


def test_optimize_compiles_for_the_h100_target_and_saves_memory(h100):
    """optimize(...).lower(<H100 args>).compile() works (the CPU barrier option must not
    reach XLA:GPU, which rejects it), and the plan's H100 peak is below plain jit's there."""
    step, args = _mlp_step()
    placed = targets.place(args, h100)
    assert measure.compiler_options("cuda") == {}
    opt = jaxmem.optimize(step, donate_argnums=())
    compiled = opt.lower(*placed).compile()
    plain = measure.figures(measure.compile(jax.jit(step).lower(*placed)))
    mine = measure.figures(compiled)
    assert mine.peak < plain.peak
    plan = opt.plan(*placed)
    assert plan.compiled.platform == "cuda" and plan.compiled.flops_source == "jaxmem"
    assert plan.compiled.peak == mine.peak and plan.baseline.peak == plain.peak
    assert plan.compiled.flops >= plan.baseline.flops > 0
    with pytest.raises(TypeError, match="abstract argument"):
        opt(*placed)


def test_a_budget_is_met_on_the_h100_target(h100):
    step, args = _mlp_step()
    placed = targets.place(args, h100)
    plain = measure.figures(measure.compile(jax.jit(step).lower(*placed))).peak
    budget = int(0.8 * plain)
    try:
        plan = jaxmem.optimize(step, budget=budget, donate_argnums=()).plan(*placed)
    except jaxmem.BudgetError as e:  # allowed: then the minimum found is above the budget
        assert e.minimum_bytes > budget
    else:
        assert plan.compiled.peak <= budget < plain


def test_plans_are_never_above_plain_on_a_tpu_target():
    v5e = targets.require("v5e")
    step, args = _mlp_step()
    placed = targets.place(args, v5e)
    plan = jaxmem.optimize(step, donate_argnums=()).plan(*placed)
    assert plan.compiled.platform == "tpu" and plan.compiled.flops_source == "xla"
    assert plan.compiled.peak <= plan.baseline.peak


def test_the_target_changes_nothing_on_cpu():
    """Placing on the CPU target compiles as before (barrier option on), same values."""
    step, args = _mlp_step()
    placed = targets.place(args, "cpu")
    assert targets.platform_of(placed) == "cpu"
    out = jaxmem.optimize(step, donate_argnums=())(*args)
    ref = jax.jit(step)(*args)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-5)


@pytest.mark.parametrize("where", ["cpu", "h100"])
def test_hlo_flop_counts_see_matmuls_and_convolutions_after_compilation(where, h100):
    """``hlo_dot_flops`` / ``hlo_conv_flops`` count the optimised HLO: a matmul and a 3x3
    convolution with their gradients are three of each (forward, input and weight
    gradients), also where XLA:GPU lowers the convolutions to cuDNN calls."""
    n, hw, ci, co, k = 2, 8, 4, 8, 3

    def loss(w, kern, x, img):
        y = jax.lax.conv_general_dilated(img, kern, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum((x @ w) ** 2) + jnp.sum(y ** 2)

    args = (jnp.ones((32, 16)), jnp.ones((k, k, ci, co)), jnp.ones((8, 32)),
            jnp.ones((n, hw, hw, ci)))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    lowered = grad.lower(*(args if where == "cpu" else targets.place(args, h100)))
    compiled = measure.compile(lowered)
    assert measure.hlo_dot_flops(compiled) == 3 * 2 * 8 * 32 * 16
    assert measure.hlo_conv_flops(compiled) == 3 * 2 * (n * hw * hw * co) * (k * k * ci)
