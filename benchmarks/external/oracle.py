"""``python -m benchmarks.external.oracle NAME [--verify 0|1]``: a corpus entry, op by op.

Step 2 of docs/testing.md for one entry of :mod:`benchmarks.external.corpus` at the
``test`` size on CPU: the step ``jaxmem.optimize`` runs and the user's step, each evaluated
one primitive at a time (:mod:`tests.difftest.oracle`), compared bit for bit on every
output. Planned without donation (the oracle reuses the arguments); ``--verify 0`` forces
the rewrite's own ``auto`` plan, ``1`` (default) takes what ``verify`` chooses;
``--no-substitute`` plans without the lean equivalents of
:mod:`jaxmem.rewriting.substitutes` (to tell a substitute's rounding from the rest).
Prints the outputs that differ op by op, with their scale and largest difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxmem  # noqa: E402
from benchmarks.external import corpus  # noqa: E402
from tests.difftest import oracle  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--verify", default="1", choices=("0", "1"))
    ap.add_argument("--no-substitute", action="store_true",
                    help="rewrite without jaxmem.rewriting.substitutes")
    a = ap.parse_args(argv)
    if a.no_substitute:
        from jaxmem.rewriting import rewrite
        rewrite.substitute_for = lambda eqn: None
    e = corpus.make(a.name, "test")
    step, args = e.make_step(), (e.state, e.batch)
    opt = jaxmem.optimize(step, donate_argnums=(), verify=a.verify == "1")
    print(f"{a.name}: plan {opt.plan(*args).strategy!r}")
    flat = jax.tree_util.tree_leaves(args)
    ref = oracle.evaluate(jax.make_jaxpr(step)(*args), *flat)
    got = oracle.evaluate(opt.trace(*args).jaxpr, *flat)
    paths = jax.tree_util.tree_flatten_with_path(jax.eval_shape(step, *args))[0]
    differ = 0
    for (path, _), r, g in zip(paths, ref, got, strict=True):
        if oracle.bitwise(np.asarray(r), np.asarray(g)):
            continue
        differ += 1
        r64, g64 = np.asarray(r, np.float64), np.asarray(g, np.float64)
        scale = float(np.max(np.abs(r64))) if r64.size else 0.0
        print(f"  {jax.tree_util.keystr(path)} {r64.shape}: scale {scale:.3g}, "
              f"largest difference {float(np.max(np.abs(r64 - g64))):.3g}")
    print(f"{differ} of {len(ref)} outputs differ op by op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
