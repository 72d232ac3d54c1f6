"""Flax wrappers that apply jaxmem's remat policies to modules (linen and nnx).

- :func:`linen_remat` (``jaxmem.flax.linen.remat``): ``nn.remat`` with
  :func:`jaxmem.policies.utility` as the default policy; a module class in, a module class
  out, same parameters.
- :func:`linen_intercept` (``jaxmem.flax.linen.intercept``): a context manager that remats
  every instance of the given classes, without editing the model (``nn.intercept_methods``).
- :func:`nnx_remat` (``jaxmem.flax.nnx.remat``): ``nnx.remat`` with the jaxmem policy, for a
  function or an nnx module class.
- :func:`nnx_intercept` (``jaxmem.flax.nnx.intercept``): the nnx counterpart of
  :func:`linen_intercept` (patches the classes' ``__call__`` while active).
- :func:`named_scopes` (``jaxmem.flax.nnx.named_scopes``): wraps submodule calls in
  ``jax.named_scope(path)`` so that jaxprs, HLO and :func:`jaxmem.analyze` show ``fc1`` or
  ``blocks/3/attn`` (nnx name stacks carry no module paths).

Array leaves of a call's arguments are traced; other leaves (``train=True``, strings) are
passed as static values, so flags that drive Python control flow keep working under remat.
Mutable collections (BatchNorm ``batch_stats``) and RNG streams (dropout) go through the
lifted transforms of flax, as with ``nn.remat`` / ``nnx.remat``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from jaxmem.rewriting import policies

__all__ = ["linen_intercept", "linen_remat", "named_scopes", "nnx_intercept", "nnx_remat"]

_DEFAULT_POLICY = policies.utility


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.core.Tracer)


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Callable]:
    """Array leaves of ``(args, kwargs)`` and a function rebuilding both from new arrays."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dyn_mask = [_is_array(x) for x in leaves]

    def rebuild(dyn: Iterable[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        it = iter(dyn)
        full = [next(it) if d else x for x, d in zip(leaves, dyn_mask, strict=True)]
        return jax.tree_util.tree_unflatten(tree, full)

    return [x for x, d in zip(leaves, dyn_mask, strict=True) if d], rebuild


def _check_policy(policy: Any, where: str) -> None:
    if policy is not None and not callable(policy):
        raise TypeError(f"{where}: policy must be a jax.checkpoint policy (a callable such as "
                        f"jaxmem.policies.utility), got {policy!r}")


def _check_classes(classes: Any, base: type, where: str) -> tuple[type, ...]:
    if isinstance(classes, type):
        classes = (classes,)
    try:
        classes = tuple(classes)
    except TypeError:
        raise TypeError(f"{where}: classes must be a module class or a tuple of them, got "
                        f"{classes!r}") from None
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, base))]
    if not classes or bad:
        raise TypeError(f"{where}: classes must be {base.__module__}.{base.__name__} "
                        f"subclasses, got {bad or classes!r}")
    return classes


# --- linen ---------------------------------------------------------------------------------


def linen_remat(target: Any, *, policy: Callable[..., Any] | None = _DEFAULT_POLICY,
                prevent_cse: bool = True, static_argnums: int | tuple[int, ...] = (),
                methods: Any = None) -> Any:
    """``nn.remat`` with jaxmem's policy: keep heavy outputs, recompute utility ones.

    Args:
      target: a ``flax.linen.Module`` class (returns a subclass of the same name, fields and
        parameters, whose ``__call__`` runs under the lifted ``nn.remat``; non-array
        arguments such as ``train=True`` stay static), an instance (returns an instance of
        that class with the same fields),
        or a function ``fn(module, *args)`` (as ``nn.remat`` takes).
      policy: a ``jax.checkpoint`` policy; default :func:`jaxmem.policies.utility`. ``None``
        recomputes everything.
      prevent_cse, static_argnums, methods: as in ``nn.remat``. Use ``prevent_cse=False``
        for a module scanned with ``nn.scan``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmem.flax
      >>> class Block(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return x + nn.Dense(8)(nn.gelu(nn.Dense(32)(x)))
      >>> RematBlock = jaxmem.flax.linen.remat(Block)
      >>> x = jnp.ones((4, 8))
      >>> params = Block().init(jax.random.key(0), x)        # same parameters for both
      >>> g = jax.grad(lambda p: RematBlock().apply(p, x).sum())(params)
      >>> r = jax.grad(lambda p: Block().apply(p, x).sum())(params)
      >>> bool(jax.tree.all(jax.tree.map(jnp.allclose, g, r)))
      True
    """
    _check_policy(policy, "jaxmem.flax.linen.remat")
    if isinstance(target, nn.Module):
        cls = linen_remat(type(target), policy=policy, prevent_cse=prevent_cse,
                          static_argnums=static_argnums, methods=methods)
        fields = {f.name: getattr(target, f.name) for f in dataclasses.fields(target)
                  if f.init and f.name not in ("parent", "name")}
        return cls(**fields)
    if isinstance(target, type) and not issubclass(target, nn.Module):
        raise TypeError(f"jaxmem.flax.linen.remat: {target.__name__} is not a flax.linen "
                        "Module; for nnx modules use jaxmem.flax.nnx.remat")
    if not callable(target):
        raise TypeError(f"jaxmem.flax.linen.remat expects a linen Module class, instance or "
                        f"a function fn(module, *args), got {target!r}")
    if not isinstance(target, type) or methods is not None or static_argnums:
        return nn.remat(target, policy=policy, prevent_cse=prevent_cse,
                        static_argnums=static_argnums, methods=methods)
    orig = target.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        dyn, rebuild = _split(args, kwargs)

        def body(m: nn.Module, *d: Any) -> Any:
            a, k = rebuild(d)
            return orig(m, *a, **k)

        return nn.remat(body, policy=policy, prevent_cse=prevent_cse)(self, *dyn)

    # Same class name, so auto-named submodules (``Block_0``) keep their parameter paths.
    return type(target.__name__, (target,), {"__call__": __call__,
                                             "__module__": target.__module__,
                                             "__doc__": target.__doc__})


_linen_bypass = threading.local()


@contextlib.contextmanager
def linen_intercept(classes: type | Iterable[type], *,
                    policy: Callable[..., Any] | None = _DEFAULT_POLICY,
                    prevent_cse: bool = True,
                    methods: Iterable[str] = ("__call__",)) -> Iterator[None]:
    """Remat every call of the given linen module classes while the context is active.

    Uses ``flax.linen.intercept_methods``: the model's code is not touched. Each matching
    call runs under the lifted ``nn.remat`` (so ``batch_stats`` updates and dropout RNGs
    work, in ``init`` and ``apply``). Nested matches are rematted too. It acts while the
    model is *traced*: a ``jax.jit`` function already traced outside the context is served
    from jit's cache unchanged, so enter the context before the first call (or wrap a fresh
    function).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmem.flax
      >>> class Block(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return x + nn.Dense(8)(nn.relu(nn.Dense(32)(x)))
      >>> class Net(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return Block()(Block()(x))
      >>> x = jnp.ones((4, 8)); params = Net().init(jax.random.key(0), x)
      >>> loss = lambda p: Net().apply(p, x).sum()
      >>> with jaxmem.flax.linen.intercept(Block):
      ...     g = jax.grad(loss)(params)
      >>> bool(jax.tree.all(jax.tree.map(jnp.allclose, g, jax.grad(loss)(params))))
      True
    """
    classes = _check_classes(classes, nn.Module, "jaxmem.flax.linen.intercept")
    _check_policy(policy, "jaxmem.flax.linen.intercept")
    if isinstance(methods, str):
        methods = (methods,)
    names = frozenset(methods)

    def interceptor(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        mdl = context.module
        if context.method_name not in names or not isinstance(mdl, classes):
            return next_fun(*args, **kwargs)
        if getattr(_linen_bypass, "on", False):
            _linen_bypass.on = False
            return next_fun(*args, **kwargs)
        dyn, rebuild = _split(args, kwargs)
        method = context.method_name

        def body(m: nn.Module, *d: Any) -> Any:
            a, k = rebuild(d)
            _linen_bypass.on = True  # the next intercepted call is this one: run it
            try:
                return getattr(m, method)(*a, **k)
            finally:
                _linen_bypass.on = False

        return nn.remat(body, policy=policy, prevent_cse=prevent_cse)(mdl, *dyn)

    with nn.intercept_methods(interceptor):
        yield


# --- nnx -----------------------------------------------------------------------------------

_scope_state = threading.local()


def _registry() -> list[dict[int, str]]:
    if not hasattr(_scope_state, "maps"):
        _scope_state.maps = []
        _scope_state.active = []
    return _scope_state.maps


def _path_of(module: Any) -> str | None:
    for m in reversed(_registry()):
        if id(module) in m:
            return m[id(module)]
    return None


def _paths(model: Any, prefix: str = "") -> dict[int, str]:
    out = {}
    for path, m in nnx.iter_modules(model):
        p = "/".join(str(x) for x in path)
        full = "/".join(x for x in (prefix, p) if x)
        if full:
            out[id(m)] = full
    return out


@contextlib.contextmanager
def _scope(module: Any, prefix: str) -> Iterator[None]:
    maps = _registry()
    maps.append(_paths(module, prefix))
    try:
        yield
    finally:
        maps.pop()


def _call_in_scope(orig: Callable, self: Any, args: tuple, kwargs: dict) -> Any:
    path = _path_of(self)
    if path is None:
        return orig(self, *args, **kwargs)
    active = _scope_state.active
    rel = path
    if active and path.startswith(active[-1] + "/"):
        rel = path[len(active[-1]) + 1:]
    active.append(path)
    try:
        with jax.named_scope(rel):
            return orig(self, *args, **kwargs)
    finally:
        active.pop()


_patched: dict[type, tuple[Callable, int]] = {}
_patch_lock = threading.Lock()


def _patch_scoped(cls: type) -> None:
    with _patch_lock:
        if cls in _patched:
            orig, n = _patched[cls]
            _patched[cls] = (orig, n + 1)
            return
        orig = cls.__dict__.get("__call__")
        if orig is None:
            return  # inherits __call__: the base class gets patched when it is seen
        _patched[cls] = (orig, 1)

        @functools.wraps(orig)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            return _call_in_scope(orig, self, args, kwargs)

        __call__._jaxmem_scoped = True  # type: ignore[attr-defined]
        cls.__call__ = __call__


def _unpatch_scoped(cls: type) -> None:
    with _patch_lock:
        if cls not in _patched:
            return
        orig, n = _patched[cls]
        if n > 1:
            _patched[cls] = (orig, n - 1)
        else:
            del _patched[cls]
            cls.__call__ = orig


def _call_classes(model: Any) -> set[type]:
    out: set[type] = set()
    for _, m in nnx.iter_modules(model):
        for klass in type(m).__mro__:
            if "__call__" in klass.__dict__ and issubclass(klass, nnx.Module):
                out.add(klass)
                break
    return out


@contextlib.contextmanager
def named_scopes(model: nnx.Module, *, prefix: str = "") -> Iterator[nnx.Module]:
    """Name every submodule call of ``model`` after its path, with ``jax.named_scope``.

    Inside the context, a call of ``model.blocks[3].attn`` runs under
    ``jax.named_scope("blocks/3/attn")`` (nested calls are named relative to their parent,
    so the name stack reads ``blocks/3/attn``, not ``blocks/3/blocks/3/attn``). Jaxprs, the
    compiled HLO's ``op_name`` and :func:`jaxmem.analyze` then show layer paths.

    Enter it on the module instance that is actually called: inside a pure loss, *after*
    ``nnx.merge`` (paths are keyed by object identity). Submodules that nnx transforms copy
    (``nnx.scan``, ``nnx.vmap``) keep only the path of the call that entered the transform;
    :func:`nnx_remat` and :func:`nnx_intercept` re-register their copies, so rematted
    blocks keep full paths. Patches the classes' ``__call__`` while active (not
    thread-safe against other code patching the same classes).

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem.flax
      >>> from flax import nnx
      >>> class MLP(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.fc1 = nnx.Linear(4, 8, rngs=rngs)
      ...         self.fc2 = nnx.Linear(8, 2, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.fc2(nnx.relu(self.fc1(x)))
      >>> model = MLP(nnx.Rngs(0))
      >>> with jaxmem.flax.nnx.named_scopes(model):
      ...     jaxpr = jax.make_jaxpr(model)(jnp.ones((1, 4)))
      >>> sorted({str(e.source_info.name_stack) for e in jaxpr.eqns} - {''})
      ['fc1', 'fc2']
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"named_scopes expects an nnx.Module instance, got "
                        f"{type(model).__name__}; for linen, module paths are already in "
                        "the name stack")
    classes = _call_classes(model)
    for cls in classes:
        _patch_scoped(cls)
    try:
        with _scope(model, prefix):
            _scope_state.active = list(getattr(_scope_state, "active", []))
            yield model
    finally:
        for cls in classes:
            _unpatch_scoped(cls)


def _remat_call(fn: Callable, self: Any, args: tuple, kwargs: dict, *,
                policy: Any, prevent_cse: bool) -> Any:
    """Run ``fn(self, *args, **kwargs)`` under ``nnx.remat``, keeping named scopes."""
    dyn, rebuild = _split(args, kwargs)
    outer = _path_of(self) if _registry() else None

    def body(m: Any, *d: Any) -> Any:
        a, k = rebuild(d)
        if outer is None:
            return fn(m, *a, **k)
        with _scope(m, outer):
            return fn(m, *a, **k)

    return nnx.remat(body, policy=policy, prevent_cse=prevent_cse)(self, *dyn)


def nnx_remat(target: Any, *, policy: Callable[..., Any] | None = _DEFAULT_POLICY,
              prevent_cse: bool = True, static_argnums: int | tuple[int, ...] = ()) -> Any:
    """``nnx.remat`` with jaxmem's policy (keep heavy outputs, recompute utility ones).

    Args:
      target: a function (``fn(module, *args)`` or any function of arrays and modules;
        returns ``nnx.remat(fn, policy=...)``) or an ``nnx.Module`` class (returns a subclass
        whose ``__call__`` runs under ``nnx.remat``; same state, same paths).
      policy: default :func:`jaxmem.policies.utility`.
      prevent_cse, static_argnums: as in ``nnx.remat`` (static_argnums for functions only;
        for classes non-array arguments are static automatically).

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem.flax
      >>> from flax import nnx
      >>> class Block(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.up = nnx.Linear(8, 32, rngs=rngs)
      ...         self.down = nnx.Linear(32, 8, rngs=rngs)
      ...     def __call__(self, x):
      ...         return x + self.down(nnx.gelu(self.up(x)))
      >>> RematBlock = jaxmem.flax.nnx.remat(Block)
      >>> m = RematBlock(nnx.Rngs(0)); x = jnp.ones((4, 8))
      >>> g = nnx.grad(lambda m: m(x).sum())(m)
      >>> isinstance(m, Block)
      True
    """
    _check_policy(policy, "jaxmem.flax.nnx.remat")
    if isinstance(target, nnx.Module):
        raise TypeError(
            "jaxmem.flax.nnx.remat got a module instance; wrap its class "
            f"(jaxmem.flax.nnx.remat({type(target).__name__})) before building the model, or "
            f"remat existing instances with `with jaxmem.flax.nnx.intercept("
            f"{type(target).__name__}):`")
    if isinstance(target, type):
        if not issubclass(target, nnx.Module):
            raise TypeError(f"jaxmem.flax.nnx.remat: {target.__name__} is not an nnx.Module; "
                            "for linen modules use jaxmem.flax.linen.remat")
        orig = target.__call__

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            return _remat_call(orig, self, args, kwargs, policy=policy,
                               prevent_cse=prevent_cse)

        return type(f"Remat{target.__name__}", (target,),
                    {"__call__": __call__, "__module__": target.__module__,
                     "__doc__": target.__doc__})
    if not callable(target):
        raise TypeError(f"jaxmem.flax.nnx.remat expects a function or an nnx.Module class, "
                        f"got {target!r}")
    return nnx.remat(target, policy=policy, prevent_cse=prevent_cse,
                     static_argnums=static_argnums)


@contextlib.contextmanager
def nnx_intercept(classes: type | Iterable[type], *,
                  policy: Callable[..., Any] | None = _DEFAULT_POLICY,
                  prevent_cse: bool = True) -> Iterator[None]:
    """Remat every ``__call__`` of the given nnx module classes while the context is active.

    Patches each class's ``__call__`` (restored on exit) to run under ``nnx.remat`` with
    ``policy``; module state updates (BatchNorm statistics, RNG counts) propagate as with
    ``nnx.remat``. Not thread-safe against other code patching the same classes.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem.flax
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(0)), nnx.relu,
      ...                        nnx.Linear(16, 1, rngs=nnx.Rngs(1)))
      >>> x = jnp.ones((2, 4))
      >>> with jaxmem.flax.nnx.intercept(nnx.Linear):
      ...     g = nnx.grad(lambda m: m(x).sum())(model)
      >>> r = nnx.grad(lambda m: m(x).sum())(model)
      >>> bool(jnp.allclose(g['layers'][0]['kernel'][...], r['layers'][0]['kernel'][...]))
      True
    """
    classes = _check_classes(classes, nnx.Module, "jaxmem.flax.nnx.intercept")
    _check_policy(policy, "jaxmem.flax.nnx.intercept")
    saved: dict[type, Any] = {}
    for cls in classes:
        orig = cls.__call__

        def __call__(self: Any, *args: Any, _orig: Callable = orig, **kwargs: Any) -> Any:  # noqa: N807
            def run(m: Any, *a: Any, **k: Any) -> Any:
                return _orig(m, *a, **k)

            return _remat_call(run, self, args, kwargs, policy=policy,
                               prevent_cse=prevent_cse)

        saved[cls] = cls.__dict__.get("__call__")
        cls.__call__ = functools.wraps(orig)(__call__)
    try:
        yield
    finally:
        for cls, orig in saved.items():
            if orig is None:
                del cls.__call__
            else:
                cls.__call__ = orig
