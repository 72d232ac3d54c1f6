"""What is live at XLA's peak: one compile per variant, read from XLA's own dump.

XLA (CPU and GPU, with or without the device) writes ``*-live-range.txt`` beside the
optimised HLO when ``--xla_dump_to`` is set: the run order, every buffer's live range and the
live set at the peak. ``memory_analysis()`` gives the *allocated* sizes (the temporaries'
heap, packed); this gives what is live at the peak, so the two together say whether a
variant's peak is values kept or the heap's packing. Each variant is compiled in its own
process (the dump flag is read when the backend starts), for the same arguments and
donation as the benchmarks.

Variants: ``plain`` (jax.jit), ``dots`` / ``nothing`` (the whole loss under
``jax.checkpoint(policy=...)``, external models), ``auto`` (what ``jaxmem.optimize`` runs),
or the name of one of the automatic mode's candidates (``"blocks(depth=0, heavy kept)"``,
:func:`jaxmem.planning.strategies.auto_candidates`).

Run:  python -m benchmarks.live_range --model ext:hf_resnet --size bench --target h100 \\
          --variants "plain,dots,auto,blocks(depth=0, heavy kept)"
(``ext:`` names are benchmarks/external models, others the zoo's.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def live_at_peak(path: Path) -> dict:
    """The peak of one ``*-live-range.txt``: its bytes and the largest values live there."""
    text = path.read_text()
    sec = text[text.index("(peak):"):text.index("Stack trace breakdown")]
    rows = [(name, int(b)) for name, b in re.findall(r"^\s+(\S+): (\d+) bytes", sec, re.M)]
    rows.sort(key=lambda r: -r[1])
    return {"live_bytes": sum(b for _, b in rows), "values": len(rows), "largest": rows[:12]}


def _child(model: str, size: str, target: str, variant: str) -> dict:
    import dataclasses

    import jax

    import jaxmem
    from jaxmem import measure
    from jaxmem.planning import strategies
    from jaxmem.rewriting.rewrite import apply

    if model.startswith("ext:"):
        from benchmarks.external import models
        w = models.make(model[4:], size)
        make_step, args = w.make_step, (w.state, w.batch)
    else:
        from benchmarks import zoo
        w = zoo.make(model, size=size)
        make_step, args = (lambda wrap=None: w.step), (w.state, w.batch)
    if target != "cpu":
        args = jaxmem.targets.place(args, target)
    flat = jax.tree_util.tree_leaves(args)
    policies = {"dots": jax.checkpoint_policies.dots_saveable,
                "nothing": jax.checkpoint_policies.nothing_saveable}
    if variant in ("plain", *policies):
        wrap = (lambda f: f) if variant == "plain" else (
            lambda f: jax.checkpoint(f, policy=policies[variant]))
        jitted = jax.jit(make_step(wrap), donate_argnums=(0,))
        exe = measure.compile(jitted.lower(*args))
    elif variant == "auto":
        opt = jaxmem.optimize(make_step(), donate_argnums=(0,))
        exe = opt.lower(*args).compile()
    else:
        opt = jaxmem.optimize(make_step(), donate_argnums=(0,), verify=False)
        entry = opt._prepare(args, {})[0]  # noqa: SLF001 - the analysis of the traced step
        cands = {p.strategy: p for p in strategies.auto_candidates(entry.analysis)}
        if variant not in cands:
            raise SystemExit(f"no candidate {variant!r}; the candidates: {sorted(cands)}")
        plan = dataclasses.replace(cands[variant], donated=entry.plan.donated)
        jitted = jax.jit(apply(entry.analysis.program, plan), donate_argnums=entry.donate_flat)
        exe = measure.compile(jitted.lower(*flat))
    m = exe.memory_analysis()
    return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
            "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes,
            "peak": (m.argument_size_in_bytes + m.output_size_in_bytes
                     + m.temp_size_in_bytes - m.alias_size_in_bytes)}


def measure_variant(model: str, size: str, target: str, variant: str) -> dict:
    """Compile one variant in a fresh process with XLA's dump on; its figures and peak."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={d}").strip())
        code = ("import json, sys; from benchmarks.live_range import _child; "
                "print(json.dumps(_child(*sys.argv[1:])))")
        r = subprocess.run([sys.executable, "-c", code, model, size, target, variant],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if r.returncode:
            raise RuntimeError(f"{variant}: {r.stderr.strip().splitlines()[-1:]}")
        fig = json.loads(r.stdout.strip().splitlines()[-1])
        # The step's module: the largest live-range file (small helper modules aside);
        # under "auto" the candidates are dumped too, and the winner is compiled last.
        files = list(Path(d).glob("*-live-range.txt"))
        if files:
            big = max(p.stat().st_size for p in files)
            steps = [p for p in files if p.stat().st_size > big / 10]
            pick = max(steps, key=lambda p: (p.stat().st_mtime_ns, p.name)) \
                if variant == "auto" else max(steps, key=lambda p: p.stat().st_size)
            fig.update(live_at_peak(pick))
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a zoo name, or ext:<external model>")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--target", default="cpu", help="cpu, or a jaxmem.targets name (h100)")
    ap.add_argument("--variants", default="plain,dots,auto")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here too")
    a = ap.parse_args(argv)
    out = {}
    mib = 2 ** 20
    for v in re.split(r",(?![^()]*\))", a.variants):  # commas inside a name's () stay
        f = out[v] = measure_variant(a.model, a.size, a.target, v)
        print(f"{v}: peak {f['peak'] / mib:.2f} MiB (temp {f['temp'] / mib:.2f} MiB); live at "
              f"XLA's peak {f.get('live_bytes', 0) / mib:.2f} MiB in {f.get('values', 0)} "
              "values; largest: " + ", ".join(f"{n} {b / mib:.2f}"
                                              for n, b in f.get("largest", [])[:5]))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"model": a.model, "size": a.size, "target": a.target,
                                     "variants": out}, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
