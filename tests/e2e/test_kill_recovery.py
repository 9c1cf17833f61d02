"""A pipeline killed at random recovers exactly: benchmarks/bench_kill.py on the tests' tiny
world, with three SIGKILLs at seeded random moments of the stages that keep the most state across
an interruption - download (a persistent output it resumes into), train (checkpoints and the
MLflow run it continues) and register (the registry and the gate) - then `dvc repro` to the end.
The benchmark's own run kills every stage (benchmarks/RESULTS.md, "Kill recovery").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.dvc_workspace import PROJECT_ROOT, tool_env

pytestmark = pytest.mark.slow


@pytest.mark.timeout(5400)  # two whole pipelines and four more repros: 15+ min under load
def test_dvc_repro_killed_in_download_train_and_register_recovers_exactly(tmp_path) -> None:
    out = tmp_path / "kill.json"
    proc = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "benchmarks" / "bench_kill.py"), "--seed", "1",
         "--extra-kills", "0", "--stages", "download", "train", "register",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        env=tool_env(), capture_output=True, text=True, timeout=5400)
    result = json.loads(out.read_text())["results"]  # benchmarks/record.py's envelope
    checks = result["checks"]
    assert result["passed"], (proc.stdout[-3000:], proc.stderr[-3000:], checks)
    assert [k["planned"]["stage"] for k in result["kills"]] == ["download", "train", "register"]
    assert len(result["stages_killed"]) >= 2, result["kills"]  # a kill may land a stage later
    assert checks["eval_json_equal"] and checks["eval_json_keys"] > 10
    assert checks["dvc_status"] == {} and checks["temp_files"] == []
    assert "RUNNING" not in checks["mlflow_runs"] and checks["aliases_on_complete_versions"]
    assert proc.returncode == 0
    assert Path(tmp_path / "work" / "killed" / "metrics" / "eval.json").exists()
