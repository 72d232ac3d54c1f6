"""A corpus of other people's train steps: their models, losses, optimizers and state
containers, through their PyPI packages, unedited.

Where :mod:`benchmarks.external.models` wraps every model in this repository's own
``(params, opt_state)`` step, a corpus :class:`Entry` is the train step a user of that
project writes, in that project's idiom:

- ``tx_*_ts``: transformers' Flax models inside ``flax.training.train_state.TrainState``
  (``step`` a Python int at first, dropout keys folded with ``state.step``, ``has_aux``
  metrics; the ResNets with the flax ImageNet example's ``batch_stats`` field);
- ``hk_resnet50``: ``hk.nets.ResNet50`` under ``hk.transform_with_state`` (BatchNorm state)
  in a ``NamedTuple`` train state, as haiku's ImageNet example;
- ``hk_resnet18_shardmap``: ``hk.nets.ResNet18`` with cross-replica BatchNorm
  (``cross_replica_axis``) under ``jax.shard_map`` on a one-device mesh, ``lax.pmean`` of
  gradients and of the batch statistics;
- ``eqx_*``: ``eqx.filter_value_and_grad``, ``eqx.nn.State`` for BatchNorm,
  ``eqx.apply_updates``;
- ``keras_*``: Keras 3 on the JAX backend, ``model.stateless_call`` /
  ``optimizer.stateless_apply`` (keras' own "training loop in JAX" recipe);
- ``pz_llamalike``: penzai's llama-like transformer trained by penzai's own
  ``basic_training`` step (``StatefulTrainer.build(jit=False)``'s step function);
- ``jraph_gcn``: jraph's ``GraphConvolution`` (haiku node updates) on a random graph.

Each entry gives ``make_step(wrap)``: the user's step with the whole loss function passed
through ``wrap`` (``jax.checkpoint(loss, policy=...)`` for the built-in variants; nothing
in the model changes), and where the package has a per-block remat switch (transformers'
``enable_gradient_checkpointing``, penzai's ``Checkpointed``) ``blocks[policy] -> (state,
step)`` with it on. Everything is randomly initialised; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("KERAS_BACKEND", "jax")

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
Step = Callable[[Any, Any], Any]


def _identity(f):
    return f


@dataclasses.dataclass
class Entry:
    """One user's train step at one size.

    Attributes:
      name: the corpus name; project: the PyPI distribution the model comes from.
      state, batch: the step's two arguments (the state is donated).
      make_step: ``make_step(wrap) -> step``, ``wrap`` applied to the whole loss function.
      blocks: ``{"dots" | "nothing": () -> (state, step)}``: the package's per-block remat
        switch on, with that policy (absent where the package has none for that policy).
      sharding: the ``jax.sharding`` every leaf is placed with for a target (shard_map
        entries: the mesh's replicated sharding), or None (the target's first device).
      description: model, configuration and state container.
    """

    name: str
    project: str
    state: Any
    batch: Any
    make_step: Callable[..., Step]
    blocks: dict[str, Callable[[], tuple[Any, Step]]] = dataclasses.field(default_factory=dict)
    sharding: Any = None
    description: str = ""

    @property
    def library(self) -> str:
        return self.project


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()


def _images(batch: int, image: int, classes: int, nchw: bool = False, seed: int = 1):
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    shape = (batch, 3, image, image) if nchw else (batch, image, image, 3)
    return (jax.random.normal(k[0], shape, jnp.float32),
            jax.random.randint(k[1], (batch,), 0, classes, jnp.int32))


# --------------------------------------------------------------------------------------------
# transformers (Flax) in flax's TrainState
# --------------------------------------------------------------------------------------------

_LM = {"test": dict(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=128),
       # GPT-2 small / BERT-base's published layers, width and vocabulary; sequence 256.
       "bench": dict(layers=12, hidden=768, heads=12, seq=256, batch=4, vocab=50257),
       # flax's lm1b example's decoder at its published width (issue 37's 24 GB case): 6
       # layers, 512 wide, MLP 2048 (GPT-2's 4x), vocabulary 30k, sequence 128, batch 32,
       # computed in bfloat16 (parameters float32). GPT-2's blocks at those sizes.
       "lm1b": dict(layers=6, hidden=512, heads=8, seq=128, batch=32, vocab=30000,
                    dtype="bfloat16")}


def _tx_lm(kind: str, size: str, devices: Any = None) -> Entry:
    import transformers as tf
    from flax.training import train_state

    c = dict(_LM[size])
    if kind == "bert" and size == "bench":
        c["vocab"] = 30522
    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=c["vocab"], n_positions=max(c["seq"], 1024),
                               n_embd=c["hidden"], n_layer=c["layers"], n_head=c["heads"])
        cls = tf.FlaxGPT2LMHeadModel
    else:
        config = tf.BertConfig(vocab_size=c["vocab"], hidden_size=c["hidden"],
                               num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                               intermediate_size=4 * c["hidden"],
                               max_position_embeddings=max(c["seq"], 512))
        cls = tf.FlaxBertForMaskedLM

    def build(checkpointing: bool):
        model = cls(config, input_shape=(1, c["seq"]), seed=0, _do_init=True,
                    dtype=jnp.dtype(c.get("dtype", "float32")))
        if checkpointing:
            model.enable_gradient_checkpointing()  # transformers' own per-block nn.remat
        return model

    model = build(False)
    # run_clm_flax / run_mlm_flax: AdamW on a linear warm-up/decay schedule.
    schedule = optax.join_schedules([optax.linear_schedule(0.0, 5e-4, 100),
                                     optax.linear_schedule(5e-4, 0.0, 900)], [100])
    tx = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    k = jax.random.split(jax.random.PRNGKey(1), 2)
    ids = jax.random.randint(k[0], (c["batch"], c["seq"]), 0, c["vocab"], jnp.int32)
    batch = {"input_ids": ids, "labels": jnp.roll(ids, -1, axis=1), "rng": k[1]}

    def make_step(wrap: Wrap = _identity) -> Step:
        def train_step(state, batch):
            dropout_rng = jax.random.fold_in(batch["rng"], state.step)

            def loss_fn(params):
                logits = state.apply_fn(batch["input_ids"], params=params,
                                        dropout_rng=dropout_rng, train=True)[0]
                loss = optax.softmax_cross_entropy(
                    logits, jax.nn.one_hot(batch["labels"], logits.shape[-1])).mean()
                acc = jnp.mean(jnp.argmax(logits, -1) == batch["labels"])
                return loss, {"accuracy": acc}

            grad_fn = jax.value_and_grad(wrap(loss_fn), has_aux=True)
            (loss, metrics), grads = grad_fn(state.params)
            state = state.apply_gradients(grads=grads)
            return state, {"loss": loss, **metrics}

        return train_step

    def create(m):
        return train_state.TrainState.create(apply_fn=m.__call__, params=m.params, tx=tx)

    def blocks_nothing():
        return create(build(True)), make_step()

    # transformers 4.57's Flax GPT-2 has no enable_gradient_checkpointing (it raises
    # NotImplementedError); BERT's has.
    blocks = {"nothing": blocks_nothing} if kind == "bert" else {}
    return Entry(f"tx_{kind}_ts", "transformers", create(model), batch, make_step, blocks, None,
                 f"{cls.__name__} {c}, flax TrainState, AdamW schedule, dropout on")


class _BNTrainState:
    """flax's ImageNet example: ``TrainState`` with a ``batch_stats`` field."""

    cls = None

    @classmethod
    def get(cls):
        if cls.cls is None:
            from flax.training import train_state

            class TrainState(train_state.TrainState):
                batch_stats: Any

            cls.cls = TrainState
        return cls.cls


def _tx_resnet(depth: int, size: str, devices: Any = None) -> Entry:
    import transformers as tf

    if size == "test":
        c = dict(image=32, batch=2, classes=10, embedding=8, widths=[16, 32], depths=[1, 1],
                 layer="basic" if depth == 18 else "bottleneck")
        if depth == 50:
            c["widths"] = [32, 64]
    elif depth == 18:  # microsoft/resnet-18's config, 128x128 images
        c = dict(image=128, batch=16, classes=1000, embedding=64, widths=[64, 128, 256, 512],
                 depths=[2, 2, 2, 2], layer="basic")
    else:  # microsoft/resnet-50's config (transformers' ResNetConfig defaults)
        c = dict(image=128, batch=16, classes=1000, embedding=64,
                 widths=[256, 512, 1024, 2048], depths=[3, 4, 6, 3], layer="bottleneck")
    config = tf.ResNetConfig(embedding_size=c["embedding"], hidden_sizes=c["widths"],
                             depths=c["depths"], layer_type=c["layer"],
                             num_labels=c["classes"], downsample_in_first_stage=False)
    model = tf.FlaxResNetForImageClassification(config, input_shape=(1, c["image"],
                                                                      c["image"], 3), seed=0)
    x, y = _images(c["batch"], c["image"], c["classes"], nchw=True)
    # flax ImageNet example: SGD with Nesterov momentum on a cosine schedule, L2 1e-4.
    tx = optax.sgd(optax.cosine_decay_schedule(0.1, 10_000), momentum=0.9, nesterov=True)
    TrainState = _BNTrainState.get()
    state = TrainState.create(apply_fn=model.__call__, params=model.params["params"],
                              batch_stats=model.params["batch_stats"], tx=tx)

    def make_step(wrap: Wrap = _identity) -> Step:
        def train_step(state, batch):
            def loss_fn(params):
                out, new_model_state = state.apply_fn(
                    batch["image"], params={"params": params, "batch_stats": state.batch_stats},
                    train=True)
                logits = out.logits
                loss = optax.softmax_cross_entropy(
                    logits, jax.nn.one_hot(batch["label"], logits.shape[-1])).mean()
                weight_penalty = 0.5 * sum(
                    jnp.sum(p ** 2) for p in jax.tree.leaves(params) if p.ndim > 1)
                loss = loss + 1e-4 * weight_penalty
                return loss, (new_model_state, logits)

            grad_fn = jax.value_and_grad(wrap(loss_fn), has_aux=True)
            (loss, (new_model_state, logits)), grads = grad_fn(state.params)
            state = state.apply_gradients(grads=grads,
                                          batch_stats=new_model_state["batch_stats"])
            acc = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
            return state, {"loss": loss, "accuracy": acc}

        return train_step

    return Entry(f"tx_resnet{depth}_ts", "transformers", state, {"image": x, "label": y},
                 make_step, {}, None,
                 f"FlaxResNetForImageClassification ResNet-{depth} {c}, flax TrainState "
                 "with batch_stats, SGD Nesterov")


# --------------------------------------------------------------------------------------------
# haiku: hk.nets.ResNet with BatchNorm state; and under jax.shard_map with cross-replica BN
# --------------------------------------------------------------------------------------------


class HkTrainState(NamedTuple):
    """haiku's ImageNet example's train state."""

    params: Any
    state: Any
    opt_state: Any


def _hk_resnet_net(depth: int, size: str, bn_config: dict | None = None):
    import haiku as hk

    def forward(x, is_training):
        if size == "test":
            net = hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=10,
                                 bn_config=bn_config, bottleneck=depth == 50,
                                 channels_per_group=(8, 16, 32, 64))
        else:
            cls = hk.nets.ResNet50 if depth == 50 else hk.nets.ResNet18
            net = cls(num_classes=1000, bn_config=bn_config)
        return net(x, is_training=is_training)

    return hk.transform_with_state(forward)


def _hk_loss(net, classes: int):
    """haiku ImageNet example's loss: label-smoothed cross-entropy plus L2 on non-BN params."""

    def loss_fn(params, state, batch):
        logits, state = net.apply(params, state, None, batch["images"], is_training=True)
        labels = optax.smooth_labels(jax.nn.one_hot(batch["labels"], classes), 0.1)
        loss = optax.softmax_cross_entropy(logits, labels).mean()
        l2 = sum(jnp.sum(jnp.square(p)) for ((mod, _), p) in _hk_flat(params)
                 if "batchnorm" not in mod)
        return loss + 1e-4 * l2, state

    return loss_fn


def _hk_flat(params):
    for mod, d in params.items():
        for name, p in d.items():
            yield (mod, name), p


def _hk_sizes(size: str):
    return {"test": dict(image=16, batch=2, classes=10),
            "bench": dict(image=128, batch=16, classes=1000)}[size]


def _hk_resnet50(size: str, devices: Any = None) -> Entry:
    c = _hk_sizes(size)
    net = _hk_resnet_net(50, size)
    x, y = _images(c["batch"], c["image"], c["classes"])
    params, hk_state = net.init(jax.random.PRNGKey(0), x, is_training=True)
    tx = optax.sgd(optax.cosine_decay_schedule(0.1, 10_000), momentum=0.9, nesterov=True)
    loss_fn = _hk_loss(net, c["classes"])

    def make_step(wrap: Wrap = _identity) -> Step:
        def train_step(train_state, batch):
            params, state, opt_state = train_state
            (loss, state), grads = jax.value_and_grad(wrap(loss_fn), has_aux=True)(
                params, state, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return HkTrainState(params, state, opt_state), {"loss": loss}

        return train_step

    return Entry("hk_resnet50", "dm-haiku", HkTrainState(params, hk_state, tx.init(params)),
                 {"images": x, "labels": y}, make_step, {}, None,
                 f"hk.nets.ResNet50 {c} (test: hk.nets.ResNet bottleneck, 1 block/group, "
                 "widths 8-64), transform_with_state, NamedTuple state, SGD Nesterov")


def one_device_mesh(devices: Any = None):
    """A one-device mesh over axis ``data`` (``AxisType.Auto``) on ``devices[0]``."""
    devices = list(jax.devices("cpu") if devices is None else devices)[:1]
    return jax.sharding.Mesh(np.array(devices), ("data",),
                             axis_types=(jax.sharding.AxisType.Auto,))


def _hk_resnet18_shardmap(size: str, devices: Any = None) -> Entry:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    c = _hk_sizes(size)
    mesh = one_device_mesh(devices)
    net = _hk_resnet_net(18, size, bn_config={"decay_rate": 0.9, "cross_replica_axis": "data"})
    x, y = _images(c["batch"], c["image"], c["classes"])
    # init outside shard_map: no axis bound, so BatchNorm's pmean cannot run; init the same
    # net without the cross-replica axis (identical parameter and state structure).
    params, hk_state = _hk_resnet_net(18, size).init(jax.random.PRNGKey(0), x,
                                                      is_training=True)
    tx = optax.sgd(optax.cosine_decay_schedule(0.1, 10_000), momentum=0.9, nesterov=True)
    loss_fn = _hk_loss(net, c["classes"])

    def make_step(wrap: Wrap = _identity) -> Step:
        def per_device(train_state, batch):
            params, state, opt_state = train_state
            (loss, state), grads = jax.value_and_grad(wrap(loss_fn), has_aux=True)(
                params, state, batch)
            grads = jax.lax.pmean(grads, axis_name="data")
            state = jax.lax.pmean(state, axis_name="data")
            loss = jax.lax.pmean(loss, axis_name="data")
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return HkTrainState(params, state, opt_state), {"loss": loss}

        def train_step(train_state, batch):
            return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")),
                                 out_specs=(P(), P()))(train_state, batch)

        return train_step

    return Entry("hk_resnet18_shardmap", "dm-haiku",
                 HkTrainState(params, hk_state, tx.init(params)), {"images": x, "labels": y},
                 make_step, {}, NamedSharding(mesh, P()),
                 f"hk.nets.ResNet18 {c} (test: hk.nets.ResNet basic, 1 block/group, widths "
                 "8-64), BatchNorm cross_replica_axis='data', jax.shard_map on a one-device "
                 "mesh, lax.pmean of gradients and batch statistics")


# --------------------------------------------------------------------------------------------
# equinox: filter_value_and_grad, eqx.nn.State
# --------------------------------------------------------------------------------------------


def _eqx_bn_cnn(size: str, devices: Any = None) -> Entry:
    import equinox as eqx

    c = {"test": dict(image=16, batch=4, width=8),
         "bench": dict(image=64, batch=64, width=64)}[size]
    w = c["width"]
    k = jax.random.split(jax.random.PRNGKey(0), 8)

    def block(cin, cout, key):
        return [eqx.nn.Conv2d(cin, cout, 3, padding=1, use_bias=False, key=key),
                eqx.nn.BatchNorm(cout, axis_name="batch", mode="ema"),
                eqx.nn.Lambda(jax.nn.relu)]

    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)([
        eqx.nn.Conv2d(3, w, 7, stride=2, padding=3, use_bias=False, key=k[0]),
        eqx.nn.BatchNorm(w, axis_name="batch", mode="ema"), eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.MaxPool2d(3, 2, padding=1),
        *block(w, w, k[1]), *block(w, 2 * w, k[2]), eqx.nn.MaxPool2d(2, 2),
        *block(2 * w, 2 * w, k[3]), *block(2 * w, 4 * w, k[4]),
        eqx.nn.AdaptiveAvgPool2d(1), eqx.nn.Lambda(jnp.ravel),
        eqx.nn.Linear(4 * w, 10, key=k[5]),
    ])
    x, y = _images(c["batch"], c["image"], 10, nchw=True)
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.adamw(3e-4)

    def loss_fn(params, state, x, y):
        model = eqx.combine(params, static)
        batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None),
                               out_axes=(0, None))
        logits, state = batch_model(x, state)
        return _xent(logits, y), state

    def make_step(wrap: Wrap = _identity) -> Step:
        def train_step(train_state, batch):
            params, state, opt_state = train_state
            (loss, state), grads = eqx.filter_value_and_grad(wrap(loss_fn), has_aux=True)(
                params, state, batch["x"], batch["y"])
            updates, opt_state = tx.update(grads, opt_state, params)
            params = eqx.apply_updates(params, updates)
            return (params, state, opt_state), loss

        return train_step

    return Entry("eqx_bn_cnn", "equinox", (params, state, tx.init(params)),
                 {"x": x, "y": y}, make_step, {}, None,
                 f"eqx.nn.Sequential: 7x7/2 conv, eqx.nn.BatchNorm (eqx.nn.State), max-pool, "
                 f"4 conv-BN-ReLU, {c}; filter_value_and_grad, AdamW")


def _eqx_mlp_filter(size: str, devices: Any = None) -> Entry:
    import equinox as eqx

    c = {"test": dict(width=64, depth=3, batch=16, features=32),
         "bench": dict(width=2048, depth=8, batch=1024, features=784)}[size]
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    model = eqx.nn.MLP(c["features"], 10, c["width"], c["depth"], activation=jax.nn.gelu,
                       key=k[0])
    x = jax.random.normal(k[1], (c["batch"], c["features"]), jnp.float32)
    y = jax.random.randint(k[2], (c["batch"],), 0, 10, jnp.int32)
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.adamw(3e-4)

    def loss_fn(params, x, y):
        model = eqx.combine(params, static)
        return _xent(jax.vmap(model)(x), y)

    def make_step(wrap: Wrap = _identity) -> Step:
        def train_step(train_state, batch):
            params, opt_state = train_state
            loss, grads = eqx.filter_value_and_grad(wrap(loss_fn))(params, batch["x"],
                                                                   batch["y"])
            updates, opt_state = tx.update(grads, opt_state, eqx.filter(params, eqx.is_array))
            return (eqx.apply_updates(params, updates), opt_state), loss

        return train_step

    return Entry("eqx_mlp_filter", "equinox", (params, tx.init(params)), {"x": x, "y": y},
                 make_step, {}, None, f"eqx.nn.MLP {c}, GELU, filter_value_and_grad, AdamW")


# --------------------------------------------------------------------------------------------
# Keras 3, JAX backend: stateless_call / stateless_apply
# --------------------------------------------------------------------------------------------


def _keras(app: str, size: str, devices: Any = None) -> Entry:
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError("keras entries need KERAS_BACKEND=jax before keras is imported")
    c = {"test": dict(image=32, batch=2, classes=10),
         "bench": dict(image=128, batch=16, classes=1000)}[size]
    keras.utils.set_random_seed(0)
    kw = dict(weights=None, input_shape=(c["image"], c["image"], 3), classes=c["classes"],
              classifier_activation=None)
    if app == "resnet50":
        model = keras.applications.ResNet50(**kw)
    else:
        model = keras.applications.MobileNetV2(alpha=0.35 if size == "test" else 1.0, **kw)
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, nesterov=True)
    optimizer.build(model.trainable_variables)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = _images(c["batch"], c["image"], c["classes"])

    def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = model.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True)
        return loss_obj(y, y_pred), non_trainable_variables

    def make_step(wrap: Wrap = _identity) -> Step:
        grad_fn = jax.value_and_grad(wrap(compute_loss_and_updates), has_aux=True)

        def train_step(state, data):
            trainable_variables, non_trainable_variables, optimizer_variables = state
            (loss, non_trainable_variables), grads = grad_fn(
                trainable_variables, non_trainable_variables, data["x"], data["y"])
            trainable_variables, optimizer_variables = optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            return (trainable_variables, non_trainable_variables, optimizer_variables), loss

        return train_step

    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    name = {"resnet50": "ResNet50", "mobilenetv2": "MobileNetV2"}[app]
    return Entry(f"keras_{app}", "keras", state, {"x": x, "y": y}, make_step, {}, None,
                 f"keras.applications.{name} {c}, weights=None, stateless_call / "
                 "SGD stateless_apply")


# --------------------------------------------------------------------------------------------
# penzai: llama-like transformer, penzai's basic_training step
# --------------------------------------------------------------------------------------------


def _pz_llamalike(size: str, devices: Any = None) -> Entry:
    from penzai import pz
    from penzai.models.transformer.model_parts import TransformerBlock
    from penzai.models.transformer.variants import llamalike_common as ll
    from penzai.toolshed import basic_training, gradient_checkpointing

    c = {"test": dict(layers=2, width=64, heads=4, kv=2, mlp=128, vocab=128, seq=32, batch=2),
         # Llama-style 12 x 768 (head 64, GQA 12/4, SwiGLU 2048), vocabulary 32000.
         "bench": dict(layers=12, width=768, heads=12, kv=4, mlp=2048, vocab=32000, seq=256,
                       batch=4)}[size]
    config = ll.LlamalikeTransformerConfig(
        num_kv_heads=c["kv"], query_head_multiplier=c["heads"] // c["kv"],
        embedding_dim=c["width"], projection_dim=c["width"] // c["heads"],
        mlp_hidden_dim=c["mlp"], num_decoder_blocks=c["layers"], vocab_size=c["vocab"],
        mlp_variant="swiglu", tie_embedder_and_logits=False)

    def loss_fn(*, model, state, rng, tokens):
        logits = model(tokens[{"seq": pz.slice[:-1]}])
        targets = tokens[{"seq": pz.slice[1:]}]
        losses = pz.nx.nmap(optax.softmax_cross_entropy_with_integer_labels)(
            logits.untag("vocabulary"), targets)
        loss = losses.untag("batch", "seq").unwrap().mean()
        return loss, state, {"loss": loss}

    ids = jax.random.randint(jax.random.PRNGKey(1), (c["batch"], c["seq"] + 1), 0,
                             c["vocab"], jnp.int32)
    tokens = pz.nx.wrap(ids).tag("batch", "seq")
    tx = optax.adamw(3e-4)

    def build(policy=None, checkpointed=False):
        model = ll.build_llamalike_transformer(config, init_base_rng=jax.random.PRNGKey(0))
        if checkpointed:  # penzai's own per-block remat wrapper
            model = (pz.select(model).at_instances_of(TransformerBlock)
                     .apply(lambda b: gradient_checkpointing.Checkpointed(b, policy=policy)))
        trainer = basic_training.StatefulTrainer.build(
            root_rng=jax.random.PRNGKey(2), model=model, optimizer_def=tx, loss_fn=loss_fn,
            jit=False)
        stateless, variables = pz.unbind_variables(trainer.model)
        params = pz.freeze_variables(tuple(v for v in variables if isinstance(v, pz.Parameter)))
        state = (trainer.state.value, params)

        def make_step(wrap: Wrap = _identity) -> Step:
            wrapped = loss_fn if wrap is _identity else _pz_wrap(wrap)

            def train_step(state, batch):
                internal, params = state
                aux, params, _, internal = trainer.step_fn(
                    root_rng=trainer.root_rng, state=internal, stateless_model=stateless,
                    trainable_params=params, frozen_params=(), state_vars=(),
                    loss_fn=wrapped, optimizer_def=tx, kwargs={"tokens": batch["tokens"]})
                return (internal, params), aux

            return train_step

        return state, make_step

    state, make_step = build()
    blocks = {p: (lambda p=p: (lambda s, m: (s, m()))(*build(_POLICIES[p], True)))
              for p in ("dots", "nothing")}
    return Entry("pz_llamalike", "penzai", state, {"tokens": tokens}, make_step, blocks,
                 None, f"penzai llamalike_common.build_llamalike_transformer {c}, "
                 "basic_training.StatefulTrainer step, AdamW")


def _pz_wrap(wrap: Wrap):
    """``wrap`` around penzai's keyword-only loss: the model and tokens become positional
    pytree arguments of the checkpointed function."""

    def loss_fn(*, model, state, rng, tokens):
        from penzai import pz

        unbound, variables = pz.unbind_variables(model)
        frozen = pz.freeze_variables(variables)

        def inner(frozen, state, rng, tokens):
            m = pz.bind_variables(unbound, frozen)
            logits = m(tokens[{"seq": pz.slice[:-1]}])
            targets = tokens[{"seq": pz.slice[1:]}]
            losses = pz.nx.nmap(optax.softmax_cross_entropy_with_integer_labels)(
                logits.untag("vocabulary"), targets)
            return losses.untag("batch", "seq").unwrap().mean()

        loss = wrap(inner)(frozen, state, rng, tokens)
        return loss, state, {"loss": loss}

    return loss_fn


_POLICIES = {"dots": jax.checkpoint_policies.dots_saveable,
             "nothing": jax.checkpoint_policies.nothing_saveable}


# --------------------------------------------------------------------------------------------
# jraph: graph convolutions with haiku node updates
# --------------------------------------------------------------------------------------------


def _jraph_gcn(size: str, devices: Any = None) -> Entry:
    import haiku as hk
    import jraph

    c = {"test": dict(nodes=64, edges=256, features=16, width=32, layers=2, classes=4),
         "bench": dict(nodes=16384, edges=262144, features=256, width=512, layers=4,
                       classes=40)}[size]
    rng = np.random.default_rng(0)
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    graph = jraph.GraphsTuple(
        nodes=jax.random.normal(k[0], (c["nodes"], c["features"]), jnp.float32),
        edges=None,
        senders=jnp.asarray(rng.integers(0, c["nodes"], c["edges"]), jnp.int32),
        receivers=jnp.asarray(rng.integers(0, c["nodes"], c["edges"]), jnp.int32),
        n_node=jnp.asarray([c["nodes"]]), n_edge=jnp.asarray([c["edges"]]), globals=None)
    labels = jax.random.randint(k[1], (c["nodes"],), 0, c["classes"], jnp.int32)

    def network(graph):
        for _ in range(c["layers"]):
            graph = jraph.GraphConvolution(
                update_node_fn=lambda n: jax.nn.relu(hk.Linear(c["width"])(n)),
                add_self_edges=True)(graph)
        return jraph.GraphConvolution(update_node_fn=hk.Linear(c["classes"]))(graph).nodes

    net = hk.without_apply_rng(hk.transform(network))
    params = net.init(k[2], graph)
    tx = optax.adam(1e-2)

    def loss_fn(params, graph, labels):
        return _xent(net.apply(params, graph), labels)

    def make_step(wrap: Wrap = _identity) -> Step:
        def train_step(state, batch):
            params, opt_state = state
            loss, grads = jax.value_and_grad(wrap(loss_fn))(params, batch["graph"],
                                                           batch["labels"])
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        return train_step

    return Entry("jraph_gcn", "jraph", (params, tx.init(params)),
                 {"graph": graph, "labels": labels}, make_step, {}, None,
                 f"jraph.GraphConvolution x{c['layers'] + 1} (hk.Linear updates, self edges) "
                 f"on a random graph {c}, Adam")


#: name -> (PyPI distribution, import name, builder(size, devices) -> Entry); table order.
CORPUS: dict[str, tuple[str, str, Callable[..., Entry]]] = {
    "tx_gpt2_ts": ("transformers", "transformers", functools.partial(_tx_lm, "gpt2")),
    "tx_bert_ts": ("transformers", "transformers", functools.partial(_tx_lm, "bert")),
    "tx_resnet18_ts": ("transformers", "transformers", functools.partial(_tx_resnet, 18)),
    "tx_resnet50_ts": ("transformers", "transformers", functools.partial(_tx_resnet, 50)),
    "hk_resnet50": ("dm-haiku", "haiku", _hk_resnet50),
    "hk_resnet18_shardmap": ("dm-haiku", "haiku", _hk_resnet18_shardmap),
    "eqx_bn_cnn": ("equinox", "equinox", _eqx_bn_cnn),
    "eqx_mlp_filter": ("equinox", "equinox", _eqx_mlp_filter),
    "keras_resnet50": ("keras", "keras", functools.partial(_keras, "resnet50")),
    "keras_mobilenetv2": ("keras", "keras", functools.partial(_keras, "mobilenetv2")),
    "pz_llamalike": ("penzai", "penzai", _pz_llamalike),
    "jraph_gcn": ("jraph", "jraph", _jraph_gcn),
}

#: The cheap entries tests/test_corpus.py compiles (their packages are in the test extra).
#: The shard_map ResNet (176 s of the suite's 2-core budget) is left to the benchmark; the
#: BatchNorm-under-shard_map idiom is tested in tests/test_user_idioms.py, on CPU and on the
#: H100 target.
CI = ("eqx_bn_cnn", "eqx_mlp_filter")


def installed(name: str) -> bool:
    """Whether entry ``name``'s package (and, for jraph, haiku) can be imported here."""
    mods = [CORPUS[name][1]] + (["haiku"] if name == "jraph_gcn" else [])
    return all(importlib.util.find_spec(m) is not None for m in mods)


def make(name: str, size: str = "test", devices: Any = None) -> Entry:
    """The corpus entry ``name`` at ``size``; ``devices``: the target's devices (the mesh of
    shard_map entries is built on the first)."""
    if name not in CORPUS:
        raise KeyError(f"unknown corpus entry {name!r}; known: {', '.join(CORPUS)}")
    return CORPUS[name][2](size, devices)
