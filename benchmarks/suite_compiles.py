"""Where the test suite's time goes: every XLA compile of a pytest run, logged and summed.

A pytest plugin and its report. The suite is mostly compile time (issue 37's "under 10
minutes on 2 cores"); this says how much, which tests pay it, and how much of it compiles
a program the same process had already compiled (what a shared memo could save).

Usage::

    JAXMEM_COMPILE_LOG=/tmp/compiles python -m pytest -x -q -p benchmarks.suite_compiles
    python -m benchmarks.suite_compiles /tmp/compiles [--top 20]

The plugin wraps ``jax._src.compiler.compile_or_get_cached`` (every compile JAX makes in a
test process, ``jax.jit`` calls and eager operations included; the tests' subprocesses are
not counted) and appends one JSON line per compile to ``<dir>/<pid>.jsonl``: a key of the
program (its MLIR text, the compile options and the devices), the seconds, and the test
being run. Without ``JAXMEM_COMPILE_LOG`` the plugin does nothing.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

_CURRENT: dict[str, str | None] = {"test": None}


def pytest_configure(config: Any) -> None:  # noqa: ARG001 - pytest's hook signature
    out_dir = os.environ.get("JAXMEM_COMPILE_LOG")
    if not out_dir:
        return
    import jax._src.compiler as compiler

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    out = open(Path(out_dir) / f"{os.getpid()}.jsonl", "a")  # noqa: SIM115 - the process's
    real = compiler.compile_or_get_cached

    def logged(backend: Any, computation: Any, devices: Any, compile_options: Any,
               *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        exe = real(backend, computation, devices, compile_options, *args, **kwargs)
        seconds = time.perf_counter() - t
        key = hashlib.sha256(str(computation).encode())
        key.update(compile_options.SerializeAsString())
        key.update(repr([str(d) for d in devices.flatten()]).encode())
        out.write(json.dumps({"key": key.hexdigest()[:16], "seconds": seconds,
                              "test": _CURRENT["test"]}) + "\n")
        out.flush()
        return exe

    compiler.compile_or_get_cached = logged


def pytest_runtest_setup(item: Any) -> None:
    _CURRENT["test"] = item.nodeid


def summary(rows: list[dict[str, Any]], top: int = 15) -> str:
    """The report: compiles, distinct programs, seconds, repeats (within a test module and
    across modules of one process), the heaviest tests and the seconds by compile length."""
    total = sum(r["seconds"] for r in rows)
    by_key: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        by_key[r["key"]].append(r)
    within = across = 0.0
    for same in by_key.values():
        seen: set[str] = set()
        for r in same:
            module = (r["test"] or "?").split("::")[0]
            if module in seen:
                within += r["seconds"]
            elif seen:
                across += r["seconds"]
            seen.add(module)
    lines = [f"{len(rows)} compiles, {len(by_key)} distinct programs, {total:.0f} s; "
             f"compiled again in the same process: {within:.0f} s within a test module, "
             f"{across:.0f} s across modules", "", "| compile length | compiles | s |",
             "|---|---:|---:|"]
    for lo, hi in ((0, 0.5), (0.5, 2), (2, 5), (5, 10), (10, float("inf"))):
        sel = [r["seconds"] for r in rows if lo <= r["seconds"] < hi]
        lines.append(f"| {lo}-{hi} s | {len(sel)} | {sum(sel):.0f} |")
    by_test: dict[str, list[float]] = collections.defaultdict(list)
    for r in rows:
        by_test[r["test"] or "?"].append(r["seconds"])
    lines += ["", "| test | compiles | s | longest s |", "|---|---:|---:|---:|"]
    for test, secs in sorted(by_test.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| `{test}` | {len(secs)} | {sum(secs):.1f} | {max(secs):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log_dir", help="the JAXMEM_COMPILE_LOG directory of a pytest run")
    ap.add_argument("--top", type=int, default=15, help="the heaviest tests to list")
    a = ap.parse_args(argv)
    rows = [json.loads(line) for f in sorted(glob.glob(str(Path(a.log_dir) / "*.jsonl")))
            for line in Path(f).read_text().splitlines()]
    if not rows:
        raise SystemExit(f"no compiles logged under {a.log_dir}: run pytest with "
                         "JAXMEM_COMPILE_LOG set and -p benchmarks.suite_compiles")
    print(summary(rows, a.top))


if __name__ == "__main__":
    main()
