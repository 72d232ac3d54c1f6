"""Llama-style decoder train steps for the zoo: unrolled, ``nn.scan`` and ``nnx.scan`` variants.

The model is Llama 3's: RMSNorm, rotary position embeddings, grouped-query causal attention
(``kv_heads`` < ``heads``), a SwiGLU MLP, no biases, no dropout by default, and an LM head
tied to the embedding or not. Parameters (and so adamw's master weights) are float32; each
matmul and the activations between layers run in bfloat16; the logits and the loss are float32.

Inside every layer, ``jax.ad_checkpoint.checkpoint_name`` tags the tensors MaxText tags
(:data:`~benchmarks.zoo.maxtext_presets.NAMES`), so MaxText's ``remat_policy`` presets
(:data:`PRESETS`) apply per layer as they do in MaxText: ``make_preset("llama_scan", "minimal")``.

Variants (zoo names):

- ``llama``: flax linen, layers unrolled (``layer_0`` ... ``layer_{n-1}``).
- ``llama_scan``: the same layers under one ``nn.scan`` (parameters stacked on a leading
  ``layers`` axis under ``layers/layer``; :func:`stack_layers` maps ``llama``'s onto them).
- ``llama_nnx_scan``: flax nnx, the layer module created stacked with ``nnx.split_rngs`` +
  ``nnx.vmap`` and applied with ``nnx.scan``, trained as a pure step via ``nnx.split`` /
  ``nnx.merge``.

``attention`` (a config setting, ``"softmax"`` in every size) switches the attention to
``jax.nn.dot_product_attention``: ``"dot_product"`` (JAX's implementation choice, XLA's in jax
0.10.2) or ``"cudnn"`` (cuDNN flash attention, for a CUDA device or target; see
:data:`ATTENTIONS` and docs/llm.md).

``remat_policy`` wraps each layer in ``nn.remat`` / ``nnx.remat`` (inside the scan for the
scanned variants, with ``prevent_cse=False`` as JAX advises there).

Sizes: ``test`` (tiny), ``bench`` (a few million parameters, runs on a CPU), ``1b``
(Llama-3.2-1B: 1,235,814,400 parameters, tied head) and ``8b`` (Llama-3-8B: 8,030,261,248
parameters); the last two only with ``abstract=True`` (``jax.ShapeDtypeStruct`` state).

Example:
  >>> import jax, jax.numpy as jnp
  >>> w = make("llama", size="test")
  >>> new_state, metrics = jax.jit(w.step)(w.state, w.batch)
  >>> bool(jnp.isfinite(metrics["loss"]))
  True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from benchmarks.zoo._common import (
    Batch,
    Built,
    ModelSpec,
    Policy,
    PyTree,
    State,
)
from benchmarks.zoo._common import cross_entropy as _cross_entropy
from benchmarks.zoo._common import linen_train_step as _linen_train_step
from benchmarks.zoo._common import token_data as _token_data
from benchmarks.zoo.maxtext_presets import PRESETS
from jaxmem.memory.chunked import chunked_cross_entropy

__all__ = [
    "ATTENTIONS",
    "BUILDERS",
    "CONFIGS",
    "DESCRIPTIONS",
    "PRESETS",
    "SIZES",
    "LlamaConfig",
    "decoder_layer",
    "dot_product_attention",
    "make",
    "make_preset",
    "model_config",
    "names",
    "param_count",
    "stack_layers",
]

#: The sizes every variant is available in; ``1b`` and ``8b`` need ``abstract=True``.
SIZES: tuple[str, ...] = ("test", "bench", "1b", "8b")

# Above this many parameters a model is only built abstractly: a concrete 1b state (params +
# adamw moments) is 15 GB, more than this machine's CPUs should be asked to initialise.
_MAX_CONCRETE_PARAMS = 200_000_000

_SIZES: dict[str, dict[str, Any]] = {
    "test": dict(batch=2, seq=16, vocab=128, d_model=32, layers=2, heads=4, kv_heads=2, ffn=64,
                 tie_embeddings=False, rope_theta=10_000.0, dropout=0.0, chunk_loss=0,
                 attention="softmax"),
    "bench": dict(batch=4, seq=256, vocab=2048, d_model=256, layers=6, heads=8, kv_heads=2,
                  ffn=768, tie_embeddings=False, rope_theta=10_000.0, dropout=0.0, chunk_loss=0,
                  attention="softmax"),
    # Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B; its llama3 rope scaling is left out).
    "1b": dict(batch=4, seq=4096, vocab=128_256, d_model=2048, layers=16, heads=32, kv_heads=8,
               ffn=8192, tie_embeddings=True, rope_theta=500_000.0, dropout=0.0,
               chunk_loss=0, attention="softmax"),
    # Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B).
    "8b": dict(batch=1, seq=4096, vocab=128_256, d_model=4096, layers=32, heads=32, kv_heads=8,
               ffn=14_336, tie_embeddings=False, rope_theta=500_000.0, dropout=0.0,
               chunk_loss=0, attention="softmax"),
}

#: Builder keyword arguments per zoo name and size, in the format of ``jaxmem.zoo``'s table.
CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    name: {size: dict(cfg) for size, cfg in _SIZES.items()}
    for name in ("llama", "llama_scan", "llama_nnx_scan")
}

#: One line per zoo name.
DESCRIPTIONS: dict[str, str] = {
    "llama": "Llama decoder: RMSNorm, rotary, GQA causal attention, SwiGLU, bf16 compute with "
    "f32 master weights; adamw",
    "llama_scan": "Llama decoder, layers stacked with nn.scan (one lax.scan); adamw",
    "llama_nnx_scan": "flax nnx Llama decoder, nnx.vmap-created layers under nnx.scan, "
    "nnx.split/merge in a pure step; adamw",
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama decoder (hashable: linen modules carry it as a field)."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tie_embeddings: bool = False
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    # > 0: the loss is jaxmem.memory.chunked.chunked_cross_entropy over this many token chunks (the
    # model returns the normed hidden states and the head; no [tokens, vocab] logits).
    chunk_loss: int = 0
    # How the causal GQA attention is computed (see ATTENTIONS): "softmax" (the zoo's own
    # einsum-softmax-einsum, the default of every size), "dot_product"
    # (jax.nn.dot_product_attention as JAX picks its implementation: XLA's in jax 0.10.2) or
    # "cudnn" (the same call with implementation="cudnn": cuDNN flash attention, for a CUDA
    # device or target only).
    attention: str = "softmax"

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"llama: d_model={self.d_model} is not divisible by "
                             f"heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"llama: heads={self.heads} is not a multiple of "
                             f"kv_heads={self.kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"llama: head_dim={self.head_dim} must be even for rotary "
                             "embeddings")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"llama: attention must be one of {list(ATTENTIONS)}, got "
                             f"{self.attention!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def model_config(size: str, **overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of ``size`` (one of :data:`SIZES`), with ``overrides``.

    Example:
      >>> model_config("8b").head_dim, model_config("test", layers=4).layers
      (128, 4)
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    cfg = {k: v for k, v in _SIZES[size].items() if k not in ("batch", "seq")}
    return LlamaConfig(**{**cfg, **overrides})


def param_count(cfg: LlamaConfig) -> int:
    """Parameters of a Llama decoder with ``cfg``, counted from its shapes (no build).

    Example:
      >>> param_count(model_config("1b")), param_count(model_config("8b"))
      (1235814400, 8030261248)
    """
    d, hd = cfg.d_model, cfg.head_dim
    attention = d * hd * (2 * cfg.heads + 2 * cfg.kv_heads)  # query, key, value, out
    mlp = 3 * d * cfg.ffn  # wi_0, wi_1, wo
    per_layer = attention + mlp + 2 * d  # + two RMSNorm scales
    embeddings = cfg.vocab * d * (1 if cfg.tie_embeddings else 2)
    return cfg.layers * per_layer + embeddings + d  # + final norm


# --------------------------------------------------------------------------------------------
# The layer's math, once, as functions of arrays: linen and nnx modules only hold parameters.
# --------------------------------------------------------------------------------------------

_COMPUTE = jnp.bfloat16


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * scale`` computed in float32, returned in the compute dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(_COMPUTE)


def _rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim), halves rotated."""
    seq, half = x.shape[1], x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


#: The values of :attr:`LlamaConfig.attention` (and of the GPT's ``attention`` setting), and the
#: ``implementation`` each passes to ``jax.nn.dot_product_attention`` (``"softmax"`` does not
#: call it). ``None`` is JAX's own choice, which in jax 0.10.2 is XLA's on every platform
#: (``jax/_src/nn/functions.py``: "defaults to XLA for now"); a trace does not see the platform
#: it will be compiled for, so cuDNN is asked for by name.
ATTENTIONS: dict[str, str | None] = {"softmax": None, "dot_product": None, "cudnn": "cudnn"}


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, attention: str) -> jax.Array:
    """Causal ``jax.nn.dot_product_attention`` of (batch, seq, heads, head_dim) arrays.

    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention: ``heads`` a
    multiple of theirs); the scale is ``head_dim ** -0.5``. ``attention`` is ``"dot_product"``
    (JAX's implementation choice: XLA's in jax 0.10.2) or ``"cudnn"`` (cuDNN flash attention:
    traces only where cuDNN is installed, compiles only for CUDA, bf16/fp16 inputs).
    """
    if attention not in ATTENTIONS or attention == "softmax":
        raise ValueError(f"attention must be 'dot_product' or 'cudnn', got {attention!r}")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=ATTENTIONS[attention])


def _causal_gqa(q: jax.Array, k: jax.Array, v: jax.Array,
                attention: str = "softmax") -> jax.Array:
    """Causal softmax attention, each key/value head shared by ``heads // kv_heads`` queries.

    Scores and softmax in float32 (bf16 products, f32 accumulation), weights back to bf16.
    With ``attention`` ``"dot_product"`` or ``"cudnn"``, :func:`dot_product_attention` (the
    same math in one call; with ``"cudnn"`` one fused kernel whose residuals are its output
    and the softmax statistics, not the ``[heads, seq, seq]`` weights).
    """
    if attention != "softmax":
        return dot_product_attention(q, k, v, attention)
    b, t, h, hd = q.shape
    kv = k.shape[2]
    q = (q * hd**-0.5).reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, h, hd)


def _attention(x, *, query, key, value, out, theta: float,
               attention: str = "softmax") -> jax.Array:
    """GQA self-attention of normed ``x``; kernels (d, heads, hd), (heads, hd, d), float32."""
    c = lambda w: w.astype(_COMPUTE)
    q = _rotary(jnp.einsum("btd,dhk->bthk", x, c(query)), theta)
    k = _rotary(jnp.einsum("btd,dhk->bthk", x, c(key)), theta)
    v = jnp.einsum("btd,dhk->bthk", x, c(value))
    q = checkpoint_name(q, "query_proj")
    k = checkpoint_name(k, "key_proj")
    v = checkpoint_name(v, "value_proj")
    context = checkpoint_name(_causal_gqa(q, k, v, attention), "context")
    return checkpoint_name(jnp.einsum("bthk,hkd->btd", context, c(out)), "out_proj")


def _swiglu(x, *, wi_0, wi_1, wo) -> jax.Array:
    """``(silu(x @ wi_0) * (x @ wi_1)) @ wo``."""
    gate = checkpoint_name(x @ wi_0.astype(_COMPUTE), "mlpwi_0")
    up = checkpoint_name(x @ wi_1.astype(_COMPUTE), "mlpwi_1")
    return checkpoint_name((jax.nn.silu(gate) * up) @ wo.astype(_COMPUTE), "mlpwo")


def _logits(x, final_norm, head, cfg: LlamaConfig) -> jax.Array:
    """Final RMSNorm and the vocabulary projection, float32 logits. ``head``: (vocab, d)."""
    x = _rms_norm(x, final_norm, cfg.norm_eps)
    return jnp.einsum("btd,vd->btv", x, head.astype(_COMPUTE), preferred_element_type=jnp.float32)


# Initialisers: fan-in scaled kernels (in-axes first), small normal embeddings, unit norms.
def _kernel_init(in_axes: tuple[int, ...], out_axes: tuple[int, ...]):
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                            in_axis=in_axes, out_axis=out_axes)


_Init = Any  # a jax.nn.initializers function: (key, shape, dtype) -> array


def _layer_params(cfg: LlamaConfig) -> dict[str, dict[str, tuple[tuple[int, ...], _Init]]]:
    """Every layer parameter, ``scope -> name -> (shape, initialiser)``: one table that the
    linen and the nnx layer both declare their parameters from."""
    d, h, kv, hd, f = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn
    qkv, dense = _kernel_init((0,), (1, 2)), _kernel_init((0,), (1,))
    return {
        "attention_norm": {"scale": ((d,), nn.initializers.ones)},
        "attention": {
            "query": ((d, h, hd), qkv),
            "key": ((d, kv, hd), qkv),
            "value": ((d, kv, hd), qkv),
            "out": ((h, hd, d), _kernel_init((0, 1), (2,))),
        },
        "mlp_norm": {"scale": ((d,), nn.initializers.ones)},
        "mlp": {"wi_0": ((d, f), dense), "wi_1": ((d, f), dense), "wo": ((f, d), dense)},
    }


def decoder_layer(x: jax.Array, p: dict[str, dict[str, jax.Array]], cfg: LlamaConfig,
                  drop: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """One decoder layer: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``.

    The function every variant's layer calls, tagged with MaxText's names (a ``jax.checkpoint``
    of it with a :data:`PRESETS` policy is one MaxText layer). ``p`` holds one layer's
    parameters as ``llama``'s ``params["layer_0"]`` does; ``drop`` (or None) is dropout on the
    layer's output, where MaxText applies it.

    Example:
      >>> w = make("llama", size="test", abstract=True)
      >>> p = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), w.state["params"]["layer_0"])
      >>> decoder_layer(jnp.ones((1, 4, 32), jnp.bfloat16), p, model_config("test")).dtype
      dtype(bfloat16)
    """
    x = checkpoint_name(x, "decoder_layer_input")
    with jax.named_scope("attention"):
        a = _rms_norm(x, p["attention_norm"]["scale"], cfg.norm_eps)
        h = x + _attention(a, **p["attention"], theta=cfg.rope_theta,
                           attention=cfg.attention)
    with jax.named_scope("mlp"):
        m = _rms_norm(h, p["mlp_norm"]["scale"], cfg.norm_eps)
        out = h + _swiglu(m, **p["mlp"])
    return out if drop is None else drop(out)


# --------------------------------------------------------------------------------------------
# flax linen: llama, llama_scan
# --------------------------------------------------------------------------------------------


class _Params(nn.Module):
    """A linen scope holding some of a layer's parameters (so paths read ``attention/query``)."""

    shapes: tuple[tuple[str, tuple[int, ...], _Init], ...]

    @nn.compact
    def __call__(self) -> dict[str, jax.Array]:
        return {name: self.param(name, init, shape, jnp.float32)
                for name, (shape, init) in self.shapes}


class LlamaLayer(nn.Module):
    """One Llama decoder layer (linen); its math is :func:`_layer`."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        p = {scope: _Params(tuple(shapes.items()), name=scope)()
             for scope, shapes in _layer_params(self.cfg).items()}
        drop = None
        if self.cfg.dropout:
            drop = nn.Dropout(self.cfg.dropout, deterministic=False, name="dropout")
        return decoder_layer(x, p, self.cfg, drop)


class _ScanLayer(nn.Module):
    """:class:`LlamaLayer` with the ``(carry, x) -> (carry, y)`` signature ``nn.scan`` wants."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return LlamaLayer(self.cfg, name="layer")(x), None


class Llama(nn.Module):
    """Token embedding, ``cfg.layers`` :class:`LlamaLayer` s, final RMSNorm, LM head (linen).

    With ``scan=True`` the layers are one ``nn.scan`` named ``layers``; ``policy`` (or None)
    wraps each layer in ``nn.remat``.
    """

    cfg: LlamaConfig
    scan: bool = False
    policy: Policy | None = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embedding = self.param("embedding", nn.initializers.normal(0.02),
                               (cfg.vocab, cfg.d_model), jnp.float32)
        x = jnp.take(embedding, tokens, axis=0).astype(_COMPUTE)
        if self.scan:
            body = _ScanLayer
            if self.policy is not None:
                body = nn.remat(body, policy=self.policy, prevent_cse=False)
            stack = nn.scan(body, variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True}, length=cfg.layers)
            x, _ = stack(cfg, name="layers")(x, None)
        else:
            layer = LlamaLayer if self.policy is None else nn.remat(LlamaLayer, policy=self.policy)
            for i in range(cfg.layers):
                x = layer(cfg, name=f"layer_{i}")(x)
        final_norm = self.param("final_norm", nn.initializers.ones, (cfg.d_model,), jnp.float32)
        if cfg.tie_embeddings:
            head = embedding
        else:
            head = self.param("lm_head", _kernel_init((1,), (0,)), (cfg.vocab, cfg.d_model),
                              jnp.float32)
        if cfg.chunk_loss:
            return _rms_norm(x, final_norm, cfg.norm_eps), head.astype(_COMPUTE)
        return _logits(x, final_norm, head, cfg)


def stack_layers(params: PyTree, layers: int) -> PyTree:
    """``llama``'s parameters laid out as ``llama_scan``'s: ``layer_i`` stacked on axis 0.

    Example:
      >>> w = make("llama", size="test")
      >>> s = make("llama_scan", size="test")
      >>> jax.tree.structure(stack_layers(w.state["params"], 2)) == jax.tree.structure(
      ...     s.state["params"])
      True
    """
    names = [f"layer_{i}" for i in range(layers)]
    rest = {k: v for k, v in params.items() if k not in names}
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[n] for n in names))
    return {**rest, "layers": {"layer": stacked}}


def _build_linen(*, key, rng, seed, policy, abstract, batch, seq, scan, **model):
    cfg = _config(abstract, **model)
    kd, km = jax.random.split(key)
    data = _token_data(kd, batch, seq, cfg.vocab)
    # A typed "rbg" dropout key, as the zoo's transformers (and MaxText) configure JAX.
    rng = jax.random.key(seed, impl="rbg")
    step, grads, state = _linen_train_step(Llama(cfg, scan, policy), _adamw(), km, rng, data,
                                           abstract=abstract, loss=_loss(cfg))
    return Built(step, grads, state, data, cfg.layers)


def _loss(cfg: LlamaConfig) -> Callable[[Any, jax.Array], jax.Array] | None:
    """The chunked loss of ``cfg.chunk_loss`` token chunks (None: cross-entropy of logits)."""
    if not cfg.chunk_loss:
        return None

    def loss(out: tuple[jax.Array, jax.Array], labels: jax.Array) -> jax.Array:
        hidden, head = out
        return chunked_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.T,
                                     labels.reshape(-1), token_chunks=cfg.chunk_loss)
    return loss


def _adamw() -> optax.GradientTransformation:
    # Llama's betas and weight decay; a learning rate for tiny models and few steps.
    return optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)


def _config(abstract: bool, **model: Any) -> LlamaConfig:
    cfg = LlamaConfig(**model)
    n = param_count(cfg)
    if not abstract and n > _MAX_CONCRETE_PARAMS:
        raise ValueError(f"llama with {n:,} parameters is too large to initialise here; build "
                         "it with abstract=True (ShapeDtypeStruct state, compile-only)")
    return cfg


# --------------------------------------------------------------------------------------------
# flax nnx: llama_nnx_scan
# --------------------------------------------------------------------------------------------


class NNXLlamaLayer(nnx.Module):
    """One Llama decoder layer (flax nnx); its math is :func:`_layer`."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        for scope, shapes in _layer_params(cfg).items():
            setattr(self, scope, nnx.Dict({
                name: nnx.Param(init(rngs.params(), shape, jnp.float32))
                for name, (shape, init) in shapes.items()
            }))
        self.drop = nnx.Dropout(cfg.dropout) if cfg.dropout else None

    def __call__(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        p = {scope: {name: v[...] for name, v in getattr(self, scope).items()}
             for scope in _layer_params(self.cfg)}
        drop = None if self.drop is None else functools.partial(self.drop, rngs=key)
        return decoder_layer(x, p, self.cfg, drop)


class NNXLlama(nnx.Module):
    """Embedding, ``cfg.layers`` stacked :class:`NNXLlamaLayer` s under ``nnx.scan``, head.

    The layers are built as the flax nnx docs scan over layers: one layer constructor under
    ``nnx.split_rngs(splits=layers)`` + ``nnx.vmap``, so every parameter has a leading
    ``layers`` axis, and the forward pass is an ``nnx.scan`` over that axis.
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = nnx.Param(
            nn.initializers.normal(0.02)(rngs.params(), (cfg.vocab, cfg.d_model), jnp.float32))

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_layers(rngs: nnx.Rngs) -> NNXLlamaLayer:
            return NNXLlamaLayer(cfg, rngs=rngs)

        self.layers = create_layers(rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,), jnp.float32))
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(
            _kernel_init((1,), (0,))(rngs.params(), (cfg.vocab, cfg.d_model), jnp.float32))

    def __call__(self, tokens: jax.Array, key: jax.Array, policy: Policy | None) -> jax.Array:
        cfg = self.cfg
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(_COMPUTE)

        def apply(layer: NNXLlamaLayer, h: jax.Array, k: jax.Array | None) -> jax.Array:
            return layer(h, k)

        if policy is not None:
            apply = nnx.remat(apply, policy=policy, prevent_cse=False)

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def forward(h: jax.Array, layer: NNXLlamaLayer, k: jax.Array | None) -> jax.Array:
            return apply(layer, h, k)

        keys = jax.random.split(key, cfg.layers) if cfg.dropout else None
        x = forward(x, self.layers, keys)
        head = self.embedding if self.lm_head is None else self.lm_head
        if cfg.chunk_loss:
            return _rms_norm(x, self.final_norm[...], cfg.norm_eps), head[...].astype(_COMPUTE)
        return _logits(x, self.final_norm[...], head[...], cfg)


def _build_nnx_scan(*, key, rng, seed, policy, abstract, batch, seq, **model):
    cfg = _config(abstract, **model)
    kd, km = jax.random.split(key)
    data = _token_data(kd, batch, seq, cfg.vocab)
    rng = jax.random.key(seed, impl="rbg")
    build = lambda: NNXLlama(cfg, rngs=nnx.Rngs(km))
    model = nnx.eval_shape(build) if abstract else nnx.jit(build)()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = _adamw()

    def loss_fn(params, rest, batch, dropout_key):
        from jaxmem.flax.nnx import named_scopes

        model = nnx.merge(graphdef, params, rest)
        with named_scopes(model):  # layer paths in the name stack, as nnx users are told
            logits = model(batch["x"], dropout_key, policy)
        return (_loss(cfg) or _cross_entropy)(logits, batch["y"])

    def loss_and_grads(state: State, batch: Batch) -> tuple[jax.Array, PyTree]:
        _, dropout_key = jax.random.split(state["rng"])
        return jax.value_and_grad(loss_fn)(state["params"], state["rest"], batch, dropout_key)

    def step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        rng, dropout_key = jax.random.split(state["rng"])
        loss, grads = jax.value_and_grad(loss_fn)(
            state["params"], state["rest"], batch, dropout_key)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = dict(state, params=optax.apply_updates(state["params"], updates),
                         opt_state=opt_state, step=state["step"] + 1, rng=rng)
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    state: State = {
        "params": params,
        "rest": rest,
        "opt_state": jax.eval_shape(tx.init, params) if abstract else tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": rng,
    }
    return Built(step, loss_and_grads, state, data, cfg.layers)


# --------------------------------------------------------------------------------------------
# Entry points: the zoo registry (benchmarks.zoo.FAMILIES) lists MODELS; make() is the zoo's.
# --------------------------------------------------------------------------------------------

#: The zoo builder of each variant: ``(key, rng, seed, policy, abstract, batch, seq, **config)
#: -> Built``, as the zoo's other builders.
BUILDERS: dict[str, Callable[..., Built]] = {
    "llama": functools.partial(_build_linen, scan=False),
    "llama_scan": functools.partial(_build_linen, scan=True),
    "llama_nnx_scan": _build_nnx_scan,
}

#: What :mod:`benchmarks.zoo` registers: every variant in every size of :data:`SIZES`.
MODELS: dict[str, ModelSpec] = {
    name: ModelSpec(build, CONFIGS[name], DESCRIPTIONS[name]) for name, build in BUILDERS.items()
}


def names() -> list[str]:
    """The Llama variants' zoo names."""
    return list(BUILDERS)


def make(name: str = "llama", **kwargs: Any) -> Any:
    """:func:`benchmarks.zoo.make` for a Llama variant: ``size`` is one of :data:`SIZES`
    (``"1b"`` and ``"8b"`` only with ``abstract=True``); config keywords (``layers=4``,
    ``tie_embeddings=True``, ``dropout=0.1``, ...) override the size's own.

    Example:
      >>> make("llama", size="test").n_blocks
      2
    """
    from benchmarks import zoo

    if name not in BUILDERS:
        raise KeyError(f"unknown llama variant {name!r}; choose one of {names()}")
    return zoo.make(name, **kwargs)


def make_preset(name: str, preset: str, **kwargs: Any) -> Any:
    """:func:`make` with MaxText's ``remat_policy`` ``preset`` (a :data:`PRESETS` key) per layer.

    Example:
      >>> make_preset("llama_scan", "save_qkv_proj").remat_policy.save
      ('query_proj', 'key_proj', 'value_proj')
    """
    if preset not in PRESETS:
        raise KeyError(f"unknown MaxText remat preset {preset!r}; choose one of {list(PRESETS)}")
    return make(name, remat_policy=PRESETS[preset], **kwargs)
