"""Other people's models: transformers Flax, haiku and equinox nets, their code unedited.

Each builder takes a size (``"test"`` or ``"bench"``) and returns a :class:`Workload`: the
train state (parameters and optax state, donated), a batch, and ``make_step(wrap)`` which
builds ``step(state, batch) -> (state, loss)`` with the model's whole loss function passed
through ``wrap`` first (``jax.checkpoint(loss, policy=...)`` for the built-in policies, the
identity for plain jit and jaxmem). Parameters are randomly initialised from small configs;
nothing is downloaded (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

Loss = Callable[..., Any]
Wrap = Callable[[Loss], Loss]


@dataclasses.dataclass
class Workload:
    """One external model at one size.

    Attributes:
      name, library: the model and the package its code comes from.
      state: the donated train state ``(params, opt_state)`` (haiku: plus its own state).
      batch: the step's second argument.
      make_step: ``make_step(wrap) -> step``; ``wrap`` is applied to the whole loss function.
    """

    name: str
    library: str
    state: Any
    batch: Any
    make_step: Callable[[Wrap], Callable[[Any, Any], Any]]
    description: str = ""


def _identity(f: Loss) -> Loss:
    return f


def _optax_step(loss: Loss, opt: optax.GradientTransformation) -> Callable[[Wrap], Any]:
    """``make_step`` for a loss ``loss(params, batch) -> scalar``."""

    def make_step(wrap: Wrap = _identity) -> Callable[[Any, Any], Any]:
        wrapped = wrap(loss)

        def step(state, batch):
            params, opt_state = state
            value, grads = jax.value_and_grad(wrapped)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        return step

    return make_step


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()


# --------------------------------------------------------------------------------------------
# transformers (Flax): the library's own modules, configs shrunk, random weights
# --------------------------------------------------------------------------------------------

_LM_SIZES = {"test": dict(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=128),
             "bench": dict(layers=4, hidden=128, heads=4, seq=256, batch=8, vocab=1024)}


def _hf_lm(name: str, size: str) -> Workload:
    import transformers as tf

    c = _LM_SIZES[size]
    if name == "hf_gpt2":
        config = tf.GPT2Config(vocab_size=c["vocab"], n_positions=c["seq"], n_embd=c["hidden"],
                               n_layer=c["layers"], n_head=c["heads"])
        cls = tf.FlaxGPT2LMHeadModel
    elif name in ("hf_llama", "hf_mistral"):
        kw = dict(vocab_size=c["vocab"], hidden_size=c["hidden"],
                  intermediate_size=4 * c["hidden"], num_hidden_layers=c["layers"],
                  num_attention_heads=c["heads"], num_key_value_heads=c["heads"] // 2,
                  max_position_embeddings=c["seq"])
        if name == "hf_llama":
            config, cls = tf.LlamaConfig(**kw), tf.FlaxLlamaForCausalLM
        else:
            config, cls = tf.MistralConfig(sliding_window=None, **kw), tf.FlaxMistralForCausalLM
    elif name == "hf_bert":
        config = tf.BertConfig(vocab_size=c["vocab"], hidden_size=c["hidden"],
                               num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                               intermediate_size=4 * c["hidden"],
                               max_position_embeddings=c["seq"])
        cls = tf.FlaxBertForMaskedLM
    else:
        raise KeyError(name)
    model = cls(config, input_shape=(1, c["seq"]), seed=0, _do_init=True)
    k = jax.random.split(jax.random.PRNGKey(1), 2)
    ids = jax.random.randint(k[0], (c["batch"], c["seq"]), 0, c["vocab"], jnp.int32)
    batch = {"ids": ids, "labels": jnp.roll(ids, -1, axis=1), "dropout": k[1]}

    def loss(params, batch):
        out = model(batch["ids"], params=params, dropout_rng=batch["dropout"], train=True)
        return _xent(out.logits, batch["labels"])

    opt = optax.adamw(1e-3)
    params = model.params
    return Workload(name, "transformers", (params, opt.init(params)), batch,
                    _optax_step(loss, opt), f"{cls.__name__} {c}")


def _hf_vit(size: str) -> Workload:
    import transformers as tf

    c = {"test": dict(layers=2, hidden=64, heads=4, image=32, patch=8, batch=2),
         # 64/8 -> 65 tokens: at patch 4 (257 tokens) XLA:GPU's compile for the H100 target
         # fails on the plain jax.jit already ("Couldn't find output tile sizes" for the
         # f32[8*257,128] dot, and at batch 32 on f32[32*65,128]); 8 x 65 tokens compile.
         "bench": dict(layers=4, hidden=128, heads=4, image=64, patch=8, batch=8)}[size]
    config = tf.ViTConfig(hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                          num_attention_heads=c["heads"], intermediate_size=4 * c["hidden"],
                          image_size=c["image"], patch_size=c["patch"], num_labels=10)
    model = tf.FlaxViTForImageClassification(config, seed=0)
    return _hf_image(model, c, "hf_vit", "FlaxViTForImageClassification")


def _hf_resnet(size: str) -> Workload:
    import transformers as tf

    c = {"test": dict(image=32, batch=2, widths=[16, 32], depths=[1, 1]),
         "bench": dict(image=64, batch=8, widths=[32, 64, 128, 256], depths=[2, 2, 2, 2])}[size]
    config = tf.ResNetConfig(embedding_size=c["widths"][0], hidden_sizes=c["widths"],
                             depths=c["depths"], layer_type="basic", num_labels=10)
    model = tf.FlaxResNetForImageClassification(config, seed=0)
    return _hf_image(model, c, "hf_resnet", "FlaxResNetForImageClassification")


def _hf_image(model: Any, c: dict, name: str, cls: str) -> Workload:
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    # transformers' Flax vision models take NCHW pixel values (as PyTorch does).
    x = jax.random.normal(k[0], (c["batch"], 3, c["image"], c["image"]), jnp.float32)
    y = jax.random.randint(k[1], (c["batch"],), 0, 10, jnp.int32)
    batch = {"x": x, "y": y, "dropout": k[2]}
    batch_stats = "batch_stats" in model.params

    def loss(params, batch):
        kw = {"dropout_rng": batch["dropout"]} if not batch_stats else {}
        if batch_stats:
            # Batch statistics are a mutable collection: their update is the model's aux
            # output, which this step drops (the loss and gradients are what is measured).
            out, _ = model(batch["x"], params=params, train=True, **kw)
        else:
            out = model(batch["x"], params=params, train=True, **kw)
        return _xent(out.logits, batch["y"])

    opt = optax.adamw(1e-3)
    params = model.params
    return Workload(name, "transformers", (params, opt.init(params)), batch,
                    _optax_step(loss, opt), f"{cls} {c}")


# --------------------------------------------------------------------------------------------
# haiku: hk.nets and hk.MultiHeadAttention, no flax name stacks
# --------------------------------------------------------------------------------------------


def _hk_resnet18(size: str) -> Workload:
    import haiku as hk

    c = {"test": dict(image=16, batch=2), "bench": dict(image=64, batch=8)}[size]

    def forward(x, is_training):
        return hk.nets.ResNet18(num_classes=10)(x, is_training=is_training)

    net = hk.transform_with_state(forward)
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(k[0], (c["batch"], c["image"], c["image"], 3), jnp.float32)
    y = jax.random.randint(k[1], (c["batch"],), 0, 10, jnp.int32)
    params, hk_state = net.init(k[2], x, is_training=True)
    opt = optax.sgd(0.1, momentum=0.9)

    def loss(params, hk_state, batch):
        logits, hk_state = net.apply(params, hk_state, None, batch["x"], is_training=True)
        return _xent(logits, batch["y"]), hk_state

    def make_step(wrap: Wrap = _identity):
        wrapped = wrap(loss)

        def step(state, batch):
            params, hk_state, opt_state = state
            (value, hk_state), grads = jax.value_and_grad(wrapped, has_aux=True)(
                params, hk_state, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), hk_state, opt_state), value

        return step

    return Workload("hk_resnet18", "haiku", (params, hk_state, opt.init(params)),
                    {"x": x, "y": y}, make_step, f"hk.nets.ResNet18 {c}")


def hk_decoder_forward(ids: jax.Array, *, layers: int, heads: int, width: int,
                       vocab: int) -> jax.Array:
    """A pre-norm causal decoder from haiku's own modules (hk.MultiHeadAttention, hk.Linear,
    hk.LayerNorm, hk.Embed); call inside ``hk.transform``."""
    import haiku as hk

    seq = ids.shape[-1]
    h = hk.Embed(vocab, width)(ids)
    h = h + hk.get_parameter("pos", (seq, width), init=hk.initializers.TruncatedNormal(0.02))
    mask = jnp.tril(jnp.ones((1, 1, seq, seq), bool))
    init = hk.initializers.VarianceScaling(2.0 / layers)
    for _ in range(layers):
        a = hk.LayerNorm(-1, True, True)(h)
        h = h + hk.MultiHeadAttention(heads, width // heads, w_init=init)(a, a, a, mask=mask)
        m = hk.LayerNorm(-1, True, True)(h)
        h = h + hk.Linear(width, w_init=init)(jax.nn.gelu(hk.Linear(4 * width)(m)))
    h = hk.LayerNorm(-1, True, True)(h)
    return hk.Linear(vocab)(h)


def _hk_decoder(size: str) -> Workload:
    import haiku as hk

    c = _LM_SIZES[size]
    net = hk.transform(lambda ids: hk_decoder_forward(
        ids, layers=c["layers"], heads=c["heads"], width=c["hidden"], vocab=c["vocab"]))
    k = jax.random.split(jax.random.PRNGKey(1), 2)
    ids = jax.random.randint(k[0], (c["batch"], c["seq"]), 0, c["vocab"], jnp.int32)
    params = net.init(k[1], ids)

    def loss(params, batch):
        return _xent(net.apply(params, None, batch["ids"]), batch["labels"])

    opt = optax.adamw(1e-3)
    return Workload("hk_decoder", "haiku", (params, opt.init(params)),
                    {"ids": ids, "labels": jnp.roll(ids, -1, axis=1)},
                    _optax_step(loss, opt), f"hk.MultiHeadAttention decoder {c}")


def _hk_mlp(size: str) -> Workload:
    import haiku as hk

    c = {"test": dict(width=64, depth=3, batch=16, features=32),
         "bench": dict(width=512, depth=6, batch=512, features=256)}[size]
    net = hk.without_apply_rng(hk.transform(
        lambda x: hk.nets.MLP([c["width"]] * c["depth"] + [10], activation=jax.nn.gelu)(x)))
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(k[0], (c["batch"], c["features"]), jnp.float32)
    y = jax.random.randint(k[1], (c["batch"],), 0, 10, jnp.int32)
    params = net.init(k[2], x)

    def loss(params, batch):
        return _xent(net.apply(params, batch["x"]), batch["y"])

    opt = optax.adam(1e-3)
    return Workload("hk_mlp", "haiku", (params, opt.init(params)), {"x": x, "y": y},
                    _optax_step(loss, opt), f"hk.nets.MLP {c}")


# --------------------------------------------------------------------------------------------
# equinox: the non-array leaves (activation functions) are closed over, the arrays passed in
# --------------------------------------------------------------------------------------------


def _eqx_workload(name: str, model: Any, batch: dict, forward: Callable, desc: str) -> Workload:
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, batch):
        m = eqx.combine(params, static)
        return _xent(forward(m, batch["x"]), batch["y"])

    opt = optax.adam(1e-3)
    return Workload(name, "equinox", (params, opt.init(params)), batch,
                    _optax_step(loss, opt), desc)


def _eqx_mlp(size: str) -> Workload:
    import equinox as eqx

    c = {"test": dict(width=64, depth=3, batch=16, features=32),
         "bench": dict(width=512, depth=6, batch=512, features=256)}[size]
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    model = eqx.nn.MLP(c["features"], 10, c["width"], c["depth"], activation=jax.nn.gelu,
                       key=k[0])
    x = jax.random.normal(k[1], (c["batch"], c["features"]), jnp.float32)
    y = jax.random.randint(k[2], (c["batch"],), 0, 10, jnp.int32)
    return _eqx_workload("eqx_mlp", model, {"x": x, "y": y},
                         lambda m, x: jax.vmap(m)(x), f"eqx.nn.MLP {c}")


def _eqx_cnn(size: str) -> Workload:
    import equinox as eqx

    c = {"test": dict(image=16, batch=4, width=8),
         "bench": dict(image=32, batch=32, width=32)}[size]
    k = jax.random.split(jax.random.PRNGKey(1), 8)
    w = c["width"]
    # eqx.nn layers in an eqx.nn.Sequential, each image through it under vmap (equinox's way).
    model = eqx.nn.Sequential([
        eqx.nn.Conv2d(3, w, 3, padding=1, key=k[0]), eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Conv2d(w, w, 3, padding=1, key=k[1]), eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.MaxPool2d(2, 2),
        eqx.nn.Conv2d(w, 2 * w, 3, padding=1, key=k[2]), eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Conv2d(2 * w, 2 * w, 3, padding=1, key=k[3]), eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.MaxPool2d(2, 2),
        eqx.nn.Lambda(jnp.ravel),
        eqx.nn.Linear(2 * w * (c["image"] // 4) ** 2, 10, key=k[4]),
    ])
    x = jax.random.normal(k[5], (c["batch"], 3, c["image"], c["image"]), jnp.float32)
    y = jax.random.randint(k[6], (c["batch"],), 0, 10, jnp.int32)
    return _eqx_workload("eqx_cnn", model, {"x": x, "y": y},
                         lambda m, x: jax.vmap(m)(x), f"eqx.nn conv net {c}")


#: name -> builder(size) -> Workload. Order is the table's order.
MODELS: dict[str, Callable[[str], Workload]] = {
    "hf_gpt2": lambda s: _hf_lm("hf_gpt2", s),
    "hf_llama": lambda s: _hf_lm("hf_llama", s),
    "hf_mistral": lambda s: _hf_lm("hf_mistral", s),
    "hf_bert": lambda s: _hf_lm("hf_bert", s),
    "hf_vit": _hf_vit,
    "hf_resnet": _hf_resnet,
    "hk_resnet18": _hk_resnet18,
    "hk_decoder": _hk_decoder,
    "hk_mlp": _hk_mlp,
    "eqx_mlp": _eqx_mlp,
    "eqx_cnn": _eqx_cnn,
}


def make(name: str, size: str = "test") -> Workload:
    """The external model ``name`` (a key of :data:`MODELS`) at ``size``."""
    if name not in MODELS:
        raise KeyError(f"unknown external model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name](size)
