"""The LM head and softmax cross-entropy, reduced chunk by chunk: the logits are never
materialised, in the forward or the backward pass (Cut Cross-Entropy, Liger's fused linear
cross-entropy, MaxText's ``num_vocab_tiling``). :func:`chunked_cross_entropy` is the
reduction form of :func:`jaxmem.chunked` for the LM head; see ``docs/chunking.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["chunked_cross_entropy"]


# --- the LM head + softmax cross-entropy, reduced chunk by chunk -------------------------------


@dataclasses.dataclass(frozen=True)
class _CE:
    """Static layout of a chunked cross-entropy: ``t`` token chunks of ``ts``, ``v`` of ``vs``."""

    t: int
    ts: int
    v: int
    vs: int
    vocab: int  # the true vocabulary size; columns past it are padding
    unroll: int | bool = 1


def _logits(cfg: _CE, x: jax.Array, w: jax.Array, b: jax.Array, c: Any) -> jax.Array:
    """Logits of vocabulary chunk ``c`` for tokens ``x``, in float32; padding columns -inf."""
    wc = lax.dynamic_slice_in_dim(w, c * cfg.vs, cfg.vs, axis=1)
    bc = lax.dynamic_slice_in_dim(b, c * cfg.vs, cfg.vs)
    logits = jnp.dot(x, wc, preferred_element_type=jnp.float32) + bc.astype(jnp.float32)
    if cfg.v * cfg.vs != cfg.vocab:
        col = c * cfg.vs + jnp.arange(cfg.vs)
        logits = jnp.where(col[None, :] < cfg.vocab, logits, -jnp.inf)
    return logits


def _label_logit(cfg: _CE, logits: jax.Array, lab: jax.Array, c: Any) -> jax.Array:
    local = lab - c * cfg.vs
    inside = (local >= 0) & (local < cfg.vs)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, cfg.vs - 1)[:, None], axis=1)[:, 0]
    return jnp.where(inside, picked, 0.0)


def _online_lse(cfg: _CE, x: jax.Array, w: jax.Array, b: jax.Array, lab: jax.Array):
    """Per-token log-sum-exp and label logit, one vocabulary chunk at a time."""
    if cfg.v == 1:
        logits = _logits(cfg, x, w, b, 0)
        return jax.nn.logsumexp(logits, axis=1), _label_logit(cfg, logits, lab, 0), logits

    def body(state, c):
        m, s, ll = state
        logits = _logits(cfg, x, w, b, c)
        m_new = jnp.maximum(m, logits.max(axis=1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(axis=1)
        return (m_new, s, ll + _label_logit(cfg, logits, lab, c)), None

    n = x.shape[0]
    init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
            jnp.zeros((n,), jnp.float32))
    (m, s, ll), _ = lax.scan(body, init, jnp.arange(cfg.v), unroll=cfg.unroll)
    return m + jnp.log(s), ll, None


def _chunk_grads(cfg, x, w, b, lab, g, lse, logits, dw, db):
    """Add a token chunk's gradient to ``dw``/``db``; return its ``dx``. ``g``: cotangents."""

    def one(c, logits, dw, db):
        onehot = (jnp.arange(cfg.vs)[None, :] + c * cfg.vs) == lab[:, None]
        gl = (jnp.exp(logits - lse[:, None]) - onehot) * g[:, None]
        wc = lax.dynamic_slice_in_dim(w, c * cfg.vs, cfg.vs, axis=1)
        dx = jnp.dot(gl, wc.T.astype(jnp.float32), preferred_element_type=jnp.float32)
        dwc = jnp.dot(x.T.astype(jnp.float32), gl, preferred_element_type=jnp.float32)
        dw = lax.dynamic_update_slice_in_dim(
            dw, lax.dynamic_slice_in_dim(dw, c * cfg.vs, cfg.vs, axis=1) + dwc, c * cfg.vs, 1
        )
        db = lax.dynamic_update_slice_in_dim(
            db, lax.dynamic_slice_in_dim(db, c * cfg.vs, cfg.vs) + gl.sum(0), c * cfg.vs, 0
        )
        return dx, dw, db

    if logits is not None:  # one vocabulary chunk, already computed: no recompute
        return one(0, logits, dw, db)
    if cfg.v == 1:
        return one(0, _logits(cfg, x, w, b, 0), dw, db)

    def body(state, c):
        dx, dw, db = state
        dxc, dw, db = one(c, _logits(cfg, x, w, b, c), dw, db)
        return (dx + dxc, dw, db), None

    dx0 = jnp.zeros((x.shape[0], x.shape[1]), jnp.float32)
    (dx, dw, db), _ = lax.scan(body, (dx0, dw, db), jnp.arange(cfg.v), unroll=cfg.unroll)
    return dx, dw, db


def _by_tokens(cfg: _CE, a: jax.Array) -> jax.Array:
    return a.reshape((cfg.t, cfg.ts) + a.shape[1:])


def _losses_only(cfg, x, w, b, lab, valid):
    def body(_, xs):
        xt, lt, vt = xs
        lse, ll, _ = _online_lse(cfg, xt, w, b, lt)
        return None, (lse, jnp.where(vt, lse - ll, 0.0))

    xs = (_by_tokens(cfg, x), _by_tokens(cfg, lab), _by_tokens(cfg, valid))
    _, (lse, loss) = lax.scan(body, None, xs, unroll=cfg.unroll)
    return lse.reshape(-1), loss.reshape(-1)


def _sweep(cfg, x, w, b, lab, g, lse=None):
    """Per-token losses (if ``lse`` is None) and gradients for per-token cotangents ``g``."""

    def body(state, xs):
        dw, db = state
        xt, lt, gt, lse_t = xs
        logits = None
        loss = None
        if lse_t is None:
            lse_t, ll, logits = _online_lse(cfg, xt, w, b, lt)
            loss = lse_t - ll
        dx, dw, db = _chunk_grads(cfg, xt, w, b, lt, gt, lse_t, logits, dw, db)
        return (dw, db), (loss, dx)

    xs = (_by_tokens(cfg, x), _by_tokens(cfg, lab), _by_tokens(cfg, g),
          None if lse is None else _by_tokens(cfg, lse))
    dw0 = jnp.zeros(w.shape, jnp.float32)
    db0 = jnp.zeros(b.shape, jnp.float32)
    (dw, db), (loss, dx) = lax.scan(body, (dw0, db0), xs, unroll=cfg.unroll)
    loss = None if loss is None else loss.reshape(-1)
    return loss, dx.reshape(x.shape), dw, db


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ce_tokens(cfg, x, w, b, lab, valid):
    """Per-token losses (0 where not ``valid``); backward recomputes logits chunk by chunk."""
    return _losses_only(cfg, x, w, b, lab, valid)[1]


def _ce_tokens_fwd(cfg, x, w, b, lab, valid):
    lse, loss = _losses_only(cfg, x, w, b, lab, valid)
    return loss, (x, w, b, lab, valid, lse)


def _ce_tokens_bwd(cfg, res, g):
    x, w, b, lab, valid, lse = res
    g = jnp.where(valid, g, 0.0).astype(jnp.float32)
    _, dx, dw, db = _sweep(cfg, x, w, b, lab, g, lse)
    return dx.astype(x.dtype), dw.astype(w.dtype), db.astype(b.dtype), None, None


_ce_tokens.defvjp(_ce_tokens_fwd, _ce_tokens_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ce_total(cfg, x, w, b, lab, scale):
    """``sum(scale * loss)``; the gradient is computed in the forward sweep (Liger-style)."""
    valid = scale != 0
    return jnp.sum(_losses_only(cfg, x, w, b, lab, valid)[1] * scale)


def _ce_total_fwd(cfg, x, w, b, lab, scale):
    loss, dx, dw, db = _sweep(cfg, x, w, b, lab, scale.astype(jnp.float32))
    total = jnp.sum(jnp.where(scale != 0, loss, 0.0) * scale)
    return total, (dx.astype(x.dtype), dw.astype(w.dtype), db.astype(b.dtype))


def _ce_total_bwd(cfg, res, g):
    dx, dw, db = res
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), (g * db).astype(db.dtype), \
        None, None


_ce_total.defvjp(_ce_total_fwd, _ce_total_bwd)


def _check_arguments(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    bias: jax.Array | None,
    reduction: str,
    token_chunks: int,
    vocab_chunks: int,
) -> jax.Array:
    """A clear error for :func:`chunked_cross_entropy` arguments that do not fit each other;
    the bias as a ``[vocab]`` array (zeros when ``bias`` is None)."""
    if hidden.ndim < 1 or weight.ndim != 2 or hidden.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"chunked_cross_entropy: hidden {hidden.shape} and weight {weight.shape} do not "
            "fit; expected hidden [..., d] and weight [d, vocab] (for tied embeddings "
            "[vocab, d], pass embedding.T)."
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"chunked_cross_entropy: labels has shape {labels.shape} but hidden {hidden.shape} "
            f"needs labels of shape {hidden.shape[:-1]} (one integer label per token)."
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"chunked_cross_entropy: labels must be integers, got {labels.dtype}; for soft "
            "targets use optax.softmax_cross_entropy on full logits."
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"chunked_cross_entropy: reduction must be 'mean', 'sum' or 'none'; got "
            f"{reduction!r}."
        )
    vocab = weight.shape[1]
    if bias is None:
        bias = jnp.zeros((vocab,), weight.dtype)
    bias = jnp.asarray(bias)
    if bias.shape != (vocab,):
        raise ValueError(
            f"chunked_cross_entropy: bias has shape {bias.shape}; expected ({vocab},) to match "
            f"weight {weight.shape}."
        )
    n = math.prod(labels.shape)
    for name, c, size in (("token_chunks", token_chunks, n), ("vocab_chunks", vocab_chunks, vocab)):
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= size:
            what = "tokens" if name == "token_chunks" else "vocabulary entries"
            raise ValueError(
                f"chunked_cross_entropy: {name}={c!r} must be an int in [1, {size}] (there are "
                f"{size} {what}: hidden {hidden.shape}, weight {weight.shape})."
            )
    return bias


def chunked_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    token_chunks: int = 8,
    vocab_chunks: int = 1,
    bias: jax.Array | None = None,
    reduction: Literal["mean", "sum", "none"] = "mean",
    ignore_index: int | None = None,
    unroll: int | bool = 1,
) -> jax.Array:
    """Softmax cross-entropy of ``hidden @ weight (+ bias)`` against integer ``labels``, chunked.

    The same value as
    ``optax.softmax_cross_entropy_with_integer_labels(hidden @ weight + bias, labels)``
    (then averaged or summed), but the ``[tokens, vocab]`` logits are never materialised, in
    the forward or the backward pass: tokens are processed ``token_chunks`` at a time, and for
    each token chunk the vocabulary ``vocab_chunks`` at a time with an online log-sum-exp.
    Peak memory for the loss falls from a few copies of the logits to a few copies of one
    ``[tokens / token_chunks, vocab / vocab_chunks]`` block (Cut Cross-Entropy, Wijmans et al.
    2025; Liger's fused linear cross-entropy; MaxText's ``num_vocab_tiling``).

    Cost. For ``reduction`` ``"mean"``/``"sum"`` the gradient is computed during the forward
    sweep (as Liger does) and only scaled in the backward pass: with ``vocab_chunks=1`` that is
    the same three matmuls as the unchunked loss. With ``vocab_chunks > 1`` the logits of each
    block are computed twice (once for the log-sum-exp, once for the gradient): one extra
    matmul (+33%). ``reduction="none"`` recomputes the logits in the backward pass (+33%).
    A chunk count that does not divide the tokens (vocabulary) pads them (with masking), at
    the cost of a padded copy of ``hidden`` (``weight``).

    The gradient is a ``jax.custom_vjp``: reverse mode (``jax.grad``, ``jax.vjp``) only.

    Args:
      hidden: ``[..., d]`` activations entering the LM head.
      weight: ``[d, vocab]`` head weight (a flax ``Dense`` kernel; for tied embeddings pass
        ``embedding.T``).
      labels: ``[...]`` integer targets in ``[0, vocab)`` (or ``ignore_index``).
      token_chunks: pieces to cut the tokens into (``1 <= token_chunks <= tokens``).
      vocab_chunks: pieces to cut the vocabulary into, per token chunk.
      bias: optional ``[vocab]`` bias.
      reduction: ``"mean"`` over the tokens that are not ignored, ``"sum"``, or ``"none"``
        for a ``labels``-shaped array of per-token losses (0 for ignored tokens).
      ignore_index: a label value whose tokens contribute nothing (e.g. padding, -100).
      unroll: passed to the ``lax.scan``s over token and vocabulary chunks (``True`` unrolls
        them, e.g. to read whole-program FLOPs from ``cost_analysis()``).

    Returns:
      A float32 scalar, or per-token losses of ``labels``'s shape for ``reduction="none"``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmem
      >>> h = jax.random.normal(jax.random.key(0), (2, 16, 8))
      >>> w = jax.random.normal(jax.random.key(1), (8, 100))
      >>> y = jax.random.randint(jax.random.key(2), (2, 16), 0, 100)
      >>> loss = jaxmem.chunked_cross_entropy(h, w, y, token_chunks=4, vocab_chunks=3)
      >>> ref = optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()
      >>> bool(jnp.allclose(loss, ref, rtol=1e-5))
      True
      >>> dw = jax.grad(lambda w: jaxmem.chunked_cross_entropy(h, w, y, token_chunks=4))(w)
    """
    hidden, weight, labels = jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels)
    bias = _check_arguments(hidden, weight, labels, bias, reduction, token_chunks, vocab_chunks)
    d, vocab = weight.shape
    n = math.prod(labels.shape)
    ts = -(-n // token_chunks)
    t = -(-n // ts)
    vs = -(-vocab // vocab_chunks)
    v = -(-vocab // vs)
    cfg = _CE(t=t, ts=ts, v=v, vs=vs, vocab=vocab, unroll=unroll)

    x = hidden.reshape(n, d)
    lab = labels.reshape(n).astype(jnp.int32)
    valid = jnp.ones((n,), bool) if ignore_index is None else lab != ignore_index
    if t * ts != n:
        pad = t * ts - n
        x = jnp.pad(x, ((0, pad), (0, 0)))
        lab = jnp.pad(lab, (0, pad))
        valid = jnp.pad(valid, (0, pad))
    if v * vs != vocab:
        weight = jnp.pad(weight, ((0, 0), (0, v * vs - vocab)))
        bias = jnp.pad(bias, (0, v * vs - vocab))

    if reduction == "none":
        return _ce_tokens(cfg, x, weight, bias, lab, valid)[:n].reshape(labels.shape)
    scale = valid.astype(jnp.float32)
    if reduction == "mean":
        scale = scale / jnp.maximum(scale.sum(), 1.0)
    return _ce_total(cfg, x, weight, bias, lab, scale)
