"""`python -m ops.preflight --smoke`: the smoke plan per device and the checks' verdicts as
data (a stale graph, a NaN, device figures beside the host's), and the whole smoke run on this
machine's CPU, with the keyed compile cache on."""

from __future__ import annotations

import json

import pytest
import yaml

from harness.dvc_workspace import PROJECT_ROOT, run, tool_env
from ops import preflight, smoke
from ops.checks import FAIL, OK
from pipeline.params import read_params


def plan_of(overrides: dict) -> smoke.SmokePlan:
    params = preflight.apply_overrides(read_params(PROJECT_ROOT / "params.yaml"), overrides)
    return smoke.smoke_plan(params, preflight.model_config(params))


def test_the_smoke_runs_the_profiles_model_on_a_device_and_a_small_one_on_cpu():
    profile = yaml.safe_load((PROJECT_ROOT / "profiles" / "vit-b-32-1npu.yaml").read_text())
    npu = plan_of(profile)
    assert (npu.device, npu.batch_size, npu.lr) == ("Ascend", 256, 2e-4)
    assert npu.model["vision"]["width"] == 768 and npu.model["text"]["vocab_size"] == 49408
    cpu = plan_of({**profile, "runtime.device_target": "CPU"})
    assert (cpu.device, cpu.batch_size) == ("CPU", smoke.CPU_BATCH)
    assert cpu.model["vision"]["width"] == 128  # the mini preset, with the run's vocabulary
    assert (cpu.model["text"]["vocab_size"], cpu.model["text"]["context_length"]) == (49408, 77)


def test_a_run_that_trained_with_another_runs_graph_fails_the_lr_check():
    trained = [2.55, 2.55, 2.1, 1.6]
    assert smoke.check_lr(trained, [2.55] * 4, 1e-3).status == OK
    stale = smoke.check_lr(trained, list(trained), 1e-3)  # lr 0 asked, the lr-1e-3 graph ran
    assert stale.status == FAIL and "stale compiled graph" in stale.detail
    assert smoke.check_lr(trained, [2.9] * 4, 1e-3).status == FAIL  # another start: not the same


def test_the_loss_check_wants_finite_and_falling():
    plan = plan_of({})
    assert smoke.check_loss([2.5, 2.5, 1.9], plan).status == OK
    assert smoke.check_loss([2.5, float("nan"), 1.9], plan).status == FAIL
    assert smoke.check_loss([2.5, 2.4, 2.6], plan).status == FAIL


def test_the_parity_line_shows_the_device_figures_beside_the_host_gate():
    from clipms.deploy.hostparity import gate_on_host

    here = {"image_max_abs_error": 3e-4, "text_max_abs_error": 2e-4, "passed": False,
            "gate_metric": "max_abs_error", "tolerance": 1e-5}
    host = {**here, "image_max_abs_error": 0.0, "text_max_abs_error": 0.0, "passed": True,
            "parity_device": "CPU (host)"}
    report = gate_on_host(here, "Ascend", lambda: host)
    assert report["passed"] and report["device_image_max_abs_error"] == 3e-4
    line = smoke.check_parity(report)
    assert line.status == OK and "on Ascend itself: image 3.0e-04" in line.detail
    on_cpu = gate_on_host(here, "CPU", lambda: pytest.fail("no host process on CPU"))
    assert on_cpu["parity_device"] == "CPU (host)" and not on_cpu["passed"]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # three compiles: ~2 CPU-minutes, far more wall time on a busy host
def test_the_smoke_run_trains_twice_and_exports_on_this_cpu(tmp_path):
    scratch = tmp_path / "tmp"  # where the smoke's temporary folder goes (TMPDIR)
    scratch.mkdir()
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT), "CLIPMS_KERNEL_CACHE": str(tmp_path),
           "TMPDIR": str(scratch)}
    proc = run(["python", "-m", "ops.preflight", "--params",
                str(PROJECT_ROOT / "params.yaml"), "--manifest", str(tmp_path / "none.json"),
                "--smoke", "--json", "-S", "runtime.compile_cache=true"],
               cwd=tmp_path, env=env, check=False, timeout=2400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout.strip().splitlines()[-1])["checks"]}
    for name in ("smoke: loss", "smoke: lr reaches the graph", "smoke: export parity"):
        assert checks[name]["status"] == OK, checks[name]
    assert "(bar 1e-05, CPU (host))" in checks["smoke: export parity"]["detail"]
    assert len(list((tmp_path / "graphs").iterdir())) == 2  # one keyed folder per lr
    assert not list(scratch.glob("clipms-smoke-*"))  # its runs and bundle removed afterwards
