"""The generated API reference matches the docstrings (regenerate: python docs/gen_api.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_current():
    r = subprocess.run([sys.executable, "docs/gen_api.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:] + (
        "\ndocs/api.md is stale: run `python docs/gen_api.py > docs/api.md`")
