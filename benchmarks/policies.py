"""Benchmark: jaxmem's checkpoint policies against JAX's, on a scanned stack and a ResNet.

    python benchmarks/policies.py [--quick] [--out DIR]

Rows (compiled ``jit(value_and_grad(loss))``, CPU, barrier flag on, via
:func:`jaxmem.measure.measure`; peak = argument + output + temp - alias):

- a stack of pre-LN transformer blocks (attention, gelu MLP, dropout) stacked with
  ``nn.scan``: no remat, ``nn.remat`` with ``dots_saveable`` / ``nothing_saveable``,
  ``jaxmem.flax.linen.remat`` (``jaxmem.policies.utility``), and the same blocks in a
  ``lax.scan`` whose body is ``jaxmem.checkpoint``-ed;
- an unscanned linen ResNet (BatchNorm, relu, skip adds) with and without
  ``jaxmem.flax.linen.intercept(BasicBlock)``.

XLA counts a scan body once in ``cost_analysis()['flops']``; every scanned row has the same
trip count, so FLOPs are compared relative to the no-remat row of the same table. Writes
``policies.json`` to ``--out`` (default ``results/policies/``).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jaxmem.flax  # noqa: E402
from jaxmem import measure  # noqa: E402
from jaxmem.rewriting.remat import checkpoint  # noqa: E402

SIZES = {
    "test": dict(batch=8, seq=64, d_model=32, heads=4, layers=2,
                 img_batch=8, image=16, channels=(16, 32), blocks=2),
    "quick": dict(batch=4, seq=128, d_model=128, heads=4, layers=4,
                  img_batch=16, image=32, channels=(16, 32, 64), blocks=1),
    "full": dict(batch=8, seq=256, d_model=256, heads=4, layers=6,
                 img_batch=32, image=32, channels=(16, 32, 64), blocks=2),
}


# --- models --------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer block: ``x + drop(attn(LN x))``, ``x + drop(MLP(LN x))``."""

    d_model: int
    heads: int
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        hd = d // self.heads
        h = nn.LayerNorm(name="ln1")(x)
        qkv = nn.Dense(3 * d, name="qkv")(h).reshape(b, t, 3, self.heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(x.dtype)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
        w = nn.Dropout(self.dropout, deterministic=False)(jax.nn.softmax(s, axis=-1))
        a = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)
        x = x + nn.Dropout(self.dropout, deterministic=False)(nn.Dense(d, name="out")(a))
        h = nn.Dense(4 * d, name="fc")(nn.LayerNorm(name="ln2")(x))
        h = nn.Dense(d, name="proj")(nn.gelu(h))
        return x + nn.Dropout(self.dropout, deterministic=False)(h)


class ScanBlock(nn.Module):
    """:class:`Block` with the ``(carry, x) -> (carry, y)`` signature of ``nn.scan``."""

    d_model: int
    heads: int
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return Block(self.d_model, self.heads, self.dropout, name="block")(x), None


class Stack(nn.Module):
    """``layers`` :class:`Block` s in one ``nn.scan``; ``body`` wraps the scanned module."""

    d_model: int
    heads: int
    layers: int
    dropout: float = 0.1
    body: Callable[[type[nn.Module]], type[nn.Module]] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cls = ScanBlock if self.body is None else self.body(ScanBlock)
        scan = nn.scan(cls, variable_axes={"params": 0},
                       split_rngs={"params": True, "dropout": True}, length=self.layers)
        x, _ = scan(self.d_model, self.heads, self.dropout, name="layers")(x, None)
        return x


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-relu-conv-BN + (projected) skip, relu."""

    channels: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        bn = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        s = (self.strides, self.strides)
        y = nn.Conv(self.channels, (3, 3), s, use_bias=False)(x)
        y = nn.relu(bn()(y))
        y = nn.Conv(self.channels, (3, 3), use_bias=False)(y)
        y = bn()(y)
        if x.shape != y.shape:
            x = bn()(nn.Conv(self.channels, (1, 1), s, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """CIFAR-style ResNet of :class:`BasicBlock` s, global average pool, Dense head."""

    channels: tuple[int, ...]
    blocks: int
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(self.channels[0], (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for i, c in enumerate(self.channels):
            for j in range(self.blocks):
                x = BasicBlock(c, 2 if i and not j else 1)(x, train=train)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


# --- workloads -----------------------------------------------------------------------------


def stack_inputs(cfg: dict[str, Any]) -> tuple[Any, jax.Array, jax.Array]:
    """``(params, x, dropout_key)`` for the scanned stack (params stacked on a layer axis)."""
    x = jax.random.normal(jax.random.key(1), (cfg["batch"], cfg["seq"], cfg["d_model"]))
    model = Stack(cfg["d_model"], cfg["heads"], cfg["layers"])
    params = jax.jit(model.init)({"params": jax.random.key(0)}, x)["params"]
    return params, x, jax.random.key(2)


def stack_loss(cfg: dict[str, Any], body: Any = None) -> Callable[..., jax.Array]:
    """Loss of the ``nn.scan`` stack with scanned module transformed by ``body``."""
    model = Stack(cfg["d_model"], cfg["heads"], cfg["layers"], body=body)

    def loss(params: Any, x: jax.Array, key: jax.Array) -> jax.Array:
        y = model.apply({"params": params}, x, rngs={"dropout": key})
        return jnp.mean(y**2)

    return loss


def lax_scan_loss(cfg: dict[str, Any], wrap: Callable | None = None) -> Callable[..., jax.Array]:
    """The same blocks in a ``lax.scan`` whose body may be wrapped (``jaxmem.checkpoint``).

    Uses the ``nn.scan`` stack's parameters; per-layer dropout keys are ``split(key, L)``
    (not the bits ``nn.scan`` draws), so compare it with itself unwrapped.
    """
    block = Block(cfg["d_model"], cfg["heads"])

    def layer(p: Any, h: jax.Array, k: jax.Array) -> jax.Array:
        return block.apply({"params": p}, h, rngs={"dropout": k})

    body = layer if wrap is None else wrap(layer)

    def loss(params: Any, x: jax.Array, key: jax.Array) -> jax.Array:
        stacked = params["layers"]["block"]
        keys = jax.random.split(key, cfg["layers"])
        y, _ = jax.lax.scan(lambda h, pk: (body(pk[0], h, pk[1]), None), x, (stacked, keys))
        return jnp.mean(y**2)

    return loss


def resnet_inputs(cfg: dict[str, Any]) -> tuple[Any, Any, jax.Array]:
    """Shapes only (``jax.ShapeDtypeStruct``): the measurement compiles, it does not run."""
    x = jax.ShapeDtypeStruct((cfg["img_batch"], cfg["image"], cfg["image"], 3), jnp.float32)
    v = jax.eval_shape(ResNet(tuple(cfg["channels"]), cfg["blocks"]).init, jax.random.key(0), x)
    return v["params"], v["batch_stats"], x


def resnet_loss(cfg: dict[str, Any]) -> Callable[..., tuple[jax.Array, Any]]:
    model = ResNet(tuple(cfg["channels"]), cfg["blocks"])

    def loss(params: Any, batch_stats: Any, x: jax.Array) -> tuple[jax.Array, Any]:
        y, upd = model.apply({"params": params, "batch_stats": batch_stats}, x,
                             mutable=["batch_stats"])
        return jnp.mean(y**2), upd

    return loss


def _grad(loss: Callable, has_aux: bool = False) -> Callable:
    return jax.jit(jax.value_and_grad(loss, has_aux=has_aux))


def stack_rows(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    params, x, key = stack_inputs(cfg)

    def remat_with(policy: Any) -> Callable:
        return lambda cls: nn.remat(cls, policy=policy, prevent_cse=False)

    variants = [
        ("nn.scan, no remat", stack_loss(cfg)),
        ("nn.scan + nn.remat(dots_saveable)",
         stack_loss(cfg, remat_with(jax.checkpoint_policies.dots_saveable))),
        ("nn.scan + nn.remat(nothing_saveable)",
         stack_loss(cfg, remat_with(jax.checkpoint_policies.nothing_saveable))),
        ("nn.scan + jaxmem.flax.linen.remat",
         stack_loss(cfg, lambda cls: jaxmem.flax.linen.remat(cls, prevent_cse=False))),
        ("lax.scan, no remat", lax_scan_loss(cfg)),
        ("lax.scan + jaxmem.checkpoint(block)",
         lax_scan_loss(cfg, lambda f: checkpoint(f, prevent_cse=False))),
    ]
    rows = []
    for name, loss in variants:
        f = measure.measure(_grad(loss), params, x, key)
        rows.append(dict(model="scanned transformer stack", variant=name, peak=f.peak,
                         temp=f.temp, flops=f.flops, group=name.split(",")[0].split(" +")[0]))
    return rows


def resnet_rows(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    params, stats, x = resnet_inputs(cfg)
    loss = resnet_loss(cfg)
    base = measure.measure(_grad(loss, True), params, stats, x)
    with jaxmem.flax.linen.intercept(BasicBlock):
        wrapped = measure.measure(_grad(loss, True), params, stats, x)
    return [dict(model="linen ResNet (unscanned)", variant=name, peak=f.peak, temp=f.temp,
                 flops=f.flops, group="resnet")
            for name, f in (("no remat", base),
                            ("jaxmem.flax.linen.intercept(BasicBlock)", wrapped))]


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table; each row is compared with the first row of its ``group``."""
    out = ["| model | variant | peak | peak vs baseline | FLOPs vs baseline |",
           "|---|---|---|---|---|"]
    base: dict[str, dict[str, Any]] = {}
    for r in rows:
        b = base.setdefault(r["group"], r)
        out.append(f"| {r['model']} | {r['variant']} | {measure.fmt_bytes(r['peak'])} | "
                   f"{100 * (r['peak'] / b['peak'] - 1):+.1f}% | "
                   f"{100 * (r['flops'] / b['flops'] - 1):+.1f}% |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes (seconds)")
    ap.add_argument("--size", choices=sorted(SIZES), default=None)
    ap.add_argument("--out", default="results/policies", help="directory for policies.json")
    a = ap.parse_args(argv)
    size = a.size or ("quick" if a.quick else "full")
    cfg = SIZES[size]
    t0 = time.perf_counter()
    rows = stack_rows(cfg) + resnet_rows(cfg)
    print(f"jaxmem policies benchmark, size={size!r}, jax {jax.__version__}, "
          f"{jax.default_backend()} (FLOPs: XLA counts a scan body once; same trip count "
          "in every scanned row)")
    print(table(rows))
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policies.json").write_text(json.dumps(
        dict(size=size, config=cfg, jax=jax.__version__, backend=jax.default_backend(),
             seconds=round(time.perf_counter() - t0, 1), rows=rows), indent=2, default=str))
    print(f"wrote {out / 'policies.json'} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
