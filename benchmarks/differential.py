"""The long differential run: generated train steps, ``jaxmem.optimize`` against ``jax.jit``.

Seeds from ``--start`` upwards are generated (:mod:`tests.difftest.generator`), packed
``--pack-size`` to a step (every fifth pack is a single case, so whole-step properties such
as "no backward pass" are hit too) and checked (:mod:`tests.difftest.check`) under every
strategy (``--all-strategies``) or one per pack in rotation. Stops after ``--count`` steps
or ``--seconds``; the JSON summary (``--out``) is rewritten after every pack, so a run that
is stopped keeps what it did.

    nice -n 10 python -m benchmarks.differential --seconds 3600 --out
        benchmarks/results/differential.json

``--resume`` continues a stopped run (``--out`` is its summary) up to ``--count`` steps in
all, if the code (:func:`code_fingerprint`: jaxmem/, the generator and check, jax) and the
options are the same; each invocation is a segment in the summary. So a run longer than
one sitting is still one run of one program.

``--target h100`` compiles every variant for a compile-only target instead (abstract
arguments placed on it, :mod:`jaxmem.targets`): nothing runs, so only the memory promises
are checked there (budgets met or ``BudgetError``, peaks never above plain jit's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.difftest.check import OBSERVED, ROUNDING, STRATEGIES, TARGET_STRATEGIES  # noqa: E402
from tests.difftest.generator import generate  # noqa: E402
from tests.difftest.runner import run_pack  # noqa: E402

#: XLA:CPU's LLVM back end at -O0 halves the compile time, but it is not a trusted reference
#: for values: on seeds 1000118-1000124 packed together, plain ``jax.jit`` compiled with it
#: returns -inf and NaN gradients where the default optimisation level (and jaxmem's
#: rewrite, at -O0 too) returns finite ones. A value mismatch seen under it is confirmed by
#: re-checking that pack without it, in a fresh process.
O0 = "--xla_backend_optimization_level=0"


def confirmed(seeds: list[int], strategy: str, a: argparse.Namespace) -> list[dict]:
    """The findings of one pack re-checked without :data:`O0`: those that reproduce."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(O0, ""))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "confirm.json"
        cmd = [sys.executable, "-m", "benchmarks.differential", "--start", str(seeds[0]),
               "--count", str(len(seeds)), "--pack-size", str(len(seeds)), "--max-ops",
               str(a.max_ops), "--strategies", strategy, "--max-compiles",
               str(a.max_compiles), "--out", str(out)]
        subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parent.parent,
                       capture_output=True, timeout=3600)
        if not out.exists():
            return [{"seeds": seeds, "strategy": strategy, "kind": "error",
                     "detail": "the confirming run without -O0 wrote nothing"}]
        return json.loads(out.read_text())["failures"]


#: Options a resumed run must share with the run it continues (the rest say how long).
_SAME = ("start", "pack_size", "max_ops", "all_strategies", "strategies", "target",
         "max_compiles")


def code_fingerprint() -> str:
    """What a run checked: a hash of jaxmem/, the generator and check, this script, and
    the jax and jaxlib versions (a resumed run must be on the same)."""
    import jax
    import jaxlib

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__}".encode())
    for f in sorted([*root.glob("jaxmem/**/*.py"), *root.glob("tests/difftest/*.py"),
                     Path(__file__).resolve()]):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _resumable(out: Path, a: argparse.Namespace) -> dict:
    """The summary ``out`` holds, if this run may continue it (else SystemExit 2 saying
    why): a run is one program checked, so a change of code or options starts a new one."""
    if not out.exists():
        raise SystemExit(f"--resume: {out} does not exist; start the run without --resume")
    prev = json.loads(out.read_text())
    if "segments" not in prev:
        raise SystemExit(f"--resume: {out} was written before runs could be resumed")
    code = prev["segments"][-1]["code"]
    if code != code_fingerprint():
        raise SystemExit(f"--resume: {out} was checked on code {code}, this checkout is "
                         f"{code_fingerprint()} (jaxmem/, tests/difftest/ or jax changed): "
                         "start a new run")
    for k in _SAME:
        if prev["args"].get(k) != getattr(a, k):
            raise SystemExit(f"--resume: --{k.replace('_', '-')} was "
                             f"{prev['args'].get(k)!r} in {out}, not {getattr(a, k)!r}")
    return prev


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10_000, help="generated steps to check")
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long")
    ap.add_argument("--start", type=int, default=100_000, help="first seed")
    ap.add_argument("--pack-size", type=int, default=10)
    ap.add_argument("--max-ops", type=int, default=6)
    ap.add_argument("--all-strategies", action="store_true")
    ap.add_argument("--strategies", default=None,
                    help="comma-separated subset of " + ",".join(STRATEGIES)
                    + " (with --target: of " + ",".join(TARGET_STRATEGIES) + ")")
    ap.add_argument("--target", default=None,
                    help="compile for this jaxmem.targets target (e.g. h100) from abstract "
                         "arguments: memory promises only (budgets, peaks), nothing runs")
    ap.add_argument("--max-compiles", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results/differential.json")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run whose summary is --out (same code, same options; "
                         "--count is the total)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    seed, steps, checks, packs = a.start, 0, Counter(), 0
    failures: list[dict] = []
    unconfirmed: list[dict] = []
    families: Counter = Counter()
    before, segments = 0.0, []
    if a.resume:
        prev = _resumable(Path(a.out), a)
        seed, steps, packs = prev["seeds"][1] + 1, prev["steps"], prev["packs"]
        checks.update(prev["checks_per_strategy"])
        failures, unconfirmed = prev["failures"], prev["o0_only_mismatches"]
        families.update(prev["ops_per_family"])
        OBSERVED.update(prev["observed"])
        ROUNDING.extend(prev["rounding_only"])
        before, segments = prev["seconds"], prev["segments"]
    segments.append({"code": code_fingerprint(), "first_seed": seed, "from_step": steps})
    while steps < a.count and (a.seconds is None or time.perf_counter() - t0 < a.seconds):
        size = 1 if packs % 5 == 4 else a.pack_size
        cases = [generate(s, max_ops=a.max_ops) for s in range(seed, seed + size)]
        strategies = (a.strategies.split(",") if a.strategies
                      else list(TARGET_STRATEGIES if a.target else STRATEGIES))
        chosen = strategies if a.all_strategies else [strategies[packs % len(strategies)]]
        for r in run_pack(cases, chosen, max_compiles=a.max_compiles, target=a.target):
            checks[r.strategy] += len(cases)
            found = [{"seeds": r.seeds, "strategy": f.strategy, "kind": f.kind,
                      "detail": f.detail} for f in r.findings]
            if (any(f["kind"] == "mismatch" for f in found)
                    and O0 in os.environ.get("XLA_FLAGS", "")):
                unconfirmed.extend(f for f in found if f["kind"] == "mismatch")
                found = [f for f in found if f["kind"] != "mismatch"] + [
                    f for f in confirmed(r.seeds, r.strategy, a) if f["kind"] == "mismatch"]
            for f in found:
                failures.append(f)
                print(f"FAIL seeds {r.seeds[0]}..{r.seeds[-1]}: [{f['kind']}] "
                      f"{f['strategy']}: {f['detail']}", flush=True)
        for c in cases:
            families.update(op.family for op in c.ops)
        seed += size
        steps += size
        packs += 1
        summary = {
            "steps": steps, "packs": packs, "seeds": [a.start, seed - 1],
            "seconds": round(before + time.perf_counter() - t0, 1),
            "checks_per_strategy": checks, "segments": segments,
            "mismatches": sum(f["kind"] in ("mismatch", "structure") for f in failures),
            "budget_violations": sum(f["kind"] == "budget" for f in failures),
            "peak_above_plain": sum(f["kind"] == "peak" for f in failures),
            "errors": sum(f["kind"] == "error" for f in failures),
            "target": a.target or "cpu", "observed": OBSERVED,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "failures": failures,
            "rounding_only": ROUNDING[:200],
            "o0_only_mismatches": unconfirmed[:50], "ops_per_family": dict(families.most_common()),
            "args": {k: v for k, v in vars(a).items() if k != "resume"}}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(summary, indent=1, default=dict))
        print(f"{steps} steps, {len(failures)} findings, {summary['seconds']} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
