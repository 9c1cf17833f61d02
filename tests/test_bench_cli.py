"""`clipms-bench` as a package (clipms/bench/: one module per subcommand family): the console
script's target and `python -m clipms.bench` both reach every subcommand, and importing it loads
no MindSpore (benchmarks/openclip_peer.py imports its inputs and timer in a venv without it)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib

from tests.workspace import PROJECT_ROOT

SUBCOMMANDS = {"encode", "forward", "retrieval", "loader", "train"}


def test_the_console_script_and_python_m_reach_every_subcommand():
    target = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["scripts"][
        "clipms-bench"]
    module, _, name = target.partition(":")
    bench = importlib.import_module(module)
    assert getattr(bench, name) is bench.main and set(bench.SUBCOMMANDS) == SUBCOMMANDS
    for command in sorted(SUBCOMMANDS):
        out = subprocess.run([sys.executable, "-m", "clipms.bench", command, "--help"],
                             cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
        assert out.stdout.startswith(f"usage: clipms-bench {command}"), out.stdout


def test_importing_the_benchmarks_loads_no_mindspore():
    code = ("import sys; from clipms.bench import random_images, random_tokens, time_steps; "
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"
