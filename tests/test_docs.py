"""The README and docs/ say what the code and the benchmark JSON say.

- docs/api.md matches the docstrings (regenerate: ``python docs/gen_api.py > docs/api.md``);
- every results table of README.md and docs/*.md is the output of the command in the comment
  above it, rendered from its JSON (regenerate: ``python -m benchmarks table --docs``), and
  the README holds no other table;
- the README's set-up commands are the ones CI runs, its ten-line example runs, and every
  relative link and file path of the README and docs/ points to a file that exists.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import readme_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

#: Where each results table lives, by the command that renders it (a table that moves must
#: move here too; one that disappears fails the test).
EXPECTED = {
    "README.md": [
        "python -m benchmarks table benchmarks/results/external/corpus-h100-bench.json "
        "--summary",
    ],
    "docs/results.md": [
        "python -m benchmarks table benchmarks/results/bench_h100/results.json --summary",
        "python -m benchmarks table benchmarks/results/bench_cpu/results.json --summary",
        "python -m benchmarks table benchmarks/results/bench_v5e/results.json --summary",
        "python -m benchmarks table benchmarks/results/maxbatch_h100/maxbatch.json",
        "python -m benchmarks table benchmarks/results/maxbatch/maxbatch.json",
    ],
    "docs/external.md": [
        "python -m benchmarks table benchmarks/results/external/h100-bench.json",
        "python -m benchmarks table benchmarks/results/external/cpu-bench.json",
        "python -m benchmarks table benchmarks/results/external/corpus-h100-test.json",
        "python -m benchmarks table benchmarks/results/external/corpus-h100-bench.json",
        "python -m benchmarks table benchmarks/results/external/corpus-cpu-test.json",
    ],
}


def test_api_reference_is_current():
    r = subprocess.run([sys.executable, "docs/gen_api.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:] + (
        "\ndocs/api.md is stale: run `python docs/gen_api.py > docs/api.md`")


def test_readme_and_docs_tables_match_their_json():
    files = readme_table.doc_files(ROOT)
    assert README in files and set(DOCS) <= set(files)
    stale = readme_table.stale(files)
    assert not stale, ("tables that differ from their JSON (run `python -m benchmarks table "
                       "--docs`):\n" + "\n".join(stale))


def test_readme_and_docs_tables_are_where_they_belong():
    for name, commands in EXPECTED.items():
        found = [cmd for cmd, _ in readme_table.blocks((ROOT / name).read_text())]
        tables = [c for c in found if "--provenance" not in c]
        assert tables == commands, name
    # every results JSON a docs table is rendered from has its provenance on results.md
    results = [c for c, _ in readme_table.blocks((ROOT / "docs/results.md").read_text())]
    for cmd in EXPECTED["docs/results.md"]:
        path = cmd.split()[4]
        assert f"{readme_table.PROG} {path} --provenance" in results, path


def test_readme_tables_are_all_generated():
    """No figure in a README table is typed by hand: every table row is in a generated block."""
    text = README.read_text()
    outside = readme_table.BLOCK.sub("", text)
    rows = [line for line in outside.splitlines() if line.lstrip().startswith("|")]
    assert not rows, rows
    assert len(readme_table.blocks(text)) == 1


def test_readme_is_a_front_door():
    """Short, with the set-up commands CI and the tests run, byte for byte."""
    text = README.read_text()
    assert len(text.splitlines()) < 150
    lines = text.splitlines()
    assert 'pip install -e ".[examples]" && python examples/demo.py' in lines
    assert 'pip install -e ".[test]" && python -m pytest -x -q' in lines
    assert "python -m pytest -x -q" in (ROOT / ".ci/run").read_text().splitlines()
    # each figure under the table names the command that measured it and its JSON
    assert "python -m benchmarks.external --set corpus --target h100" in text
    assert "benchmarks/results/external/corpus-h100-bench.json" in text


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PATH = re.compile(r"`((?:benchmarks|docs|examples|jaxmem|tests)/[\w./-]+)`")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_readme_and_docs_links_point_to_files(page):
    text = page.read_text()
    missing = []
    for m in _LINK.finditer(text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        if not (page.parent / target).exists():
            missing.append(m.group(1))
    for m in _PATH.finditer(text):
        if "SEED" not in m.group(1) and not (ROOT / m.group(1)).exists():
            missing.append(m.group(1))
    assert not missing, missing


def _readme_example() -> str:
    section = README.read_text().split("## Ten lines", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


# What the ten lines leave to the reader: a model, its loss, an optimizer, a batch.
_PRELUDE = """
import jax, jax.numpy as jnp, optax

def loss_fn(params, x, y):
    h = x
    for w in params[:-1]:
        h = jax.nn.gelu(h @ w)
    return jnp.mean((h @ params[-1] - y) ** 2)

ks = jax.random.split(jax.random.key(0), 5)
params = [jax.random.normal(k, (32, 32)) / 6 for k in ks[:4]]
tx = optax.sgd(0.1)
state = (params, tx.init(params))
x = jax.random.normal(ks[4], (64, 32))
y = jnp.ones((64, 32))
"""


def test_readme_ten_lines_run(capsys):
    """The README's example runs as written and gives ``jax.jit``'s loss and update."""
    import jax
    import numpy as np

    ns: dict = {}
    exec(compile(_PRELUDE, "<prelude>", "exec"), ns)
    tx, loss_fn = ns["tx"], ns["loss_fn"]

    def reference(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        import optax
        return (optax.apply_updates(params, updates), opt_state), loss

    (want_params, _), want_loss = jax.jit(reference)(ns["state"], ns["x"], ns["y"])
    exec(compile(_readme_example(), "README.md", "exec"), ns)
    assert "jaxmem.Plan" in capsys.readouterr().out
    np.testing.assert_allclose(ns["loss"], want_loss, rtol=1e-5)
    for got, want in zip(ns["state"][0], want_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
