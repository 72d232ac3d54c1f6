"""``transformer`` and ``transformer_scan``: a GPT-style decoder (LayerNorm, causal attention,
gelu MLP, dropout, residual adds), adamw, next-token cross-entropy.

``transformer_scan`` stacks the same blocks with ``nn.scan`` (the layers inside one
``lax.scan``).

``attention`` (a size setting, ``"softmax"`` in every size) switches the attention:
``"softmax"`` is the einsum-softmax-einsum with dropout on the weights; ``"dot_product"`` and
``"cudnn"`` call ``jax.nn.dot_product_attention`` (implementation JAX's choice, XLA's in jax
0.10.2, or ``"cudnn"``: flash attention on q, k, v cast to bfloat16, for a CUDA device or
target only), which has no dropout on the weights (the residual and MLP dropout stay).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.zoo import llama as _llama
from benchmarks.zoo._common import (
    Built,
    ModelSpec,
    Policy,
    linen_train_step,
    maybe_remat,
    token_data,
)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with dropout on the attention weights and output.

    ``attention`` other than ``"softmax"``: :func:`benchmarks.zoo.llama.dot_product_attention`
    (no dropout on the weights; ``"cudnn"`` computes in bfloat16, cuDNN's flash attention
    takes no float32).
    """

    d_model: int
    heads: int
    dropout: float
    attention: str = "softmax"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        hd = d // self.heads
        qkv = nn.Dense(3 * d, name="qkv")(x).reshape(b, t, 3, self.heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.attention != "softmax":
            cast = (lambda a: a.astype(jnp.bfloat16)) if self.attention == "cudnn" else (
                lambda a: a)
            y = _llama.dot_product_attention(cast(q), cast(k), cast(v), self.attention)
            y = nn.Dense(d, name="out")(y.astype(x.dtype).reshape(b, t, d))
            return nn.Dropout(self.dropout, deterministic=False, name="resid_drop")(y)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(x.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        weights = nn.Dropout(self.dropout, deterministic=False, name="attn_drop")(weights)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
        y = nn.Dense(d, name="out")(y)
        return nn.Dropout(self.dropout, deterministic=False, name="resid_drop")(y)


class DecoderBlock(nn.Module):
    """Pre-LN GPT block: ``x + attn(LN(x))``, then ``x + MLP(LN(x))`` (4x, gelu, dropout)."""

    d_model: int
    heads: int
    dropout: float
    attention: str = "softmax"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + CausalSelfAttention(self.d_model, self.heads, self.dropout, self.attention,
                                    name="attn")(
            nn.LayerNorm(name="ln1")(x)
        )
        h = nn.Dense(4 * self.d_model, name="fc")(nn.LayerNorm(name="ln2")(x))
        h = nn.Dense(self.d_model, name="proj")(nn.gelu(h))
        return x + nn.Dropout(self.dropout, deterministic=False, name="mlp_drop")(h)


class _ScanBlock(nn.Module):
    """:class:`DecoderBlock` with the ``(carry, x) -> (carry, y)`` signature ``nn.scan`` wants."""

    d_model: int
    heads: int
    dropout: float
    attention: str = "softmax"

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return DecoderBlock(self.d_model, self.heads, self.dropout, self.attention,
                            name="block")(x), None


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` decoder blocks, final LN, vocabulary head.

    With ``scan=True`` the blocks are one ``nn.scan`` (parameters stacked on a leading
    ``layers`` axis, dropout keys split per layer).
    """

    vocab: int
    seq: int
    d_model: int
    heads: int
    layers: int
    dropout: float
    scan: bool = False
    policy: Policy | None = None
    attention: str = "softmax"

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model, name="wte")(tokens)
        pos = self.param("wpe", nn.initializers.normal(0.02), (self.seq, self.d_model))
        x = x + pos[None, : tokens.shape[1]]
        x = nn.Dropout(self.dropout, deterministic=False, name="emb_drop")(x)
        if self.scan:
            # prevent_cse=False is what JAX recommends for remat inside scan.
            body = maybe_remat(_ScanBlock, self.policy, prevent_cse=False)
            stack = nn.scan(
                body,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=self.layers,
            )
            x, _ = stack(self.d_model, self.heads, self.dropout, self.attention,
                         name="layers")(x, None)
        else:
            block = maybe_remat(DecoderBlock, self.policy)
            for i in range(self.layers):
                x = block(self.d_model, self.heads, self.dropout, self.attention,
                          name=f"block{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(self.vocab, name="head")(x)


def build(*, key, rng, seed, policy, abstract, batch, seq, vocab, d_model, heads, layers,
          dropout, attention: str = "softmax", scan: bool = False) -> Built:
    """The ``transformer`` train step, or with ``scan=True`` ``transformer_scan``."""
    if attention not in _llama.ATTENTIONS:
        raise ValueError(f"transformer: attention must be one of {list(_llama.ATTENTIONS)}, "
                         f"got {attention!r}")
    kd, km = jax.random.split(key)
    data = token_data(kd, batch, seq, vocab)
    # A typed "rbg" key for dropout, as large-model trainers (MaxText, T5X) configure JAX: it
    # halves the compile time of a step with many dropout sites against threefry.
    rng = jax.random.key(seed, impl="rbg")
    model = GPT(vocab, seq, d_model, heads, layers, dropout, scan, policy, attention)
    tx = optax.adamw(3e-4, weight_decay=0.01)
    step, grads, state = linen_train_step(model, tx, km, rng, data, abstract=abstract)
    return Built(step, grads, state, data, layers)


_SIZES = {
    "test": dict(batch=2, seq=16, vocab=64, d_model=32, heads=2, layers=2, dropout=0.1,
                 attention="softmax"),
    "bench": dict(batch=4, seq=256, vocab=1024, d_model=128, heads=4, layers=6, dropout=0.1,
                  attention="softmax"),
}

MODELS = {
    "transformer": ModelSpec(
        functools.partial(build, scan=False),
        _SIZES,
        "GPT decoder: LN, causal attention, gelu MLP, dropout, residuals; adamw",
    ),
    "transformer_scan": ModelSpec(
        functools.partial(build, scan=True),
        _SIZES,
        "GPT decoder, layers stacked with nn.scan (one lax.scan); adamw",
    ),
}
