"""``python -m jaxmem managed-memory``: printed recipe, conflicts, and the exec'd environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmem import managed_memory as mm
from jaxmem.__main__ import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    for k in mm.ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_print_env_is_a_shell_recipe(clean_env, capsys):
    assert main(["managed-memory", "--oversubscription", "1.5", "--print-env"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "export TF_FORCE_UNIFIED_MEMORY=1",
        "export XLA_CLIENT_MEM_FRACTION=1.5",
        "export XLA_PYTHON_CLIENT_PREALLOCATE=false",
    ]
    assert main(["managed-memory", "--preallocate"]) == 0  # no command: prints too
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=true" in capsys.readouterr().out


def test_conflicts_stop_the_command_unless_override(clean_env, capsys):
    clean_env.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert main(["managed-memory", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "nothing was run" in err and "below 1 it caps" in err and "--override" in err
    assert main(["managed-memory", "--override", "--print-env"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[0] == "unset XLA_PYTHON_CLIENT_MEM_FRACTION"
    assert "--override replaces" in out.err


def test_bad_ratio_and_no_subcommand(clean_env, capsys):
    assert main(["managed-memory", "--oversubscription", "0.5", "--print-env"]) == 2
    assert ">= 1" in capsys.readouterr().err
    assert main([]) == 2
    assert "managed-memory" in capsys.readouterr().out
    assert "managed-memory" in build_parser().format_help()


def test_exec_runs_the_command_with_what_the_xla_client_reads():
    env = {k: v for k, v in os.environ.items() if k not in mm.ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    child = (
        "import json, os; from jaxlib import xla_client; "
        "o = xla_client.generate_pjrt_gpu_plugin_options(); "
        "print(json.dumps([o, os.environ.get('TF_FORCE_UNIFIED_MEMORY')]))"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "jaxmem", "managed-memory", "--oversubscription", "1.25",
         "--", sys.executable, "-c", child],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    opts, unified = json.loads(proc.stdout.strip().splitlines()[-1])
    assert opts["memory_fraction"] == 1.25 and opts["preallocate"] is False
    assert unified == "1"
