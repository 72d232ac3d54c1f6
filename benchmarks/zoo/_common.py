"""What every zoo family shares: the spec a family registers, synthetic data, the linen step.

A family module (``mlp.py``, ``resnet.py``, ...) defines its flax modules, a builder and a
``MODELS`` dict of :class:`ModelSpec` s; :mod:`benchmarks.zoo` collects them. Nothing here
knows which families exist.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

PyTree = Any
State = dict[str, Any]
Batch = dict[str, jax.Array]
Policy = Callable[..., bool]
StepFn = Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]
GradFn = Callable[[State, Batch], tuple[jax.Array, PyTree]]

#: The sizes every model is available in.
SIZES: tuple[str, ...] = ("test", "bench")


class Built(NamedTuple):
    """What a builder returns: the step, its loss and gradients, example arguments."""

    step: StepFn
    loss_and_grads: GradFn
    state: State
    batch: Batch
    n_blocks: int


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One zoo model as a family registers it.

    Attributes:
      build: ``build(*, key, rng, seed, policy, abstract, **config) -> Built``. ``key`` (an
        ``"rbg"`` key) draws parameters and data, ``rng`` (a threefry ``PRNGKey``) is the
        train state's own key, ``policy`` the per-block ``jax.checkpoint`` policy or None,
        ``abstract`` asks for ``ShapeDtypeStruct`` s instead of initialised arrays; ``config``
        is one of ``sizes`` (``batch`` included), possibly overridden.
      sizes: builder keyword arguments per size in :data:`SIZES`; every size has the same keys.
      description: one line saying what the model is.
    """

    build: Callable[..., Built]
    sizes: Mapping[str, Mapping[str, Any]]
    description: str


# --------------------------------------------------------------------------------------------
# Synthetic data: deterministic, learnable, no download.
# --------------------------------------------------------------------------------------------


def _teacher_labels(key: jax.Array, x: jax.Array, classes: int) -> jax.Array:
    """Labels from a fixed random linear teacher, so that the task is learnable."""
    flat = x.reshape(x.shape[0], -1)
    w = jax.random.normal(key, (flat.shape[1], classes), flat.dtype)
    return jnp.argmax(flat @ w, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compile, not one per op
def vector_data(key: jax.Array, batch: int, features: int, classes: int) -> Batch:
    """``x`` of shape ``(batch, features)``, labels ``y`` from a linear teacher."""
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, features), jnp.float32)
    return {"x": x, "y": _teacher_labels(ky, x, classes)}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compile, not one per op
def image_data(key: jax.Array, batch: int, image: int, classes: int) -> Batch:
    """CIFAR-shaped NHWC images ``x``, labels ``y`` from a linear teacher."""
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, image, image, 3), jnp.float32)
    return {"x": x, "y": _teacher_labels(ky, x, classes)}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compile, not one per op
def segmentation_data(key: jax.Array, batch: int, image: int, classes: int) -> Batch:
    """Images and per-pixel labels from a fixed random 5x5 conv teacher (argmax over classes)."""
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, image, image, 3), jnp.float32)  # NHWC
    w = jax.random.normal(ky, (5, 5, 3, classes), jnp.float32)
    scores = jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return {"x": x, "y": jnp.argmax(scores, axis=-1).astype(jnp.int32)}  # (batch, image, image)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compile, not one per op
def token_data(key: jax.Array, batch: int, seq: int, vocab: int) -> Batch:
    """Arithmetic-progression token streams (start and stride per row): learnable next tokens."""
    ks, kd = jax.random.split(key)
    start = jax.random.randint(ks, (batch, 1), 0, vocab)
    stride = jax.random.randint(kd, (batch, 1), 1, 8)
    tokens = (start + stride * jnp.arange(seq + 1)[None, :]) % vocab
    tokens = tokens.astype(jnp.int32)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


# --------------------------------------------------------------------------------------------
# The generic linen train step.
# --------------------------------------------------------------------------------------------


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def maybe_remat(cls: type[nn.Module], policy: Policy | None, **kw: Any) -> type[nn.Module]:
    """``nn.remat(cls, policy=policy)``, or ``cls`` itself when ``policy`` is None."""
    return cls if policy is None else nn.remat(cls, policy=policy, **kw)


def sgd() -> optax.GradientTransformation:
    """The zoo's SGD: learning rate 0.05, momentum 0.9."""
    return optax.sgd(learning_rate=0.05, momentum=0.9)


def linen_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    key: jax.Array,
    rng: jax.Array,
    data: Batch,
    *,
    batch_norm: bool = False,
    abstract: bool = False,
    loss: Callable[[Any, jax.Array], jax.Array] | None = None,
) -> tuple[StepFn, GradFn, State]:
    """A value_and_grad + optax train step for a linen ``model`` called as ``model(x)``.

    BatchNorm statistics (``batch_stats``) are a mutable collection updated by the forward
    pass and carried in the state; dropout draws from a key split off ``state["rng"]``.
    ``loss(model output, labels)`` defaults to :func:`cross_entropy` of the logits.
    Returns ``(step, loss_and_grads, state)``.
    """
    loss = loss or cross_entropy
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
        return loss(logits, batch["y"]), updates

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
    build of the same model (another seed, another batch size) skip even that.
    """
    return jax.jit(model.init)
