"""A small zoo of realistic train steps, shared by tests, benchmarks, examples and the CLI.

Each entry builds a complete train step ``step(state, batch) -> (new_state, metrics)`` of the
kind users decorate with ``@jax.jit`` (and, later, ``@jaxmem.optimize``): a forward pass, a
``jax.value_and_grad`` and an optax update, all inside one function. Data are synthetic and
deterministic (``jax.random`` with a fixed seed); no download, no host I/O.

Every model exists in two sizes: ``"test"`` (tiny, compiles in a second or two, for unit
tests) and ``"bench"`` (peak in the tens to hundreds of MiB, for the benchmark runner).
``remat_policy`` wraps each *block* in ``flax.linen.remat`` (``nnx.remat`` for nnx) with that
``jax.checkpoint`` policy, which is the per-block baseline that jaxmem is compared against.

Models:

- ``mlp``: deep residual MLP (Dense → gelu → Dense → LayerNorm, residual add), adam.
- ``cnn_bn``: CNN with BatchNorm (mutable ``batch_stats``), relu, max/avg pooling, Dense
  head; sgd with momentum.
- ``resnet``: CIFAR-style ResNet with basic blocks (BN, relu, skip adds, strided 1×1
  projection); sgd with momentum.
- ``resnet_bottleneck``: the same ResNet with bottleneck blocks (1×1 reduce → 3×3 → 1×1
  expand to 4× the width, BN, relu, skip adds, strided 1×1 projection); sgd with momentum.
- ``densenet``: DenseNet-style net (feature maps concatenated), BN-relu-conv layers and
  transitions with average pooling; sgd with momentum.
- ``unet``: U-Net for per-pixel classification (Conv-BN-relu ×2 stages, max pooling down,
  ConvTranspose up, encoder features concatenated in the decoder, 1×1 conv head), per-pixel
  cross-entropy; adam.
- ``transformer``: GPT-style decoder (LayerNorm, causal attention, gelu MLP, dropout, residual
  adds), adamw, next-token cross-entropy.
- ``transformer_scan``: the same blocks stacked with ``nn.scan`` (the layers inside one
  ``lax.scan``).
- ``nnx_mlp``: a flax nnx MLP with dropout, trained through ``nnx.split``/``nnx.merge`` in a
  pure step.

State is a plain dict: ``params``, ``opt_state``, ``step`` (int32), ``rng`` (a PRNG key that
the step splits for dropout and carries forward: a raw threefry ``PRNGKey``, or a typed
``"rbg"`` key in the transformers) and, for BatchNorm models, ``batch_stats``; ``nnx_mlp``
adds ``rest`` (the non-parameter nnx state).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxmem import zoo
  >>> w = zoo.make("mlp", size="test")
  >>> new_state, metrics = jax.jit(w.step)(w.state, w.batch)
  >>> bool(jnp.isfinite(metrics["loss"]))
  True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = ["SIZES", "Workload", "describe", "make", "names"]

PyTree = Any
State = dict[str, Any]
Batch = dict[str, jax.Array]
Policy = Callable[..., bool]
StepFn = Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]
GradFn = Callable[[State, Batch], tuple[jax.Array, PyTree]]

#: The sizes every model is available in.
SIZES: tuple[str, ...] = ("test", "bench")


@dataclasses.dataclass(frozen=True)
class Workload:
    """One train step from the zoo, with example arguments.

    Attributes:
      name: the zoo name (``"mlp"``, ``"resnet"``, ...).
      step: ``step(state, batch) -> (new_state, metrics)``; pure, not jitted. ``metrics`` has
        ``loss`` and ``grad_norm``.
      state: the initial train state (a dict pytree).
      batch: one synthetic batch (a dict of arrays, ``x`` and ``y``).
      description: one line saying what the model is.
      n_blocks: how many modules the per-block ``remat_policy`` wraps (for ``*_scan`` models,
        the number of scanned layers).
      size: ``"test"`` or ``"bench"``.
      batch_size: the leading dimension of the batch.
      seed: the seed the parameters and data were drawn from.
      remat_policy: the per-block ``jax.checkpoint`` policy the step was built with, or None.
      loss_and_grads: ``(state, batch) -> (loss, grads)``, exactly the loss and gradients that
        ``step`` computes (same dropout key), for checking that variants agree.
    """

    name: str
    step: StepFn
    state: State
    batch: Batch
    description: str
    n_blocks: int
    size: str = "test"
    batch_size: int = 0
    seed: int = 0
    remat_policy: Policy | None = None
    loss_and_grads: GradFn | None = dataclasses.field(default=None, repr=False, compare=False)
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def args(self) -> tuple[State, Batch]:
        """``(state, batch)``: the positional arguments of :attr:`step`."""
        return (self.state, self.batch)

    def with_remat(self, policy: Policy | None) -> Workload:
        """The same workload, sharing this one's ``state`` and ``batch``, with per-block ``policy``.

        Wrapping a block in ``nn.remat`` does not change parameter paths, so the state is reused
        as is (no second initialisation); a structure mismatch raises ``ValueError``.
        """
        other = _make(self.name, self.size, self.batch_size, policy, self.seed, abstract=True,
                      overrides=self.overrides)
        mine, theirs = jax.tree.structure(self.state), jax.tree.structure(other.state)
        if mine != theirs:
            raise ValueError(
                f"zoo model {self.name!r}: the state built with remat_policy={policy!r} has a "
                f"different structure from this one's:\n{theirs}\nvs\n{mine}"
            )
        return dataclasses.replace(other, state=self.state, batch=self.batch)


# --------------------------------------------------------------------------------------------
# Sizes. A model's config is a dict of keyword arguments for its builder; ``batch`` overrides.
# --------------------------------------------------------------------------------------------

_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "mlp": {
        "test": dict(batch=16, features=32, width=32, hidden=64, depth=3, classes=10),
        "bench": dict(batch=512, features=256, width=256, hidden=1024, depth=8, classes=100),
    },
    "cnn_bn": {
        "test": dict(batch=4, image=16, channels=(8, 16), convs_per_stage=2, classes=10),
        "bench": dict(batch=32, image=32, channels=(32, 64, 128), convs_per_stage=2, classes=10),
    },
    "resnet": {
        "test": dict(batch=4, image=16, channels=(8, 16), blocks_per_stage=1, classes=10),
        "bench": dict(batch=32, image=32, channels=(16, 32, 64), blocks_per_stage=2, classes=10),
    },
    "resnet_bottleneck": {
        "test": dict(batch=4, image=16, channels=(8, 16), blocks_per_stage=1, classes=10),
        "bench": dict(batch=16, image=32, channels=(16, 32, 64), blocks_per_stage=2, classes=10),
    },
    "densenet": {
        "test": dict(batch=4, image=16, growth=4, layers_per_block=(2, 2), stem=8, classes=10),
        "bench": dict(
            batch=32, image=32, growth=12, layers_per_block=(3, 3, 3), stem=24, classes=10
        ),
    },
    "unet": {
        "test": dict(batch=2, image=16, channels=(8, 16), classes=4),
        "bench": dict(batch=8, image=64, channels=(16, 32, 64, 128), classes=4),
    },
    "transformer": {
        "test": dict(batch=2, seq=16, vocab=64, d_model=32, heads=2, layers=2, dropout=0.1),
        "bench": dict(batch=4, seq=256, vocab=1024, d_model=128, heads=4, layers=6, dropout=0.1),
    },
    "transformer_scan": {
        "test": dict(batch=2, seq=16, vocab=64, d_model=32, heads=2, layers=2, dropout=0.1),
        "bench": dict(batch=4, seq=256, vocab=1024, d_model=128, heads=4, layers=6, dropout=0.1),
    },
    "nnx_mlp": {
        "test": dict(batch=16, features=32, width=32, hidden=64, depth=3, classes=10, dropout=0.1),
        "bench": dict(
            batch=512, features=256, width=256, hidden=1024, depth=8, classes=100, dropout=0.1
        ),
    },
}

_DESCRIPTIONS: dict[str, str] = {
    "mlp": "residual MLP: Dense→gelu→Dense→LayerNorm + skip, per block; adam",
    "cnn_bn": "CNN: Conv→BatchNorm→relu, max/avg pooling, Dense head; sgd+momentum",
    "resnet": "CIFAR ResNet: basic blocks (BN, relu, skip add, strided 1x1 proj); sgd+momentum",
    "resnet_bottleneck": "CIFAR ResNet: bottleneck blocks (1x1→3x3→1x1, BN, relu, skip add); sgd",
    "densenet": "DenseNet: BN→relu→conv3x3 layers concatenated, 1x1+avgpool transitions; sgd",
    "unet": "U-Net segmentation: conv-BN-relu, maxpool, convT up, skip concat; per-pixel CE; adam",
    "transformer": "GPT decoder: LN, causal attention, gelu MLP, dropout, residuals; adamw",
    "transformer_scan": "GPT decoder, layers stacked with nn.scan (one lax.scan); adamw",
    "nnx_mlp": "flax nnx residual MLP with dropout, nnx.split/merge in a pure step, forward "
    "under jaxmem.flax.nnx.named_scopes; adam",
}


def names() -> list[str]:
    """The zoo's model names, in a stable order (cheap first within each family)."""
    return list(_CONFIGS)


def describe(name: str) -> str:
    """One line describing model ``name``."""
    _check_name(name)
    return _DESCRIPTIONS[name]


def config(name: str, size: str = "test") -> dict[str, Any]:
    """The builder keyword arguments of ``name`` at ``size`` (a copy; safe to edit)."""
    _check_name(name)
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    return dict(_CONFIGS[name][size])


def make(
    name: str,
    *,
    size: str = "test",
    batch: int | None = None,
    remat_policy: Policy | None = None,
    seed: int = 0,
    abstract: bool = False,
    **overrides: Any,
) -> Workload:
    """Build zoo model ``name`` as a :class:`Workload`: a train step plus example arguments.

    Args:
      name: one of :func:`names`.
      size: ``"test"`` (tiny) or ``"bench"`` (tens to hundreds of MiB).
      batch: batch size; defaults to the size's own.
      remat_policy: a ``jax.checkpoint`` policy (e.g. ``jax.checkpoint_policies.dots_saveable``)
        applied to every block with ``nn.remat``/``nnx.remat``; None for no remat.
      seed: seeds the parameters, the data and the dropout key. The same seed gives the same
        state and batch whatever ``remat_policy`` is.
      abstract: the state holds ``jax.ShapeDtypeStruct`` s (nothing initialised), for
        compile-only measurements of models too large to build on this machine.
      overrides: builder keywords replacing the size's own (see :func:`config`), e.g.
        ``depth=16, width=2048`` for the mlp; unknown names raise ``ValueError``.

    Returns:
      A :class:`Workload`. ``jax.jit(w.step)(*w.args)`` runs one train step.

    Example:
      >>> w = make("resnet", size="test", remat_policy=jax.checkpoint_policies.dots_saveable)
      >>> w.n_blocks
      2
    """
    return _make(name, size, batch, remat_policy, seed, abstract=abstract, overrides=overrides)


def _make(
    name: str,
    size: str,
    batch: int | None,
    remat_policy: Policy | None,
    seed: int,
    *,
    abstract: bool,
    overrides: dict[str, Any] | None = None,
) -> Workload:
    """:func:`make`; with ``abstract=True`` the state holds ``ShapeDtypeStruct`` s (no init)."""
    cfg = config(name, size)
    unknown = sorted(set(overrides or {}) - set(cfg) - {"batch"})
    if unknown:
        raise ValueError(f"zoo model {name!r} has no setting(s) {unknown}; its settings are "
                         f"{sorted(cfg)}")
    cfg.update(overrides or {})
    if batch is not None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        cfg["batch"] = int(batch)
    builder = _BUILDERS[name]
    # Parameters and data are drawn with the "rbg" PRNG: its XLA RngBitGenerator compiles
    # ~7x faster than threefry, which dominated building a model. The train state's own key
    # is the default threefry PRNGKey except in the transformers (see _build_gpt).
    step, loss_and_grads, state, data, n_blocks = builder(
        key=jax.random.key(seed, impl="rbg"),
        rng=jax.random.PRNGKey(seed),
        seed=seed,
        policy=remat_policy,
        abstract=abstract,
        **cfg,
    )
    return Workload(
        name=name,
        step=step,
        state=state,
        batch=data,
        description=_DESCRIPTIONS[name],
        n_blocks=n_blocks,
        size=size,
        batch_size=cfg["batch"],
        seed=seed,
        remat_policy=remat_policy,
        loss_and_grads=loss_and_grads,
        overrides=dict(overrides or {}),
    )


def _check_name(name: str) -> None:
    if name not in _CONFIGS:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {names()}")


# --------------------------------------------------------------------------------------------
# Shared pieces: synthetic data, the generic linen train step.
# --------------------------------------------------------------------------------------------


def _teacher_labels(key: jax.Array, x: jax.Array, classes: int) -> jax.Array:
    """Labels from a fixed random linear teacher, so that the task is learnable."""
    flat = x.reshape(x.shape[0], -1)
    w = jax.random.normal(key, (flat.shape[1], classes), flat.dtype)
    return jnp.argmax(flat @ w, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compile, not one per op
def _vector_data(key: jax.Array, batch: int, features: int, classes: int) -> Batch:
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, features), jnp.float32)
    return {"x": x, "y": _teacher_labels(ky, x, classes)}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compile, not one per op
def _image_data(key: jax.Array, batch: int, image: int, classes: int) -> Batch:
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, image, image, 3), jnp.float32)  # NHWC, CIFAR-shaped
    return {"x": x, "y": _teacher_labels(ky, x, classes)}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compile, not one per op
def _segmentation_data(key: jax.Array, batch: int, image: int, classes: int) -> Batch:
    """Images and per-pixel labels from a fixed random 5x5 conv teacher (argmax over classes)."""
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, image, image, 3), jnp.float32)  # NHWC
    w = jax.random.normal(ky, (5, 5, 3, classes), jnp.float32)
    scores = jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return {"x": x, "y": jnp.argmax(scores, axis=-1).astype(jnp.int32)}  # (batch, image, image)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compile, not one per op
def _token_data(key: jax.Array, batch: int, seq: int, vocab: int) -> Batch:
    """Arithmetic-progression token streams (start and stride per row): learnable next tokens."""
    ks, kd = jax.random.split(key)
    start = jax.random.randint(ks, (batch, 1), 0, vocab)
    stride = jax.random.randint(kd, (batch, 1), 1, 8)
    tokens = (start + stride * jnp.arange(seq + 1)[None, :]) % vocab
    tokens = tokens.astype(jnp.int32)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _maybe_remat(cls: type[nn.Module], policy: Policy | None, **kw: Any) -> type[nn.Module]:
    return cls if policy is None else nn.remat(cls, policy=policy, **kw)


def _linen_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    key: jax.Array,
    rng: jax.Array,
    data: Batch,
    *,
    batch_norm: bool = False,
    abstract: bool = False,
) -> tuple[StepFn, GradFn, State]:
    """A value_and_grad + optax train step for a linen ``model`` called as ``model(x)``.

    BatchNorm statistics (``batch_stats``) are a mutable collection updated by the forward
    pass and carried in the state; dropout draws from a key split off ``state["rng"]``.
    """
    k_init, k_drop = jax.random.split(key)
    rngs = {"params": k_init, "dropout": k_drop}
    example = data["x"][:1]  # shapes of the parameters do not depend on the batch size
    if abstract:
        variables = jax.eval_shape(model.init, rngs, example)
    else:
        variables = _jitted_init(model)(rngs, example)
    params = variables["params"]
    mutable = ["batch_stats"] if batch_norm else False

    def loss_fn(params, state, batch, dropout_key):
        variables = {"params": params}
        if batch_norm:
            variables["batch_stats"] = state["batch_stats"]
        out = model.apply(variables, batch["x"], rngs={"dropout": dropout_key}, mutable=mutable)
        logits, updates = out if batch_norm else (out, {})
        return _cross_entropy(logits, batch["y"]), updates

    def loss_and_grads(state: State, batch: Batch) -> tuple[jax.Array, PyTree]:
        _, dropout_key = jax.random.split(state["rng"])
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state, batch, dropout_key
        )
        return loss, grads

    def step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        rng, dropout_key = jax.random.split(state["rng"])
        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state, batch, dropout_key
        )
        param_updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = dict(
            state,
            params=optax.apply_updates(state["params"], param_updates),
            opt_state=opt_state,
            step=state["step"] + 1,
            rng=rng,
        )
        if batch_norm:
            new_state["batch_stats"] = updates["batch_stats"]
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    state: State = {
        "params": params,
        "opt_state": jax.eval_shape(tx.init, params) if abstract else tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": rng,
    }
    if batch_norm:
        state["batch_stats"] = variables["batch_stats"]
    return step, loss_and_grads, state


@functools.cache
def _jitted_init(model: nn.Module) -> Callable[..., PyTree]:
    """``jax.jit(model.init)``, one per distinct model config (linen modules hash by fields).

    One compile of ``init`` beats eager op-by-op dispatch, and the cache makes a second
    :func:`make` of the same model (another seed, another batch size) skip even that.
    """
    return jax.jit(model.init)


def _sgd() -> optax.GradientTransformation:
    return optax.sgd(learning_rate=0.05, momentum=0.9)


# --------------------------------------------------------------------------------------------
# mlp
# --------------------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """``x + LayerNorm(Dense(gelu(Dense(x))))``."""

    width: int
    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(self.hidden, name="up")(x)
        h = nn.gelu(h)
        h = nn.Dense(self.width, name="down")(h)
        h = nn.LayerNorm(name="norm")(h)
        return x + h


class MLP(nn.Module):
    """Embedding Dense, ``depth`` residual :class:`MLPBlock` s, classifier head."""

    width: int
    hidden: int
    depth: int
    classes: int
    policy: Policy | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block = _maybe_remat(MLPBlock, self.policy)
        x = nn.Dense(self.width, name="embed")(x)
        for i in range(self.depth):
            x = block(self.width, self.hidden, name=f"block{i}")(x)
        return nn.Dense(self.classes, name="head")(x)


def _build_mlp(*, key, rng, seed, policy, abstract, batch, features, width, hidden, depth, classes):
    kd, km = jax.random.split(key)
    data = _vector_data(kd, batch, features, classes)
    model = MLP(width, hidden, depth, classes, policy)
    step, grads, state = _linen_train_step(
        model, optax.adam(1e-3), km, rng, data, abstract=abstract
    )
    return step, grads, state, data, depth


# --------------------------------------------------------------------------------------------
# cnn_bn
# --------------------------------------------------------------------------------------------


class ConvBN(nn.Module):
    """``relu(BatchNorm(Conv3x3(x)))``, batch statistics updated in training."""

    channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.channels, (3, 3), use_bias=False, name="conv")(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn")(x)
        return nn.relu(x)


class CNN(nn.Module):
    """Stages of :class:`ConvBN`, max pooling then average pooling between stages, Dense head."""

    channels: Sequence[int]
    convs_per_stage: int
    classes: int
    policy: Policy | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block = _maybe_remat(ConvBN, self.policy)
        for s, c in enumerate(self.channels):
            if s:
                pool = nn.max_pool if s % 2 else nn.avg_pool
                x = pool(x, (2, 2), strides=(2, 2))
            for i in range(self.convs_per_stage):
                x = block(c, name=f"stage{s}_conv{i}")(x)
        x = nn.avg_pool(x, x.shape[1:3])  # global average pooling via reduce_window
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(self.classes, name="head")(x)


def _build_cnn_bn(
    *, key, rng, seed, policy, abstract, batch, image, channels, convs_per_stage, classes
):
    kd, km = jax.random.split(key)
    data = _image_data(kd, batch, image, classes)
    model = CNN(tuple(channels), convs_per_stage, classes, policy)
    step, grads, state = _linen_train_step(
        model, _sgd(), km, rng, data, batch_norm=True, abstract=abstract
    )
    return step, grads, state, data, len(channels) * convs_per_stage


# --------------------------------------------------------------------------------------------
# resnet
# --------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-relu-conv-BN, plus a (strided 1x1 conv-BN) skip, relu."""

    channels: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        bn = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9)
        s = (self.strides, self.strides)
        y = nn.Conv(self.channels, (3, 3), s, use_bias=False, name="conv1")(x)
        y = nn.relu(bn(name="bn1")(y))
        y = nn.Conv(self.channels, (3, 3), use_bias=False, name="conv2")(y)
        y = bn(name="bn2", scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.channels, (1, 1), s, use_bias=False, name="proj")(x)
            x = bn(name="proj_bn")(x)
        return nn.relu(x + y)


class BottleneckBlock(nn.Module):
    """ResNet bottleneck block: 1x1 reduce, 3x3 (strided), 1x1 expand to ``expansion * channels``,
    each conv followed by BN (relu after the first two), plus a (strided 1x1 conv-BN) skip, relu.
    """

    channels: int
    strides: int = 1
    expansion: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        bn = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9)
        s = (self.strides, self.strides)
        out = self.channels * self.expansion
        y = nn.Conv(self.channels, (1, 1), use_bias=False, name="conv1")(x)
        y = nn.relu(bn(name="bn1")(y))
        y = nn.Conv(self.channels, (3, 3), s, use_bias=False, name="conv2")(y)
        y = nn.relu(bn(name="bn2")(y))
        y = nn.Conv(out, (1, 1), use_bias=False, name="conv3")(y)
        y = bn(name="bn3", scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(out, (1, 1), s, use_bias=False, name="proj")(x)
            x = bn(name="proj_bn")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """CIFAR-style ResNet: 3x3 stem, stages of ``block`` s, global pool, Dense.

    ``block`` is :class:`BasicBlock` (``channels[s]`` wide) or :class:`BottleneckBlock`
    (``channels[s]`` inside, ``4 * channels[s]`` out); the stem is ``channels[0]`` wide.
    """

    channels: Sequence[int]
    blocks_per_stage: int
    classes: int
    policy: Policy | None = None
    block: type[nn.Module] = BasicBlock

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block = _maybe_remat(self.block, self.policy)
        x = nn.Conv(self.channels[0], (3, 3), use_bias=False, name="stem")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="stem_bn")(x))
        for s, c in enumerate(self.channels):
            for i in range(self.blocks_per_stage):
                strides = 2 if s and i == 0 else 1
                x = block(c, strides, name=f"stage{s}_block{i}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes, name="head")(x)


def _build_resnet(
    *,
    key,
    rng,
    seed,
    policy,
    abstract,
    batch,
    image,
    channels,
    blocks_per_stage,
    classes,
    block=BasicBlock,
):
    kd, km = jax.random.split(key)
    data = _image_data(kd, batch, image, classes)
    model = ResNet(tuple(channels), blocks_per_stage, classes, policy, block)
    step, grads, state = _linen_train_step(
        model, _sgd(), km, rng, data, batch_norm=True, abstract=abstract
    )
    return step, grads, state, data, len(channels) * blocks_per_stage


# --------------------------------------------------------------------------------------------
# densenet
# --------------------------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """``concat([x, Conv3x3(relu(BN(x)))])``: the input feature maps are kept and grown."""

    growth: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn")(x))
        y = nn.Conv(self.growth, (3, 3), use_bias=False, name="conv")(y)
        return jnp.concatenate([x, y], axis=-1)


class Transition(nn.Module):
    """``avg_pool(Conv1x1(relu(BN(x))))`` halving the channels and the resolution."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn")(x))
        y = nn.Conv(x.shape[-1] // 2, (1, 1), use_bias=False, name="conv")(y)
        return nn.avg_pool(y, (2, 2), strides=(2, 2))


class DenseNet(nn.Module):
    """Stem conv, dense blocks of :class:`DenseLayer` s with :class:`Transition` s between."""

    growth: int
    layers_per_block: Sequence[int]
    stem: int
    classes: int
    policy: Policy | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layer = _maybe_remat(DenseLayer, self.policy)
        transition = _maybe_remat(Transition, self.policy)
        x = nn.Conv(self.stem, (3, 3), use_bias=False, name="stem")(x)
        for b, n in enumerate(self.layers_per_block):
            if b:
                x = transition(name=f"transition{b}")(x)
            for i in range(n):
                x = layer(self.growth, name=f"block{b}_layer{i}")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, name="final_bn")(x))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes, name="head")(x)


def _build_densenet(
    *, key, rng, seed, policy, abstract, batch, image, growth, layers_per_block, stem, classes
):
    kd, km = jax.random.split(key)
    data = _image_data(kd, batch, image, classes)
    model = DenseNet(growth, tuple(layers_per_block), stem, classes, policy)
    step, grads, state = _linen_train_step(
        model, _sgd(), km, rng, data, batch_norm=True, abstract=abstract
    )
    n_blocks = sum(layers_per_block) + len(layers_per_block) - 1
    return step, grads, state, data, n_blocks


# --------------------------------------------------------------------------------------------
# unet
# --------------------------------------------------------------------------------------------


class DoubleConv(nn.Module):
    """Two ``relu(BatchNorm(Conv3x3(x)))``: one U-Net encoder, bottleneck or decoder stage."""

    channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(2):
            x = nn.Conv(self.channels, (3, 3), use_bias=False, name=f"conv{i}")(x)
            x = nn.BatchNorm(use_running_average=False, momentum=0.9, name=f"bn{i}")(x)
            x = nn.relu(x)
        return x


class UpBlock(nn.Module):
    """U-Net decoder stage: 2x2 stride-2 ConvTranspose, skip concatenated, :class:`DoubleConv`."""

    channels: int

    @nn.compact
    def __call__(self, x: jax.Array, skip: jax.Array) -> jax.Array:
        x = nn.ConvTranspose(self.channels, (2, 2), strides=(2, 2), name="up")(x)
        x = jnp.concatenate([skip, x], axis=-1)
        return DoubleConv(self.channels, name="conv")(x)


class UNet(nn.Module):
    """U-Net: :class:`DoubleConv` encoder stages with 2x2 max pooling, a bottleneck stage,
    :class:`UpBlock` decoder stages concatenating the matching encoder features, 1x1 conv head
    giving per-pixel class logits. ``channels[-1]`` is the bottleneck's width."""

    channels: Sequence[int]
    classes: int
    policy: Policy | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        down = _maybe_remat(DoubleConv, self.policy)
        up = _maybe_remat(UpBlock, self.policy)
        skips = []
        for s, c in enumerate(self.channels[:-1]):
            x = down(c, name=f"down{s}")(x)
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = down(self.channels[-1], name="bottleneck")(x)
        for s in reversed(range(len(self.channels) - 1)):
            x = up(self.channels[s], name=f"up{s}")(x, skips[s])
        return nn.Conv(self.classes, (1, 1), name="head")(x)


def _build_unet(*, key, rng, seed, policy, abstract, batch, image, channels, classes):
    if image % 2 ** (len(channels) - 1):
        raise ValueError(f"unet: image {image} is not divisible by 2**{len(channels) - 1}")
    kd, km = jax.random.split(key)
    data = _segmentation_data(kd, batch, image, classes)
    model = UNet(tuple(channels), classes, policy)
    step, grads, state = _linen_train_step(
        model, optax.adam(1e-3), km, rng, data, batch_norm=True, abstract=abstract
    )
    return step, grads, state, data, 2 * len(channels) - 1


# --------------------------------------------------------------------------------------------
# transformer, transformer_scan
# --------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with dropout on the attention weights and output."""

    d_model: int
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        hd = d // self.heads
        qkv = nn.Dense(3 * d, name="qkv")(x).reshape(b, t, 3, self.heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
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

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + CausalSelfAttention(self.d_model, self.heads, self.dropout, name="attn")(
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

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return DecoderBlock(self.d_model, self.heads, self.dropout, name="block")(x), None


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

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d_model, name="wte")(tokens)
        pos = self.param("wpe", nn.initializers.normal(0.02), (self.seq, self.d_model))
        x = x + pos[None, : tokens.shape[1]]
        x = nn.Dropout(self.dropout, deterministic=False, name="emb_drop")(x)
        if self.scan:
            # prevent_cse=False is what JAX recommends for remat inside scan.
            body = _maybe_remat(_ScanBlock, self.policy, prevent_cse=False)
            stack = nn.scan(
                body,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=self.layers,
            )
            x, _ = stack(self.d_model, self.heads, self.dropout, name="layers")(x, None)
        else:
            block = _maybe_remat(DecoderBlock, self.policy)
            for i in range(self.layers):
                x = block(self.d_model, self.heads, self.dropout, name=f"block{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(self.vocab, name="head")(x)


def _build_gpt(
    *, key, rng, seed, policy, abstract, batch, seq, vocab, d_model, heads, layers, dropout, scan
):
    kd, km = jax.random.split(key)
    data = _token_data(kd, batch, seq, vocab)
    # A typed "rbg" key for dropout, as large-model trainers (MaxText, T5X) configure JAX: it
    # halves the compile time of a step with many dropout sites against threefry.
    rng = jax.random.key(seed, impl="rbg")
    model = GPT(vocab, seq, d_model, heads, layers, dropout, scan, policy)
    tx = optax.adamw(3e-4, weight_decay=0.01)
    step, grads, state = _linen_train_step(model, tx, km, rng, data, abstract=abstract)
    return step, grads, state, data, layers


# --------------------------------------------------------------------------------------------
# nnx_mlp
# --------------------------------------------------------------------------------------------


class NNXBlock(nnx.Module):
    """``x + LayerNorm(Dropout(Dense(gelu(Dense(x)))))`` in flax nnx."""

    def __init__(self, width: int, hidden: int, dropout: float, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(width, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(dropout)

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        h = self.down(nnx.gelu(self.up(x)))
        h = self.drop(h, rngs=key)
        return x + self.norm(h)


class NNXMLP(nnx.Module):
    """Embedding Linear, a list of :class:`NNXBlock` s, classifier head (flax nnx)."""

    def __init__(self, features, width, hidden, depth, classes, dropout, *, rngs: nnx.Rngs):
        self.embed = nnx.Linear(features, width, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(width, hidden, dropout, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x: jax.Array, key: jax.Array, policy: Policy | None = None) -> jax.Array:
        x = self.embed(x)
        keys = jax.random.split(key, len(self.blocks))
        for block, k in zip(self.blocks, keys, strict=True):
            if policy is None:
                x = block(x, k)
            else:
                x = nnx.remat(lambda b, h, kk: b(h, kk), policy=policy)(block, x, k)
        return self.head(x)


def _build_nnx_mlp(
    *, key, rng, seed, policy, abstract, batch, features, width, hidden, depth, classes, dropout
):
    kd, km = jax.random.split(key)
    data = _vector_data(kd, batch, features, classes)
    build = lambda: NNXMLP(features, width, hidden, depth, classes, dropout, rngs=nnx.Rngs(km))
    model = nnx.eval_shape(build) if abstract else build()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(1e-3)

    def loss_fn(params, rest, batch, dropout_key):
        from jaxmem.flax.nnx import named_scopes

        model = nnx.merge(graphdef, params, rest)
        # Layer paths in the name stack (``blocks/3/up``), as nnx users are told to do
        # (docs/entry_points.md): what linen gives for free, and what block plans need.
        with named_scopes(model):
            logits = model(batch["x"], dropout_key, policy)
        return _cross_entropy(logits, batch["y"])

    def loss_and_grads(state: State, batch: Batch) -> tuple[jax.Array, PyTree]:
        _, dropout_key = jax.random.split(state["rng"])
        return jax.value_and_grad(loss_fn)(state["params"], state["rest"], batch, dropout_key)

    def step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        rng, dropout_key = jax.random.split(state["rng"])
        loss, grads = jax.value_and_grad(loss_fn)(
            state["params"], state["rest"], batch, dropout_key
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = dict(
            state,
            params=optax.apply_updates(state["params"], updates),
            opt_state=opt_state,
            step=state["step"] + 1,
            rng=rng,
        )
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    state: State = {
        "params": params,
        "rest": rest,
        "opt_state": jax.eval_shape(tx.init, params) if abstract else tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": rng,
    }
    return step, loss_and_grads, state, data, depth


_BUILDERS: dict[str, Callable[..., tuple[StepFn, GradFn, State, Batch, int]]] = {
    "mlp": _build_mlp,
    "cnn_bn": _build_cnn_bn,
    "resnet": _build_resnet,
    "resnet_bottleneck": functools.partial(_build_resnet, block=BottleneckBlock),
    "densenet": _build_densenet,
    "unet": _build_unet,
    "transformer": functools.partial(_build_gpt, scan=False),
    "transformer_scan": functools.partial(_build_gpt, scan=True),
    "nnx_mlp": _build_nnx_mlp,
}
