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
    """With 2 ranks asked for, the data-parallel check runs too (2 msrun workers), with the
    default params: fused kernels for the single process, unfused ranks (with CPU kernel fusion
    the ranks' collectives fell out of step: clipms.runtime.for_data_parallel)."""
    scratch = tmp_path / "tmp"  # where the smoke's temporary folder goes (TMPDIR)
    scratch.mkdir()
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT), "CLIPMS_KERNEL_CACHE": str(tmp_path),
           "TMPDIR": str(scratch)}
    proc = run(["python", "-m", "ops.preflight", "--params",
                str(PROJECT_ROOT / "params.yaml"), "--manifest", str(tmp_path / "none.json"),
                "--smoke", "--json", "-S", "runtime.compile_cache=true",
                "-S", "train.distributed.workers=2"],
               cwd=tmp_path, env=env, check=False, timeout=2400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout.strip().splitlines()[-1])["checks"]}
    for name in ("smoke: loss", "smoke: lr reaches the graph", "smoke: export parity",
                 "smoke: data parallel"):
        assert checks[name]["status"] == OK, checks[name]
    assert "(bar 1e-05, CPU (host))" in checks["smoke: export parity"]["detail"]
    assert checks["smoke: data parallel"]["detail"].startswith("2 msrun ranks x batch 4 on CPU")
    # one keyed folder per lr, one for the data-parallel check's single process, one for its ranks
    keys = [json.loads((d / "key.json").read_text()) for d in (tmp_path / "graphs").iterdir()]
    assert len(keys) == 4, keys
    assert not list(scratch.glob("clipms-smoke-*"))  # its runs and bundle removed afterwards


# --- the data-parallel check --------------------------------------------------------------------
def test_a_profile_of_several_ranks_gets_a_data_parallel_check_on_this_hosts_devices():
    eight = plan_of(yaml.safe_load((PROJECT_ROOT / "profiles" / "vit-b-32-8npu.yaml").read_text()))
    assert (eight.ranks, eight.dp_batch) == (8, smoke.DP_BATCH)  # one rank on each NPU
    assert eight.dp_model["vision"]["width"] == 768  # the run's model, at a small batch
    two_hosts = plan_of(yaml.safe_load(
        (PROJECT_ROOT / "profiles" / "vit-b-32-2x8npu.yaml").read_text()))
    assert two_hosts.ranks == 8  # this host's share of the 16
    one = plan_of(yaml.safe_load((PROJECT_ROOT / "profiles" / "vit-b-32-1npu.yaml").read_text()))
    assert one.ranks == 1 and one.dp_model is None  # one rank: no msrun, no check
    cpu = plan_of({"train.distributed.workers": 8})
    assert (cpu.device, cpu.ranks, cpu.dp_batch) == ("CPU", 2, smoke.CPU_DP_BATCH)
    assert cpu.dp_model["vision"]["layers"] == 1 and cpu.dp_model["text"]["layers"] == 1


ROWS = [{"loss": 2.08, "grad_norm": 1.91}, {"loss": 1.72, "grad_norm": 2.40}]


def test_the_data_parallel_check_wants_every_rank_to_be_the_single_process():
    plan = plan_of({"train.distributed.workers": 2})
    ok = smoke.check_data_parallel(ROWS, {0: ROWS, 1: ROWS}, "", plan)
    assert ok.status == OK and "gradients averaged, features all-gathered" in ok.detail
    within = [{k: v * (1 + 0.5 * smoke.DP_SAME) for k, v in row.items()} for row in ROWS]
    assert smoke.check_data_parallel(ROWS, {0: within, 1: within}, "", plan).status == OK
    # without the reducer each rank's norm is its own half's
    unreduced = [{**row, "grad_norm": row["grad_norm"] * 1.4} for row in ROWS]
    bad = smoke.check_data_parallel(ROWS, {0: ROWS, 1: unreduced}, "", plan)
    assert bad.status == FAIL and "rank 1's grad_norm" in bad.detail
    assert "reducer did not average" in bad.detail
    local = [{**ROWS[0], "loss": 1.39}, ROWS[1]]  # its own negatives only: a smaller loss
    bad = smoke.check_data_parallel(ROWS, {0: local, 1: local}, "", plan)
    assert bad.status == FAIL and "rank 0's loss" in bad.detail and "all-gathered" in bad.detail


def test_a_rank_that_fails_is_named_before_the_ranks_stopped_with_it():
    plan = plan_of({"train.distributed.workers": 2})
    check = smoke.check_data_parallel(
        ROWS, {0: "no result (msrun exited 1 ...)", 1: "failed: RuntimeError: HCCL timeout"},
        "msrun exited 1", plan)
    assert check.status == FAIL
    assert check.detail.index("rank 1 failed: RuntimeError: HCCL timeout") < check.detail.index(
        "rank 0 no result")
    late = smoke.check_data_parallel(ROWS, {0: ROWS, 1: ROWS}, "msrun exited 1", plan)
    assert late.status == FAIL and "every rank finished, but msrun exited 1" in late.detail
    ref = smoke.check_data_parallel("`dp-single` failed (exit 1): boom", {0: ROWS, 1: ROWS}, "",
                                    plan)
    assert ref.status == FAIL and "single-process reference failed" in ref.detail


@pytest.mark.slow  # msrun with 2 workers and a single process, each compiling a train step
@pytest.mark.timeout(1800)
def test_the_data_parallel_smoke_runs_two_msrun_ranks_on_this_cpu(tmp_path):
    import dataclasses

    plan = plan_of({"train.distributed.workers": 2})
    (tmp_path / "plan.json").write_text(json.dumps(dataclasses.asdict(plan)))
    check = smoke.run_data_parallel(tmp_path, plan, timeout=1200)
    assert check.status == OK, check.detail
    rows = {rank: json.loads((tmp_path / f"dp-rank{rank}.json").read_text()) for rank in (0, 1)}
    assert len(rows[0]) == smoke.DP_STEPS and rows[0] == rows[1]  # the ranks agree exactly

    # rank 1 trains, then cannot write its result (a folder is in the way): named as rank 1
    again = tmp_path / "again"
    again.mkdir()
    (again / "plan.json").write_text(json.dumps(dataclasses.asdict(plan)))
    (again / "dp-rank1.json").mkdir()
    ranks, launch_error = smoke.run_ranks(again, plan, timeout=1200)
    failed = smoke.check_data_parallel(rows[0], ranks, launch_error, plan)
    assert failed.status == FAIL and "rank 1 failed: IsADirectoryError" in failed.detail, failed
    # rank 0 finished, or msrun stopped it when rank 1 exited: either way not called failed
    assert ranks[0] == rows[0] or ranks[0].startswith("no result"), ranks[0]


MINDSPORE_TRACEBACK = """Traceback (most recent call last):
  File "ops/smoke.py", line 1, in dp_child
RuntimeError: {space}
----------------------------------------------------
- Kernel error:
----------------------------------------------------
Launch kernel failed: Default/AllReduce-op0

----------------------------------------------------
- C++ Call Stack: (For framework developers)
----------------------------------------------------
mindspore/ccsrc/backend/ms_backend/runtime/actors/base/kernel_actor.cc:995 OnMemoryAllocFinish
""".format(space=" ")  # MindSpore's `RuntimeError: ` line ends in a space


def test_a_failed_ranks_line_is_its_exception_not_a_cpp_stack_frame(tmp_path):
    (tmp_path / "dp-rank1.error").write_text(MINDSPORE_TRACEBACK)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker_0.log").write_text(
        "[ERROR] DISTRIBUTED: ReduceBroadcastAllReduce] Memcpy error, dest size is 4\n"
        "a warning printed last\n")
    failed = smoke._rank_outcome(tmp_path, logs, 1, "msrun exited 1")
    assert failed == "failed: RuntimeError: Launch kernel failed: Default/AllReduce-op0"
    stopped = smoke._rank_outcome(tmp_path, logs, 0, "msrun exited 1")
    assert stopped.startswith("no result (msrun exited 1: stopped when another rank failed")
    assert stopped.endswith("[ERROR] DISTRIBUTED: ReduceBroadcastAllReduce] Memcpy error, "
                            "dest size is 4")
