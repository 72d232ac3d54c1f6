"""A zoo of realistic train steps, shared by the benchmarks, the tests, the docs and the CLI.

Each entry builds a complete train step ``step(state, batch) -> (new_state, metrics)`` of the
kind users decorate with ``@jax.jit`` (and, later, ``@jaxmem.optimize``): a forward pass, a
``jax.value_and_grad`` and an optax update, all inside one function. Data are synthetic and
deterministic (``jax.random`` with a fixed seed); no download, no host I/O.

The zoo is part of the repository, not of the installed library: run from a checkout (the
repository root on ``sys.path``, as ``python -m`` and ``python -m pytest`` do) with flax and
optax installed (``pip install -e ".[test]"``).

Every model exists in two sizes: ``"test"`` (tiny, compiles in a second or two, for unit
tests) and ``"bench"`` (peak in the tens to hundreds of MiB, for the benchmark runner).
``remat_policy`` wraps each *block* in ``flax.linen.remat`` (``nnx.remat`` for nnx) with that
``jax.checkpoint`` policy, which is the per-block baseline that jaxmem is compared against.

Models, one module per family:

- :mod:`~benchmarks.zoo.mlp` ``mlp``: deep residual MLP (Dense → gelu → Dense → LayerNorm,
  residual add), adam.
- :mod:`~benchmarks.zoo.cnn` ``cnn_bn``: CNN with BatchNorm (mutable ``batch_stats``), relu,
  max/avg pooling, Dense head; sgd with momentum.
- :mod:`~benchmarks.zoo.resnet` ``resnet``: CIFAR-style ResNet with basic blocks (BN, relu,
  skip adds, strided 1×1 projection); ``resnet_bottleneck``: the same with bottleneck blocks
  (1×1 reduce → 3×3 → 1×1 expand to 4× the width); sgd with momentum.
- :mod:`~benchmarks.zoo.densenet` ``densenet``: feature maps concatenated, BN-relu-conv
  layers and transitions with average pooling; sgd with momentum.
- :mod:`~benchmarks.zoo.unet` ``unet``: U-Net for per-pixel classification (Conv-BN-relu ×2
  stages, max pooling down, ConvTranspose up, encoder features concatenated in the decoder,
  1×1 conv head), per-pixel cross-entropy; adam.
- :mod:`~benchmarks.zoo.transformer` ``transformer``: GPT-style decoder (LayerNorm, causal
  attention, gelu MLP, dropout, residual adds), adamw, next-token cross-entropy;
  ``transformer_scan``: the same blocks stacked with ``nn.scan`` (one ``lax.scan``).
- :mod:`~benchmarks.zoo.nnx_mlp` ``nnx_mlp``: a flax nnx MLP with dropout, trained through
  ``nnx.split``/``nnx.merge`` in a pure step.

:mod:`~benchmarks.zoo.small` is not a family: it holds the tiny linen models and the
``make_loss`` / ``make_step`` helpers the unit tests build their own steps from.

State is a plain dict: ``params``, ``opt_state``, ``step`` (int32), ``rng`` (a PRNG key that
the step splits for dropout and carries forward: a raw threefry ``PRNGKey``, or a typed
``"rbg"`` key in the transformers) and, for BatchNorm models, ``batch_stats``; ``nnx_mlp``
adds ``rest`` (the non-parameter nnx state).

Adding a family: write ``benchmarks/zoo/<family>.py`` with the flax modules, a builder
``build(*, key, rng, seed, policy, abstract, **config) -> Built`` (usually the model plus
:func:`benchmarks.zoo._common.linen_train_step`) and a dict
``MODELS = {"<name>": ModelSpec(build, {"test": {...}, "bench": {...}}, "one line")}``, then
add the module to :data:`FAMILIES` below; :func:`names`, :func:`make`, the CLI's
``zoo:<name>`` and ``python -m benchmarks --models <name>`` pick it up.
:class:`~benchmarks.zoo._common.ModelSpec` says what the builder receives.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from benchmarks import zoo
  >>> w = zoo.make("mlp", size="test")
  >>> new_state, metrics = jax.jit(w.step)(w.state, w.batch)
  >>> bool(jnp.isfinite(metrics["loss"]))
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from benchmarks.zoo import cnn, densenet, llama, mlp, nnx_mlp, resnet, transformer, unet
from benchmarks.zoo._common import SIZES, Batch, GradFn, ModelSpec, Policy, State, StepFn

__all__ = ["SIZES", "Workload", "config", "describe", "make", "names"]

#: The family modules, in the order :func:`names` lists their models. A new family is one
#: module with a ``MODELS`` dict and one line here.
FAMILIES = [
    mlp,
    cnn,
    resnet,
    densenet,
    unet,
    transformer,
    nnx_mlp,
    llama,
]


def _registry() -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    for family in FAMILIES:
        for name, spec in family.MODELS.items():
            if name in specs:
                raise ValueError(f"zoo model {name!r} registered twice (again by "
                                 f"{family.__name__})")
            if not set(SIZES) <= set(spec.sizes):
                raise ValueError(f"zoo model {name!r} ({family.__name__}) has sizes "
                                 f"{sorted(spec.sizes)}; every model needs {list(SIZES)} "
                                 "(more are allowed)")
            specs[name] = spec
    return specs


_MODELS: dict[str, ModelSpec] = _registry()


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
      overrides: the builder keywords that replaced the size's own (see :func:`make`).
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


def names() -> list[str]:
    """The zoo's model names, in a stable order (cheap first within each family)."""
    return list(_MODELS)


def describe(name: str) -> str:
    """One line describing model ``name``."""
    return _spec(name).description


def config(name: str, size: str = "test") -> dict[str, Any]:
    """The builder keyword arguments of ``name`` at ``size`` (a copy; safe to edit)."""
    spec = _spec(name)
    if size not in spec.sizes:
        raise ValueError(f"size must be one of {list(spec.sizes)} for {name!r}, got {size!r}")
    return dict(spec.sizes[size])


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
      >>> w = make("mlp", size="test", remat_policy=jax.checkpoint_policies.dots_saveable)
      >>> w.n_blocks
      3
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
    # Parameters and data are drawn with the "rbg" PRNG: its XLA RngBitGenerator compiles
    # ~7x faster than threefry, which dominated building a model. The train state's own key
    # is the default threefry PRNGKey except in the transformers (see transformer.build).
    built = _MODELS[name].build(
        key=jax.random.key(seed, impl="rbg"),
        rng=jax.random.PRNGKey(seed),
        seed=seed,
        policy=remat_policy,
        abstract=abstract,
        **cfg,
    )
    return Workload(
        name=name,
        step=built.step,
        state=built.state,
        batch=built.batch,
        description=_MODELS[name].description,
        n_blocks=built.n_blocks,
        size=size,
        batch_size=cfg["batch"],
        seed=seed,
        remat_policy=remat_policy,
        loss_and_grads=built.loss_and_grads,
        overrides=dict(overrides or {}),
    )


def _spec(name: str) -> ModelSpec:
    if name not in _MODELS:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {names()}")
    return _MODELS[name]
