"""The Llama zoo models (benchmarks/zoo/llama.py) and MaxText's remat presets.

Compiling is what this file spends its time on, so each variant is compiled once (its step and
its loss_and_grads in one program, which XLA shares) and every preset is checked in one program
of single layers. Programs are compiled through ``jaxmem.measure.compile``, which keeps the
optimisation barriers on CPU: without them XLA folds each recomputation back into the forward
pass and a remat test would compare the plain program with itself.

Tolerance: the models compute in bfloat16 (8-bit mantissa, eps = 2**-7). Values that must agree
are compared leaf by leaf within 2**-6 of the tree's largest magnitude: two bf16 roundings,
which is what a reordered reduction or a differently fused bf16 op may cost. A wrong gradient
is off by far more.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.zoo import llama
from benchmarks.zoo.maxtext_presets import NAMES, PRESETS
from tests._fast_compile import fast_compile

BF16_RTOL = 2.0**-6
# LLVM at -O0 halves CPU compile time, and XLA:CPU's older loop emitters (no fusion
# emitters) take a third of the time again; every program compared is compiled the same way,
# and these tests check values, not speed.
_compile = fast_compile


@functools.cache
def _workload(name: str):
    return llama.make(name, size="test")


@functools.cache
def _compiled(name: str):
    """``(state, batch) -> ((new_state, metrics), (loss, grads))``, compiled once per variant."""
    w = _workload(name)
    both = lambda state, batch: (w.step(state, batch), w.loss_and_grads(state, batch))
    return _compile(jax.jit(both).lower(*w.args))


def _loss_and_grads(name: str, params=None):
    """The variant's loss and grads on its own state, or on ``params`` in place of its own."""
    w = _workload(name)
    state = w.state if params is None else dict(w.state, params=params)
    _, (loss, grads) = _compiled(name)(state, w.batch)
    return loss, grads


def _assert_close(actual, expected, what: str, rtol: float = BF16_RTOL) -> None:
    """Every leaf within ``rtol`` of the largest magnitude in ``expected`` (see the docstring)."""
    expected_leaves = [np.asarray(e, np.float32) for e in jax.tree.leaves(expected)]
    scale = max(float(np.max(np.abs(e), initial=0.0)) for e in expected_leaves)
    scale = max(scale, float(np.finfo(np.float32).tiny))
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, _), e, a in zip(paths, expected_leaves, jax.tree.leaves(actual), strict=True):
        err = float(np.max(np.abs(np.asarray(a, np.float32) - e), initial=0.0)) / scale
        assert err <= rtol, f"{what}{jax.tree_util.keystr(path)}: relative error {err:.3g}"


@pytest.mark.parametrize("name", llama.names())
def test_step_runs_and_loss_decreases(name):
    w, run = _workload(name), _compiled(name)
    state, losses = w.state, []
    for _ in range(3):
        (state, metrics), _ = run(state, w.batch)
        losses.append(float(metrics["loss"]))
        assert math.isfinite(float(metrics["grad_norm"]))
    assert all(map(math.isfinite, losses)) and losses[0] > losses[1] > losses[2], losses
    assert int(state["step"]) == 3


@pytest.mark.parametrize("name", llama.names())
def test_master_weights_and_grads_are_float32(name):
    _, grads = _loss_and_grads(name)
    dtypes = {x.dtype for x in jax.tree.leaves((_workload(name).state["params"], grads))}
    assert dtypes == {jnp.dtype(jnp.float32)}


def test_scan_matches_unrolled_on_stacked_params():
    w, s = _workload("llama"), _workload("llama_scan")
    np.testing.assert_array_equal(w.batch["x"], s.batch["x"])
    loss, grads = _loss_and_grads("llama")
    loss_s, grads_s = _loss_and_grads("llama_scan", llama.stack_layers(w.state["params"], 2))
    _assert_close(loss_s, loss, "loss")
    _assert_close(grads_s, llama.stack_layers(grads, 2), "grads")


def _nnx_as_linen_scan(tree):
    """llama_nnx_scan's parameter tree (an nnx.State) laid out as llama_scan's."""
    pure = nnx.to_pure_dict(tree)
    return {**pure, "layers": {"layer": pure["layers"]}}


def test_nnx_scan_computes_the_linen_model():
    n = _workload("llama_nnx_scan")
    loss, grads = _loss_and_grads("llama_nnx_scan")
    loss_l, grads_l = _loss_and_grads("llama_scan", _nnx_as_linen_scan(n.state["params"]))
    _assert_close(loss, loss_l, "loss")
    _assert_close(_nnx_as_linen_scan(grads), grads_l, "grads")


# ---------------------------------------------------------------------------------------------
# MaxText's names and presets, on one decoder layer
# ---------------------------------------------------------------------------------------------


def _one_layer():
    """A test-size layer's parameters, an input and the checkpointed loss of the layer."""
    cfg = llama.model_config("test")
    params = _workload("llama").state["params"]["layer_0"]
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model), jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

    def loss(params, x, policy):
        layer = lambda x, params: llama.decoder_layer(x, params, cfg)
        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy)
        return jnp.sum(layer(x, params).astype(jnp.float32) * cotangent)

    return params, x, loss


def test_layer_tags_every_maxtext_name_in_bfloat16():
    params, x, loss = _one_layer()
    jaxpr = jax.make_jaxpr(loss, static_argnums=2)(params, x, None)
    tagged = {e.params["name"]: e.outvars[0].aval.dtype
              for e in jaxpr.eqns if e.primitive.name == "name"}
    assert tuple(tagged) == NAMES
    assert set(tagged.values()) == {jnp.dtype(jnp.bfloat16)}


def _saved_residuals(policy) -> str:
    params, x, loss = _one_layer()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(functools.partial(loss, policy=policy), params, x)
    return out.getvalue()


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_keeps_exactly_its_names(preset):
    p = PRESETS[preset]
    assert set(p.save) | set(p.offload) <= set(NAMES) and p.doc
    text = _saved_residuals(p)
    # mlpwo only feeds the residual add, whose backward never reads it: nothing keeps it.
    needed = lambda names: set(names) - {"mlpwo"}
    assert set(re.findall(r"named '(\w+)'", text)) == needed(p.save), text
    assert text.count("<host>") == len(needed(p.offload)), text
    # The layer input is kept as the remat boundary unless the preset offloads it.
    assert ("from the argument x" in text) == ("decoder_layer_input" not in p.offload), text


# A sample that spans the mechanisms (save names, offload names, offload the layer input,
# save nothing): each preset's own names are checked above, without a compile.
_VALUE_PRESETS = ("minimal", "save_dot_except_mlp", "save_qkv_proj", "minimal_offloaded",
                  "full", "decoder_layer_input_offloaded")


def test_presets_give_the_plain_layer_values():
    params, x, loss = _one_layer()
    policies = {"no remat": None, **{k: PRESETS[k] for k in _VALUE_PRESETS}}

    def all_presets(params, x):
        grad = jax.value_and_grad(loss, argnums=(0, 1))
        return {name: grad(params, x, policy) for name, policy in policies.items()}

    results = _compile(jax.jit(all_presets).lower(params, x))(params, x)
    expected = results.pop("no remat")
    for name, got in results.items():
        _assert_close(got, expected, f"{name}: ")


def test_offloading_preset_in_the_scanned_model_keeps_values():
    plain = _workload("llama_scan")
    w = llama.make_preset("llama_scan", "minimal_offloaded", size="test", abstract=True)
    lowered = jax.jit(w.loss_and_grads).lower(plain.state, plain.batch)
    loss, grads = _compile(lowered)(plain.state, plain.batch)
    loss_p, grads_p = _loss_and_grads("llama_scan")
    _assert_close(loss, loss_p, "loss")
    _assert_close(grads, grads_p, "grads")


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


# Every variant is built at 1b; 8b (the same code at other shapes) only as the nnx scan, the
# cheapest to trace.
@pytest.mark.parametrize(("size", "published", "names"), [
    ("1b", 1_235_814_400, tuple(llama.names())), ("8b", 8_030_261_248, ("llama_nnx_scan",))])
def test_abstract_sizes_have_the_published_parameter_counts(size, published, names):
    assert llama.param_count(llama.model_config(size)) == published
    for name in names:
        w = llama.make(name, size=size, abstract=True)
        leaves = jax.tree.leaves(w.state["params"])
        assert all(isinstance(p, jax.ShapeDtypeStruct) and p.dtype == jnp.float32 for p in leaves)
        assert sum(math.prod(p.shape) for p in leaves) == published, name
    new_state, metrics = jax.eval_shape(w.step, *w.args)  # the nnx scan: cheapest to trace
    assert metrics["loss"].shape == () and w.batch["x"].shape == (w.batch_size, 4096)


def test_large_sizes_refuse_to_initialise():
    with pytest.raises(ValueError, match="abstract=True"):
        llama.make("llama", size="1b")


@pytest.mark.parametrize("name", llama.names())
def test_dropout_and_tied_head_trace(name):
    w = llama.make(name, size="test", abstract=True, dropout=0.1, tie_embeddings=True)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        w.state["params"])[0]]
    assert not [p for p in paths if "lm_head" in p]
    _, metrics = jax.eval_shape(w.step, *w.args)
    assert metrics["loss"].dtype == jnp.float32


def test_make_rejects_unknown_names_settings_and_presets():
    with pytest.raises(KeyError, match="unknown llama variant"):
        llama.make("mistral")
    with pytest.raises(ValueError, match="no setting"):
        llama.make("llama", hidden=3)
    with pytest.raises(KeyError, match="unknown MaxText remat preset"):
        llama.make_preset("llama", "save_everything")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        llama.make("llama", kv_heads=3, abstract=True)
