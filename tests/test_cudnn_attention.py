"""The zoo decoders' attention switch: ``jax.nn.dot_product_attention`` and cuDNN flash attention.

``attention="dot_product"`` calls ``jax.nn.dot_product_attention`` with JAX's own choice of
implementation (XLA's einsums and softmax in jax 0.10.2, on every platform); on CPU its
step under ``jaxmem.optimize`` gives ``jax.jit``'s results and the same loss as the zoo's own
softmax. ``attention="cudnn"`` asks for cuDNN's fused flash attention: jaxmem sees its
forward and backward primitives as heavy layers with FLOPs, and the step compiled for the
H100 target holds cuDNN's custom calls at a peak no higher than ``jax.jit``'s.

Shapes: batch 2, sequence 64, 4 query heads over 2 key/value heads, head dim 16, 2 layers
(the zoo Llama's ``test`` size with ``seq=64, d_model=64``).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from benchmarks import zoo
from benchmarks.zoo import llama
from jaxmem import measure, primitives, targets
from tests._fast_compile import fast_jaxmem_compiles, fast_run

#: batch 2 and 2 layers are the test size's own; heads 4, kv_heads 2 too; d_model 64 / 4 heads
#: gives head dim 16 (a multiple of 8, as cuDNN wants; its scale 1/4 is exact in bfloat16).
SHAPES = dict(seq=64, d_model=64)
#: Each leaf within this fraction of its largest magnitude: docs/testing.md's compiled
#: tolerance for a program with a bf16 section (the zoo Llama computes in bf16; a recompute
#: plan's fusions round differently: MEDL's plan here moves the grad norm by 6e-5 of it).
RTOL = 3e-2


def _workload(attention: str, name: str = "llama"):
    return zoo.make(name, size="test", attention=attention, **SHAPES)


def _close_to_scale(ref, out, tol: float, what: str) -> None:
    """Each leaf equal within ``tol`` of that leaf's largest magnitude (plus 1e-7)."""
    paths = jax.tree_util.tree_flatten_with_path(ref)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(out), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(a), initial=0.0))
        err = float(np.max(np.abs(a - b), initial=0.0))
        assert err <= tol * scale + 1e-7, (
            f"{what}{jax.tree_util.keystr(path)}: |diff| {err:.3g} vs max |ref| {scale:.3g}")


def test_settings_are_opt_in():
    for name in ("llama", "llama_scan", "llama_nnx_scan", "transformer", "transformer_scan"):
        for size in ("test", "bench"):
            assert zoo.config(name, size)["attention"] == "softmax"
    assert llama.model_config("8b").attention == "softmax"
    with pytest.raises(ValueError, match="attention must be one of"):
        llama.model_config("test", attention="flash")
    with pytest.raises(ValueError, match="attention must be one of"):
        zoo.make("transformer", size="test", attention="flash", abstract=True)


def test_dot_product_under_optimize_equals_jit_on_cpu(monkeypatch):
    # values only: the rewrite and jax.jit both compiled the fast way (tests/_fast_compile.py)
    fast_jaxmem_compiles(monkeypatch)
    w = _workload("dot_product")
    copy = lambda: jax.tree.map(jnp.copy, w.args)  # optimize donates the state
    ref_state, ref_metrics = fast_run(w.step, *copy())
    opt = jaxmem.optimize(w.step, verify=False)  # MEDL's plan as the rewrite runs it
    new_state, metrics = opt(*copy())
    # the plan that ran (its cache entry), without plan()'s compile of the plain step for
    # the report's figures, which this test does not read
    plan = opt._prepare(copy(), {})[0].plan  # noqa: SLF001
    assert plan.recompute, "nothing recomputed: the rewrite was not tested"
    # The loss and grad norm, and the new state: after one adamw step its first moments are
    # 0.1 x the gradients and its second 0.05 x their squares, so the gradients are compared.
    _close_to_scale(ref_metrics, metrics, RTOL, "metrics")
    _close_to_scale(ref_state, new_state, RTOL, "state")
    # (per-layer jax.checkpoint under plain jax.jit moves this bf16 model's gradients by up
    # to 1.5% of a leaf's max on XLA:CPU, with either attention; tests/test_llama.py
    # compares such variants at 2**-6.)


@pytest.mark.parametrize("name", ["llama", "transformer"])
def test_dot_product_and_softmax_give_the_same_loss_on_cpu(name):
    extra = dict(dropout=0.0) if name == "transformer" else {}  # dot_product drops no weights
    shapes = SHAPES if name == "llama" else dict(seq=64, d_model=64, heads=4)
    soft = zoo.make(name, size="test", attention="softmax", **shapes, **extra)
    dot = zoo.make(name, size="test", attention="dot_product", **shapes, **extra)
    assert jax.tree.structure(soft.state) == jax.tree.structure(dot.state)
    loss_soft, _ = fast_run(soft.loss_and_grads, *soft.args)  # both the fast way: values
    loss_dot, _ = fast_run(dot.loss_and_grads, *soft.args)  # the same parameters and batch
    np.testing.assert_allclose(float(loss_dot), float(loss_soft), rtol=1e-5)


def test_attention_primitives_are_heavy_with_flops():
    for name in sorted(primitives.ATTENTION_FWD | primitives.ATTENTION_BWD):
        assert primitives.classify(name) == "heavy"
    q = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.bfloat16)
    full = 4.0 * 2 * 4 * 64 * 64 * 16
    fwd = primitives.flops("dot_product_attention_fwd_wrapper", [q, kv, kv], [],
                           {"layout": 0, "mask_type": "MaskType.CAUSAL"})
    bwd = primitives.flops("dot_product_attention_bwd_wrapper", [q, kv, kv], [],
                           {"layout": 0, "mask_type": "MaskType.NO_MASK"})
    assert (fwd, bwd) == (full / 2, 2.5 * full)


@functools.cache
def _cudnn_missing() -> str | None:
    """Why ``implementation="cudnn"`` cannot be traced here (None: it can): JAX asks the CUDA
    plugin for cuDNN's version when it traces the call, and the gpu-target extra
    (``jax[cuda12-local]``) installs no cuDNN."""
    q = jax.ShapeDtypeStruct((1, 8, 1, 16), jnp.bfloat16)
    try:
        jax.eval_shape(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                         implementation="cudnn"), q, q, q)
    except RuntimeError as e:
        return f"{e} (pip install 'nvidia-cudnn-cu12>=9.8,<10')"
    return None


@pytest.fixture(scope="module")
def h100():
    target = targets.require("h100")  # as tests/test_targets.py: fails without the plugin
    if _cudnn_missing():
        pytest.skip(f"cuDNN attention does not trace here: {_cudnn_missing()}")
    return target


def test_cudnn_step_compiles_for_the_h100_target_with_the_fused_call(h100):
    w = _workload("cudnn")
    args = h100.place(w.args)
    analysis = jaxmem.analyze(w.step, *args)
    attention = {r.primitive for r in analysis.residuals
                 if r.primitive.startswith("dot_product_attention")}
    assert attention == {"dot_product_attention_fwd_wrapper"}
    assert all(r.kind == "heavy" for r in analysis.residuals
               if r.primitive in attention)
    assert not analysis.unknown_primitives

    # verify="predicted" compiles the best-predicted plan (and the plain step to check it
    # against) rather than every candidate: 2 XLA:GPU compiles instead of 6.
    opt = jaxmem.optimize(w.step, verify="predicted")
    lowered = opt.lower(*args)
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= set(
        re.findall(r"__cudnn\$fmha\w+", lowered.as_text()))  # the StableHLO custom calls
    hlo = lowered.compile().as_text()  # XLA:GPU's optimised HLO (deviceless compile)
    calls = set(re.findall(r"__cudnn\$fmha\w+", hlo))
    assert calls == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    plan = opt.plan(*args)
    plain = plan.baseline or measure.figures(measure.compile(
        jax.jit(w.step, donate_argnums=0).lower(*args)))  # donated as optimize donates
    assert plan.compiled.platform == "cuda"
    assert plan.compiled.peak <= plain.peak
