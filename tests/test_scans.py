"""Plans inside scan bodies (jaxmem/scans.py, jaxmem/budget/scans.py).

Each body policy is checked for values against the unrolled model (Llama) or the scanned model
without remat (the zoo GPT), all policies of a model in one compiled program. The budget test
uses a small scanned MLP whose activations, not its parameters, make the peak.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jaxmem.program import trace

import jaxmem
from benchmarks import zoo
from benchmarks.zoo import llama
from benchmarks.zoo.maxtext_presets import NAMES
from jaxmem import _jax, measure
from jaxmem.compiling.scan_budget import choose_for
from jaxmem.rewriting.scans import (
    MAXTEXT,
    BodyPolicy,
    BodyValue,
    body_values,
    candidates,
    preset_policy,
)
from tests._fast_compile import fast_compile

# Its tests compile the same steps and plans again: each distinct program once (conftest.py).
COMPILE_ONCE = True

_compile = fast_compile

BF16_RTOL = 2.0**-6


def _assert_close(actual, expected, what, rtol):
    exp = [np.asarray(e, np.float32) for e in jax.tree.leaves(expected)]
    scale = max(max(float(np.max(np.abs(e), initial=0.0)) for e in exp), 1e-30)
    for e, a in zip(exp, jax.tree.leaves(actual), strict=True):
        err = float(np.max(np.abs(np.asarray(a, np.float32) - e), initial=0.0)) / scale
        assert err <= rtol, f"{what}: relative error {err:.3g}"


@functools.cache
def _llama(name):
    return llama.make(name, size="test")


def test_body_values_are_maxtext_names_or_matmuls():
    w = _llama("llama_scan")
    vals = body_values(trace(w.step, w.state, w.batch))
    assert tuple(v.label for v in vals) == NAMES
    assert all(v.nbytes > 0 for v in vals)
    assert all(v.flops > 0 for v in vals if v.label != "decoder_layer_input")
    g = zoo.make("transformer_scan", size="test", abstract=True)
    dots = body_values(trace(g.step, *g.args))
    from jaxmem.rewriting.scans import LAYER_KEY
    assert [v.key for v in dots if v.key[0] != "dot"] == [LAYER_KEY]  # the untagged input
    assert len(dots) > 1 and next(v for v in dots if v.key == LAYER_KEY).flops == 0.0


def test_candidates_span_maxtext_presets_and_finer_mixes():
    w = _llama("llama_scan")
    names = [p.name for p in candidates(body_values(trace(w.step, w.state, w.batch)),
                                        offload=True)]
    for preset in ("minimal", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj",
                   "minimal_offloaded", "decoder_layer_input_offloaded"):
        assert f"maxtext:{preset}" in names
    assert {"everything", "utility", "full", "ladder-3", "ladder-3+offload"} <= set(names)
    assert "maxtext:minimal_offloaded" not in [
        p.name for p in candidates(body_values(trace(w.step, w.state, w.batch)))]


def test_mixes_find_what_the_greedy_ladder_misses():
    """One large value (10 bytes, 100 FLOPs) against two smaller ones (6 bytes, 55 FLOPs each):
    the ladder (greedy by FLOPs per byte) keeps the large one first; at 12 bytes the two small
    ones keep more FLOPs, and a mix says so."""
    vals = [BodyValue(("name", "a"), "a", 10, 100.0), BodyValue(("name", "b"), "b", 6, 55.0),
            BodyValue(("name", "c"), "c", 6, 55.0)]
    pols = candidates(vals)
    ladder = {frozenset(p.save) for p in pols if p.name.startswith("ladder")}
    assert frozenset({("name", "b"), ("name", "c")}) not in ladder
    assert any(p.name.startswith("mix-") and set(p.save) == {("name", "b"), ("name", "c")}
               for p in pols)


def _grads_under(w, policies):
    """One function: loss and grads of ``w`` with each body policy (None: no remat)."""
    def all_policies(state, batch):
        out = {}
        for name, policy in policies.items():
            if policy is None:
                out[name] = w.loss_and_grads(state, batch)
                continue
            with _jax.checkpointed_scan_bodies(policy):
                out[name] = w.loss_and_grads(state, batch)
        return out
    return all_policies


def _kinds(w):
    vals = body_values(trace(w.step, *w.args))
    kinds = {p.name: p for p in candidates(vals, offload=True)}
    keep = ("everything", "utility", "full", "ladder-2", "ladder-2+offload")
    chosen = {k: kinds[k] for k in keep}
    presets = ("minimal", "save_qkv_proj", "minimal_offloaded", "decoder_layer_input_offloaded")
    chosen.update({k: kinds[k] for k in (f"maxtext:{p}" for p in presets) if k in kinds})
    return chosen


def test_every_plan_kind_in_the_scanned_llama_matches_the_unrolled_one():
    u, s = _llama("llama"), _llama("llama_scan")
    stacked = dict(s.state, params=llama.stack_layers(u.state["params"], 2))
    kinds = _kinds(s)
    fn = _grads_under(s, kinds)
    got = _compile(jax.jit(fn).lower(stacked, s.batch))(stacked, s.batch)
    loss, grads = _compile(jax.jit(u.loss_and_grads).lower(*u.args))(*u.args)
    for name, (loss_k, grads_k) in got.items():
        _assert_close(loss_k, loss, f"{name} loss", BF16_RTOL)
        _assert_close(grads_k, llama.stack_layers(grads, 2), f"{name} grads", BF16_RTOL)


def test_every_plan_kind_in_the_zoo_transformer_scan_keeps_values():
    w = zoo.make("transformer_scan", size="test")
    kinds = {"no remat": None, **_kinds(w)}
    fn = _grads_under(w, kinds)
    got = _compile(jax.jit(fn).lower(*w.args))(*w.args)
    expected = got.pop("no remat")
    for name, value in got.items():
        _assert_close(value, expected, name, 1e-5)


# --- a budget met inside a scan ----------------------------------------------------------------

L, D, F, B = 8, 32, 128, 256


def _mlp_stack_step(params, x):
    def loss(params):
        def body(h, p):
            a = checkpoint_name(h @ p["w1"], "up")
            h = h + checkpoint_name(jnp.tanh(a) @ p["w2"], "down")
            return h, None
        h, _ = jax.lax.scan(body, x, params)
        return jnp.mean(h**2)
    value, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value


def _mlp_args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (L, D, F)) / D**0.5,
              "w2": jax.random.normal(k2, (L, F, D)) / F**0.5}
    return params, jax.random.normal(k3, (B, D))


def test_budget_is_met_inside_a_scan_with_the_fewest_flops():
    args = _mlp_args()
    plain = measure.measure(jax.jit(_mlp_stack_step), *args).peak
    opt = jaxmem.optimize(_mlp_stack_step, budget=0.6, donate_argnums=())
    choice = choose_for(opt, _mlp_stack_step, args, {})
    assert choice.fits and choice.chosen.compiled.peak <= 0.6 * plain
    fitting = [c for c in choice.candidates if c.compiled and c.compiled.peak <= choice.budget]
    assert choice.chosen.flops == min(c.flops for c in fitting)
    assert choice.policy.name not in ("everything", "utility")  # MEDL's rule alone is too big
    plan = opt.plan(*args)
    assert plan.compiled.peak <= 0.6 * plain
    assert any(n.startswith("scan bodies: policy") for n in plan.notes)
    (new, loss), (ref, loss_ref) = opt(*args), jax.jit(_mlp_stack_step)(*args)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    _assert_close(new, ref, "params", 1e-6)


def test_auto_mode_compiles_a_leaner_body_within_the_flop_cap():
    """No budget: a body policy that keeps fewer bytes than MEDL's rule, within the FLOP cap,
    is compiled beside it (nothing dropped outside the scan) and kept when its peak is lower;
    the body policy alone is one of the verified candidates. Same results as jax.jit."""
    args = _mlp_args()
    lean = jaxmem.optimize(_mlp_stack_step, donate_argnums=(), max_recompute_fraction=0.5)
    medl = jaxmem.optimize(_mlp_stack_step, donate_argnums=(), max_recompute_fraction=0.5,
                           remat_scans=jaxmem.policies.utility)
    plan, ref_plan = lean.plan(*args), medl.plan(*args)
    assert any(n.startswith("scan bodies: policy") for n in plan.notes), plan.notes
    assert plan.compiled.peak < ref_plan.compiled.peak
    assert plan.compiled.flops <= 1.5 * plan.baseline.flops
    assert any("scan bodies only" in n for n in ref_plan.notes), ref_plan.notes
    (new, loss), (ref, loss_ref) = lean(*args), jax.jit(_mlp_stack_step)(*args)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    _assert_close(new, ref, "params", 1e-6)


def test_a_policy_passed_as_remat_scans_is_used():
    args = _mlp_args()
    full = jaxmem.optimize(_mlp_stack_step, remat_scans=BodyPolicy("full"), verify=False,
                           donate_argnums=())
    keep = jaxmem.optimize(_mlp_stack_step, remat_scans=BodyPolicy("all", base="everything"),
                           verify=False, donate_argnums=())
    assert full.plan(*args).compiled.peak < keep.plan(*args).compiled.peak


@pytest.mark.parametrize("name", ["minimal", "full", "decoder_layer_input_offloaded"])
def test_preset_policy_names_maxtext_presets(name):
    p = preset_policy(name)
    save, off = MAXTEXT[name]
    assert {k[1] for k in p.save} == set(save) and {k[1] for k in p.offload} == set(off)
