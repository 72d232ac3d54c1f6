"""Offload (issue 5): OFFLOAD decisions in the rewrite, proven on CPU by residual avals in
host memory and by cross-lowering for CUDA; offload_name tags; outputs unchanged."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.planning.budget import offload_name

# Its tests compile the same steps and plans again: each distinct program once (conftest.py).
COMPILE_ONCE = True


def _step(tag: bool):
    ws = [jax.random.normal(jax.random.PRNGKey(i), (32, 32)) / 6 for i in range(3)]
    x = jax.random.normal(jax.random.PRNGKey(9), (64, 32))

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with jax.named_scope(f"layer{i}"):
                if tag:  # the matmul's input: the backward reads it for dW
                    h = offload_name(h, f"h{i}")
                h = jnp.tanh(h @ w) + h
        return jnp.sum(h ** 2)

    def step(ws, x):
        val, g = jax.value_and_grad(loss)(ws, x)
        return [w - 0.01 * gw for w, gw in zip(ws, g, strict=True)], val

    return step, (ws, x)


def _check_offloaded(opt, args, n):
    st = opt.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert st.count('_xla_buffer_placement = "pinned_host"') == n
    closed = opt.trace(*args).jaxpr  # residual avals in host memory space
    host = [v for e in closed.jaxpr.eqns if e.primitive.name == "device_put"
            for v in e.outvars if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host]
    assert len(host) == n


def test_offload_name_tags_are_offloaded():
    step, args = _step(tag=True)
    opt = jaxmem.optimize(step, donate_argnums=())
    plan = opt.plan(*args)
    off = plan.of(jaxmem.Decision.OFFLOAD)
    assert len(off) == 3 and all("offload_name" in c.reason for c in off)
    _check_offloaded(opt, args, len(off))
    out, ref = opt(*args), jax.jit(step)(*args)
    # The same arithmetic; the host round trips change XLA:CPU's fusions, and at the tests'
    # -O0 (conftest.py) the LLVM code of two fusions may round a last bit differently.
    chex.assert_trees_all_close(out, ref, rtol=1e-6, atol=1e-6)


def test_offload_true_without_budget():
    step, args = _step(tag=False)
    opt = jaxmem.optimize(step, offload=True, donate_argnums=())
    plan = opt.plan(*args)
    n = len(plan.offload)
    assert n >= 1 and plan.strategy == "auto+offload"
    _check_offloaded(opt, args, n)
    chex.assert_trees_all_close(opt(*args), jax.jit(step)(*args), rtol=1e-6, atol=1e-6)


def test_offload_with_budget_uses_predicted_device_peak():
    step, args = _step(tag=False)
    a = jaxmem.analyze(step, *args)
    from jaxmem.planning.budget import Budget, DeviceProfile, plan_with_budget

    fast_link = DeviceProfile("fast-link", 1e11, 2e10, 1e13)  # offload nearly free
    opt = jaxmem.optimize(step, budget=Budget(0.8, profile=fast_link), offload="auto",
                          donate_argnums=())
    try:
        plan = opt.plan(*args)
    except jaxmem.planning.budget.BudgetError:
        pytest.skip("toy step cannot reach 80% on this machine")
    if plan.offload:
        assert any("CPU compile strips host placement" in n for n in plan.notes)
        _check_offloaded(opt, args, len(plan.offload))
    assert plan_with_budget(a, "1GiB").strategy.startswith("budget")


def test_offload_name_rejects_empty():
    with pytest.raises(ValueError):
        offload_name(jnp.ones(2), "")


def _fetch_distances(closed) -> list[int]:
    """For each device_put back to device memory: equations until its first reader."""
    eqns = closed.jaxpr.eqns
    out = []
    for i, e in enumerate(eqns):
        if e.primitive.name != "device_put":
            continue
        if getattr(e.outvars[0].aval, "memory_space", None) == jax.memory.Space.Host:
            continue
        ids = {id(v) for v in e.outvars}
        j = next(k for k in range(i + 1, len(eqns))
                 if any(id(v) in ids for v in eqns[k].invars))
        out.append(j - i)
    return out


def test_prefetch_fetches_one_region_early():
    from jaxmem.analyzing.analysis import from_program
    from jaxmem.planning.budget import offload_tagged
    from jaxmem.rewriting.rewrite import rewrite

    step, args = _step(tag=True)
    prog = jaxmem.trace(step, *args)
    a = from_program(prog)
    off = offload_tagged(a)
    res = frozenset(r.value for r in a.residuals)
    flat = jax.tree.leaves(args)
    early = rewrite(prog, offload=off, residuals=res)             # prefetch is the default
    late = rewrite(prog, offload=off, residuals=res, prefetch=False)
    d_early = _fetch_distances(jax.make_jaxpr(early)(*flat))
    d_late = _fetch_distances(jax.make_jaxpr(late)(*flat))
    assert len(d_early) == len(d_late) == len(off) == 3
    assert sum(d_early) > sum(d_late)      # fetched further ahead of the reading equation
    chex.assert_trees_all_equal(jax.jit(early)(*flat), jax.jit(late)(*flat))
    st = jax.jit(early).trace(*flat).lower(lowering_platforms=("cuda",)).as_text()
    assert st.count('_xla_buffer_placement = "pinned_host"') == 3
    assert st.count('_xla_buffer_placement = "device"') == 3


def test_block_plan_offloads_boundary_values():
    """A block plan can park its boundary values in host memory (MaxText's "offload the
    layer inputs, recompute the rest"): each comes back for the block whose replay starts from
    it. One pinned_host placement and one fetch per offloaded value in the CUDA lowering, host
    avals in the rewritten jaxpr, outputs identical to the plain step (dropout included)."""
    from benchmarks import zoo
    from jaxmem.analyzing.analysis import from_program
    from jaxmem.analyzing.chains import backward_regions, chain_start, replay_chain
    from jaxmem.planning.strategies import block_depths, block_offload_candidates, plan_blocks
    from jaxmem.rewriting.rewrite import rewrite

    w = zoo.make("transformer", size="test")
    prog = jaxmem.trace(w.loss_and_grads, *w.args)
    a = from_program(prog)
    depth = block_depths(prog)[0]
    cands = block_offload_candidates(a, depth)
    assert len(cands) >= 2
    plan = plan_blocks(a, depth, offload=cands)
    assert plan.offload == cands and not plan.offload & plan.keep
    assert plan.recompute == plan_blocks(a, depth).recompute
    res = frozenset(r.value for r in a.residuals)
    fn = rewrite(prog, plan.recompute, plan.offload, res | plan.keep, region_depth=depth)
    flat = jax.tree.leaves(w.args)
    text = jax.jit(fn).trace(*flat).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('_xla_buffer_placement = "pinned_host"') == len(cands)
    # one fetch per backward region that reads an offloaded value or replays from it (a
    # final LayerNorm joins the LM head's block, so the block output it reads is fetched
    # for the LayerNorm's region and for the head's, which re-creates the LayerNorm)
    starts = chain_start(prog, dropped=plan.recompute, kept=res | plan.keep,
                         offloaded=plan.offload)

    def reads(n, v):
        redo = [u for u in n.inputs if u in plan.recompute]
        return v in n.inputs or (bool(redo) and v in replay_chain(prog, redo, starts)[1])

    fetches = sum(len(backward_regions(prog, lambda n, v=v: reads(n, v), depth))
                  for v in cands)
    assert len(cands) <= fetches <= 2 * len(cands)
    assert text.count('_xla_buffer_placement = "device"') == fetches
    closed = jax.make_jaxpr(fn)(*flat)
    host = [v for e in closed.jaxpr.eqns if e.primitive.name == "device_put"
            for v in e.outvars if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host]
    assert len(host) == len(cands)
    ref = jax.tree.leaves(jax.jit(w.loss_and_grads)(*w.args))
    chex.assert_trees_all_equal(jax.tree.leaves(jax.jit(fn)(*flat)), ref)
    with pytest.raises(ValueError, match="block boundary"):
        plan_blocks(a, depth, offload={prog.inputs[0]})


def test_offload_fits_below_what_recompute_reaches():
    """Below the lowest peak save + recompute reaches (BudgetError without offload), offload
    lets the plan fit; on CPU the fit is checked against the predicted device peak, and every
    offloaded value is placed in pinned_host memory."""
    from benchmarks import zoo
    from jaxmem.planning.budget import Budget, BudgetError

    # Four layers: the budget search's four compiles and the offload search's four hold
    # the same relation as at eight (offload fits at 90% of the floor), in half the time.
    w = zoo.make("mlp", size="test", abstract=True, depth=4, batch=1024)
    a = jaxmem.optimize(w.step, donate_argnums=(0,), verify=False).analysis(*w.args)
    with pytest.raises(BudgetError) as err:   # exhaustive: the minimum is compiled
        jaxmem.optimize(w.step, budget=Budget(a.argument_bytes + 1, search="exhaustive"),
                        donate_argnums=(0,)).plan(*w.args)
    # minimum_bytes is the lowest compiled peak the (deterministic) search reached, so 90%
    # of it is out of reach without offload.
    assert not err.value.minimum_predicted
    budget = int(0.9 * err.value.minimum_bytes)
    opt = jaxmem.optimize(w.step, budget=Budget(budget, profile="cpu"), offload=True,
                          donate_argnums=(0,))
    plan = opt.plan(*w.args)
    assert plan.offload
    note = next(n for n in plan.notes if "predicted device peak" in n)
    assert "CPU compile strips host placement" in note
    assert plan.compiled.peak > budget  # CPU still counts the offloaded values
    _check_offloaded(opt, w.args, len(plan.offload))


def test_offload_tag_inside_a_scan_body_warns_and_keeps_it():
    """The joint rewrite keeps a lax.scan whole: a value tagged inside its body cannot be
    offloaded by it. jaxmem says so, naming the tag, and the step stays exact."""
    ws = jnp.stack([jnp.eye(8) * 0.5 + 0.01 * i for i in range(3)])
    x = jnp.ones((4, 8))

    def step(ws, x):
        def loss(ws):
            def body(h, w):
                h = offload_name(jnp.tanh(h @ w), "in_scan")
                return h, None
            h, _ = jax.lax.scan(body, x, ws)
            return jnp.sum(h ** 2)
        return jax.grad(loss)(ws)

    opt = jaxmem.optimize(step, offload=True, donate_argnums=())
    with pytest.warns(UserWarning, match=r"offload_name\('in_scan'\) is inside a scan"):
        out = opt(ws, x)
    np.testing.assert_allclose(out, jax.jit(step)(ws, x), rtol=1e-6, atol=1e-6)


def test_offload_needs_a_host_memory_kind(monkeypatch):
    """On a backend without a pinned_host memory kind, asking for offload is a clear error."""
    from jaxmem import _jax

    step, args = _step(tag=False)
    monkeypatch.setattr(_jax, "memory_kinds", lambda device=None: frozenset({"device"}))
    with pytest.raises(ValueError, match="pinned_host"):
        jaxmem.optimize(step, offload=True).plan(*args)
    jaxmem.optimize(step, offload=False).plan(*args)  # no offload asked: fine
