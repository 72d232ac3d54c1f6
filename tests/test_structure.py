"""Structure without names (issue 16, item 3): layers and blocks from the dataflow
(jaxmem/structure.py) for haiku and plain ``jax.numpy`` models.

Each model: ``jaxmem.optimize`` gives jax.jit's loss and gradients, and a lower compiled peak
than before issue 16 (``structure.label`` turned off, no whole-step ``dots_saveable``
candidate). Small shapes; relations between XLA's figures only.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import _jax, measure, plan_cache, program
from jaxmem.planning import strategies
from jaxmem.tracing import structure

# Its tests compile the same steps and plans again: each distinct program once (conftest.py).
COMPILE_ONCE = True


def _grad_step(loss):
    def step(params, batch):
        return jax.value_and_grad(loss)(params, batch)
    step.loss = loss  # for the built-in policy on the whole loss, compiled beside it
    return step


def _residual_mlp():
    d, h, n, b = 64, 256, 6, 256
    k = jax.random.PRNGKey(0)
    ws = [(jax.random.normal(jax.random.fold_in(k, 2 * i), (d, h)) * 0.05,
           jax.random.normal(jax.random.fold_in(k, 2 * i + 1), (h, d)) * 0.05)
          for i in range(n)]
    x = jax.random.normal(jax.random.fold_in(k, 99), (b, d))

    def loss(ws, x):
        for w1, w2 in ws:
            x = x + jnp.tanh(jax.nn.gelu(x @ w1) @ w2)
        return jnp.mean(x ** 2)

    return _grad_step(loss), (ws, x), n


def _hk_decoder():
    import haiku as hk

    from benchmarks.external.models import hk_decoder_forward

    layers, seq, vocab = 2, 32, 128
    net = hk.transform(lambda ids: hk_decoder_forward(ids, layers=layers, heads=4, width=64,
                                                      vocab=vocab))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, seq), 0, vocab)
    params = jax.jit(net.init)(jax.random.PRNGKey(2), ids)  # one compile, not ~70 eager ops

    def loss(params, ids):
        logits = net.apply(params, None, ids)
        labels = jnp.roll(ids, -1, axis=1)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))

    return _grad_step(loss), (params, ids), 2 * layers


def _hk_resnet():
    import haiku as hk

    def forward(x):
        net = hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=10, bottleneck=False,
                             channels_per_group=(4, 8, 8, 8), use_projection=(True,) * 4)
        return net(x, is_training=True)

    net = hk.transform_with_state(forward)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 16, 3))
    params, state = jax.jit(net.init)(jax.random.PRNGKey(2), x)  # one compile, not ~100

    def loss(params, batch):
        state, x = batch
        logits, _ = net.apply(params, state, None, x)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[:, 0])

    return _grad_step(loss), (params, (state, x)), 4


#: Each model built once (both tests of a model use it; nothing donates its arguments).
MODELS = {"residual_mlp": functools.cache(_residual_mlp),
          "hk_decoder": functools.cache(_hk_decoder), "hk_resnet": functools.cache(_hk_resnet)}
#: haiku's ResNet carries module paths (res_net/block_group_0/block_0/conv_0) in its name
#: stacks: structure leaves them alone, and at this size no plan beats the names' plan.
NAMED = {"hk_resnet"}


@pytest.mark.parametrize("name", list(MODELS))
def test_residual_adds_found(name):
    step, args, blocks = MODELS[name]()
    prog = program.trace(step, *args)
    assert len(structure.residual_adds(prog)) == blocks
    labelled = structure.label(prog, force=True)
    fwd = {n.layer.split("/")[0] for n in labelled.nodes if n.phase == "forward"}
    assert {f"res{i}" for i in range(blocks + 1)} <= fwd
    # Every backward node that reads a forward value of a layer lies in a labelled region.
    assert all(n.layer for n in labelled.nodes if n.phase == "backward" and
               any(prog.values[v].producer is not None and
                   prog.nodes[prog.values[v].producer].phase == "forward" for v in n.inputs))


def test_flax_like_names_are_left_alone():
    # A program whose heavy layers each have their own scope, residual adds inside scopes.
    def loss(ws, x):
        for i, w in enumerate(ws):
            with jax.named_scope(f"block{i}"):
                with jax.named_scope("dense"):
                    y = x @ w
                x = x + jnp.tanh(y)
        return jnp.sum(x ** 2)

    prog = program.trace(jax.grad(loss), [jnp.eye(8)] * 3, jnp.ones((4, 8)))
    assert structure.names_informative(prog)
    assert structure.label(prog) is prog


def _two_residuals_per_block(scopes):
    """Two residual adds under each name of ``scopes`` (a transformer block's attention and
    MLP residuals under one module, as penzai names them)."""
    def loss(ws, x):
        for scope, (w1, w2) in zip(scopes, ws, strict=True):
            with jax.named_scope(scope):
                x = x + jnp.tanh(x @ w1)
                x = x + jnp.tanh(x @ w2)
        return jnp.sum(x ** 2)

    return program.trace(jax.grad(loss), [(jnp.eye(8), jnp.eye(8))] * len(scopes),
                         jnp.ones((4, 8)))


def test_named_modules_around_residual_blocks_are_a_level_above_them():
    from jaxmem.planning import block_plans

    prog = _two_residuals_per_block(["block0", "block1", "block2"])
    labelled = structure.label(prog)
    fwd = [n.layer for n in labelled.nodes if n.phase == "forward"]
    assert "blk0/res1/layer0[block0]" in fwd and "blk2/res4/layer0[block2]" in fwd
    assert 1 in block_plans.block_depths(labelled)
    # depth 1 cuts per module: one boundary value per module (its input), where per
    # residual block (depth 2) there are two
    per_module = block_plans.block_boundaries(labelled, 1)
    per_residual = block_plans.block_boundaries(labelled, 2)
    assert per_module < per_residual
    assert len(per_residual) - len(per_module) == 3


def test_a_name_split_into_runs_adds_no_level():
    # "a" twice, apart: not one module around consecutive residual blocks
    labelled = structure.label(_two_residuals_per_block(["a", "b", "a"]))
    assert all(n.layer.startswith("res") for n in labelled.nodes if n.phase == "forward")


@pytest.mark.parametrize("name", list(MODELS))
def test_optimize_matches_jit_and_lowers_peak_where_names_miss_layers(name, monkeypatch):
    """Same loss and gradients as jax.jit; a strictly lower peak than without the
    structure-derived layers where names do not tell layers apart; where they do (the haiku
    ResNet: names already give its blocks), the structure leaves the program alone. Never
    above what a user of any library can do without editing the model,
    ``jax.value_and_grad(jax.checkpoint(loss, policy=dots_saveable))``: that step is one of
    the automatic mode's candidates (traced from the user's own), compiled the same way."""
    step, args, _ = MODELS[name]()
    if name in NAMED:
        # no before/after comparison below: of the automatic mode's candidates, the relation
        # checked is the whole-loss built-in's, so that one is compiled beside one rewrite plan
        # (the plan is the lowest compiled either way)
        _whole_loss_builtin_and_one_plan(monkeypatch)
    want_loss, want_grads = jax.jit(step)(*args)
    opt = jaxmem.optimize(step, donate_argnums=(), verify="builtins")
    loss, grads = opt(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 grads, want_grads)
    plan = opt.plan(*args)
    after = plan.compiled.peak
    builtin = jax.jit(_grad_step(jax.checkpoint(
        step.loss, policy=jax.checkpoint_policies.dots_saveable)))
    assert after <= measure.compiled_figures(measure.compile(builtin.lower(*args)), builtin,
                                             args).peak
    tried = next(n for n in plan.notes if n.startswith("compiled "))
    assert "jax.checkpoint(loss, policy=dots_saveable)" in tried
    if name in NAMED:
        # names already give the blocks: the structure leaves the program alone, so the
        # plan is made from the names' layers (planning it again without the structure,
        # as below, compiled the same candidates: 30 s of the suite for no new check)
        prog = program.trace(step, *args)
        assert structure.names_informative(prog) and structure.label(prog) is prog
        return
    # Before issue 16: name-derived layers only, and no whole-step dots_saveable candidate.
    monkeypatch.setattr(structure, "label", lambda p, force=False: p)
    candidates = strategies.auto_candidates
    monkeypatch.setattr(strategies, "auto_candidates", lambda a, **kw: [
        p for p in candidates(a, **kw) if p.region_depth != 0])
    monkeypatch.setattr(_jax, "checkpointed_losses", _no_loss_candidate)
    plan_cache.clear_memory()  # the same program and options: plan afresh, unpatched
    before = jaxmem.optimize(step, donate_argnums=()).plan(*args).compiled.peak
    assert after < before


def _whole_loss_builtin_and_one_plan(monkeypatch):
    from tests._compiles import one_builtin, one_rewrite_plan

    one_rewrite_plan(monkeypatch)
    one_builtin(monkeypatch, per_block=False)


@contextlib.contextmanager
def _no_loss_candidate(policy):
    yield []  # no loss wrapped: optimize compiles no jax.checkpoint(loss) candidate

