"""``python -m benchmarks.split_k``: XLA:GPU's split-K rewrite against the liveness model.

XLA:GPU splits the contraction of a matmul whose output has too few tiles for the device
(``SplitkRewriter``): both operands padded along it where needed, f32 partial products
summed (:func:`jaxmem.analyzing.fusion.split_k_bytes`). This compiles the three matmuls of a
language model's head (the logits ``h @ W.T``, the input gradient ``g @ W`` and the weight
gradient ``g.T @ h``, tokens ``M``, width ``N``, vocabulary ``K``) over a grid of shapes
and dtypes for a GPU target, compile only, and sets each compiled peak (``argument +
output + temp``) beside the liveness model's prediction of the same program, with the
split XLA chose (the leading dimension of the partial products in the compiled module)
beside :func:`~jaxmem.analyzing.fusion.split_k`'s. Results:
``benchmarks/results/split_k-<target>.{json,md}``::

    python -m benchmarks.split_k --target h100
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jaxmem.program import trace

from jaxmem.analyzing import fusion
from jaxmem.analyzing.liveness import liveness
from jaxmem.xla import measure, targets

OUT = Path("benchmarks/results")
TOKENS = (256, 1024, 4096)
WIDTHS = (512, 768, 2048)
VOCABS = (30000, 50257)
DTYPES = ("float32", "bfloat16")

_MATMULS = {  # name -> (function, operand shapes from (M, N, K), GEMM (m, n, k))
    "logits": (lambda h, w: h @ w.T, lambda m, n, k: ((m, n), (k, n)), lambda m, n, k: (m, k, n)),
    "dx": (lambda g, w: g @ w, lambda m, n, k: ((m, k), (k, n)), lambda m, n, k: (m, n, k)),
    "dW": (lambda g, h: g.T @ h, lambda m, n, k: ((m, k), (m, n)), lambda m, n, k: (k, n, m)),
}


def _split_in(text: str, shape: tuple[int, int]) -> int:
    """The split XLA chose: the leading dimension of an f32 ``[s, *shape]`` in the module
    (the partial products), 1 if there is none."""
    dims = ",".join(map(str, shape))
    got = re.findall(rf"f32\[(\d+),{dims}\]", text)
    return int(got[0]) if got else 1


def row(target: Any, matmul: str, m: int, n: int, k: int, dtype: str) -> dict[str, Any]:
    f, shapes, gemm = _MATMULS[matmul]
    args = targets.place(tuple(jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
                               for s in shapes(m, n, k)), target)
    compiled = measure.compile(jax.jit(f).lower(*args))
    peak = measure.figures(compiled).peak
    predicted = liveness(trace(f, *args), platform=target.platform)[0]
    gm, gn, gk = gemm(m, n, k)
    bits = 8 * jnp.dtype(dtype).itemsize
    return {"matmul": matmul, "M": m, "N": n, "K": k, "dtype": dtype,
            "split_compiled": _split_in(compiled.as_text(), (gm, gn)),
            "split_model": fusion.split_k(1, gm, gn, gk, bits, bits, bits, target.platform),
            "compiled": int(peak), "predicted": int(predicted),
            "error_pct": round(100.0 * (predicted / peak - 1.0), 3)}


def markdown(command: str, rows: list[dict[str, Any]]) -> str:
    same = sum(r["split_compiled"] == r["split_model"] for r in rows)
    exact = sum(abs(r["compiled"] - r["predicted"]) <= 16 for r in rows)
    out = [f"`{command}`", "",
           f"{len(rows)} matmuls: the split agrees on {same}; the predicted peak is the "
           f"compiled one to 16 bytes on {exact}, largest error "
           f"{max(abs(r['error_pct']) for r in rows):.3f}%. (Where a padded matmul's result "
           "is the program's output it cannot take the pads' buffer, as it does inside a "
           "step: the model is low by the result's bytes.)", "",
           "| matmul | M | N | K | dtype | split: compiled | model | compiled MiB | "
           "predicted MiB | error |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    out += [f"| {r['matmul']} | {r['M']} | {r['N']} | {r['K']} | {r['dtype']} | "
            f"{r['split_compiled']} | {r['split_model']} | {r['compiled'] / 2**20:.2f} | "
            f"{r['predicted'] / 2**20:.2f} | {r['error_pct']:+.3f}% |" for r in rows]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.split_k",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h100", help="a GPU target of jaxmem.targets")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    target = targets.require(a.target)
    rows = []
    for matmul, m, n, k, dtype in itertools.product(_MATMULS, TOKENS, WIDTHS, VOCABS, DTYPES):
        r = row(target, matmul, m, n, k, dtype)
        print(" ".join(f"{v}" for v in r.values()), flush=True)
        rows.append(r)
    command = "python -m benchmarks.split_k " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"split_k-{a.target}.json").write_text(
        json.dumps({"command": command, "rows": rows}, indent=1))
    (a.out / f"split_k-{a.target}.md").write_text(markdown(command, rows))
    print(markdown(command, rows).split("\n\n")[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
