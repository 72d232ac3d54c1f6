"""The logits note (jaxmem/losses.py) and the zoo Llama's chunked loss (chunk_loss=N)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxmem
from benchmarks.zoo import llama
from jaxmem.analyzing.losses import logits_notes
from tests._fast_compile import fast_compile


def _notes(vocab):
    w = llama.make("llama_scan", size="test", vocab=vocab, abstract=True)
    return logits_notes(jaxmem.analyze(w.step, *w.args))


def test_plan_says_when_the_logits_are_the_largest_buffer():
    (note,) = _notes(4096)
    assert "f32[2,16,4096]" in note and "chunked_cross_entropy" in note
    assert _notes(8) == ()  # a tiny vocabulary: the layers' values are larger


def test_the_plan_carries_the_note():
    w = llama.make("llama_scan", size="test", vocab=4096, abstract=True)
    entry = jaxmem.optimize(w.step, verify=False)._prepare(w.args, {})[0]  # no compile
    assert any("largest buffer" in n for n in entry.plan.notes)


@pytest.mark.parametrize("name", ["llama_scan"])
def test_chunked_loss_gives_the_same_loss_and_grads(name):
    plain = llama.make(name, size="test", vocab=512)
    chunked = llama.make(name, size="test", vocab=512, chunk_loss=4)
    loss, grads = fast_compile(jax.jit(plain.loss_and_grads).lower(*plain.args))(*plain.args)
    loss_c, grads_c = fast_compile(jax.jit(chunked.loss_and_grads).lower(*plain.args))(
        *plain.args)
    np.testing.assert_allclose(loss_c, loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
    assert logits_notes(jaxmem.analyze(chunked.step, *chunked.args)) == ()
