"""`python -m ops.preflight` on this machine (no Ascend device: it must say so and fail), its
plan checks against a real manifest, and the Ascend parameter sets in profiles/ validated by the
stages' own schemas."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.dvc_workspace import PROJECT_ROOT, run, tool_env
from ops import preflight
from pipeline.params import read_params, validate_section

PROFILES = sorted((PROJECT_ROOT / "profiles").glob("vit-*.yaml"))  # the Ascend parameter sets


def _cli(*args: str, cwd: Path = PROJECT_ROOT):
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT)}
    return run(["python", "-m", "ops.preflight", "--json", *args], cwd=cwd, check=False,
               env=env, timeout=300)


def _schemas() -> dict[str, type]:
    from clipms.eval.options import EvaluateParams
    from clipms.runtime import RuntimeConfig
    from stages.download import DownloadParams
    from stages.metadata import MetadataParams
    from stages.tokenizer import TokenizerParams
    from stages.train import TrainParams

    return {"train": TrainParams, "tokenizer": TokenizerParams, "metadata": MetadataParams,
            "evaluate": EvaluateParams, "runtime": RuntimeConfig, "download": DownloadParams}


def test_the_plan_defaults_are_the_train_stages_own():
    schema, runtime = _schemas()["train"](), _schemas()["runtime"]()
    plan = preflight.RunPlan()
    for field in dataclasses.fields(preflight.RunPlan):
        for section in (schema, runtime):
            if field.name in type(section).model_fields:
                assert getattr(plan, field.name) == getattr(section, field.name), field.name
    dist = schema.distributed
    assert (plan.ranks, plan.nodes, plan.node_rank, plan.master_addr, plan.master_port) == (
        dist.workers, dist.nodes, dist.node_rank, dist.master_addr, dist.master_port)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_parameter_count_is_the_models(preset):
    from clipms.model.clip import CLIP

    cfg = preflight.model_config({"train": {"preset": preset},
                                  "tokenizer": {"kind": "bpe", "vocab_size": 600}})
    real = sum(int(p.size) for p in CLIP(cfg).get_parameters())
    assert preflight.parameter_count(cfg) == real


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_each_ascend_profile_is_valid_params_and_a_sensible_schedule(profile):
    overrides = yaml.safe_load(profile.read_text())
    params = preflight.apply_overrides(read_params(PROJECT_ROOT / "params.yaml"), overrides)
    sections = {key.split(".")[0] for key in overrides}
    for name in sections:
        validate_section(name, _schemas()[name], params[name])  # raises on a bad key or value
    plan = preflight.RunPlan.from_params(params)
    assert plan.device_target == "Ascend" and plan.precision == "amp"
    assert plan.preset == "ViT-B-32" and plan.image_size == 224
    checks = preflight.check_schedule(plan, None, "no manifest", 0.1)
    assert all(c.status != preflight.FAIL for c in checks), checks
    assert preflight.check_image_size(params["download"], 224).status == "ok"
    steps = int(checks[-1].detail.split(" of ")[1].split()[0])
    assert plan.warmup_steps / steps < 0.1  # warmup is a small part of the run
    assert f"-S 'train.batch_size={plan.batch_size}'" in preflight.dvc_command(overrides)


@pytest.mark.skipif(bool(preflight.ascend_devices()), reason="this host has Ascend devices")
@pytest.mark.slow  # starts the preflight's process / compiles the model
def test_on_this_machine_an_ascend_profile_fails_and_says_no_device_is_present():
    proc = _cli("--profile", str(PROJECT_ROOT / "profiles" / "vit-b-32-8npu.yaml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["devices"]["status"] == "FAIL"
    assert "no Ascend device is present on this host" in checks["devices"]["detail"]
    assert checks["mindspore.run_check"]["status"] == "ok"  # MindSpore itself runs (on CPU)
    plan = report["plan"]
    assert (plan["device"], plan["ranks"], plan["global_batch"]) == ("Ascend", 8, 2048)
    assert (plan["jit_level"], plan["kernel_fusion"]) == ("O0", False)  # clipms.runtime's Ascend
    assert (plan["compile_cache"], plan["data_sink"]) == (False, False)  # the profile's
    assert "compile cache off, data sink off" in checks["runtime"]["detail"]
    assert checks["hccl ports"]["status"] in ("ok", "warn")  # 8 ranks: HCCL's host ports
    assert plan["parameters"] == 151_277_313  # open_clip's ViT-B-32
    assert report["command"].startswith("dvc exp run -S 'metadata.source=mscoco'")


@pytest.mark.slow  # starts the preflight's process / compiles the model
def test_the_default_cpu_run_passes_and_the_plan_is_checked_against_the_manifest(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"splits": {"train": {"samples": 1500, "shards": []}}}))
    ok = _cli("--manifest", str(manifest), "--checkpoints", str(tmp_path / "ckpt"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    report = json.loads(ok.stdout.strip().splitlines()[-1])
    checks = {c["name"]: c for c in report["checks"]}
    assert "23 steps an epoch of 1500" in checks["global batch"]["detail"]  # 1500 // 64
    assert report["command"] == "dvc repro" and report["plan"]["device"] == "CPU"
    assert checks["image size"]["status"] == "ok"  # 128-px synthetic images, 64-px model

    upscaled = _cli("--manifest", str(manifest), "-S", "train.preset=small")  # 128 px: fine
    assert {c["name"]: c for c in json.loads(upscaled.stdout.splitlines()[-1])["checks"]}[
        "image size"]["status"] == "ok"
    upscaled = _cli("--manifest", str(manifest), "-S", "train.preset=ViT-B-32")  # 224 px
    detail = {c["name"]: c for c in json.loads(upscaled.stdout.splitlines()[-1])["checks"]}
    assert detail["image size"]["status"] == "warn"
    assert "download.image_size 128 < the model's 224-px input" in detail["image size"]["detail"]
    kept = _cli("--manifest", str(manifest), "-S", "train.preset=ViT-B-32",
                "-S", "download.resize_mode=no")  # img2dataset does not resize: nothing to say
    assert {c["name"]: c for c in json.loads(kept.stdout.splitlines()[-1])["checks"]}[
        "image size"]["status"] == "ok"

    too_big = _cli("--manifest", str(manifest), "-S", "train.batch_size=1024",
                   "-S", "train.distributed.workers=2")
    assert too_big.returncode == 1
    detail = {c["name"]: c for c in json.loads(too_big.stdout.splitlines()[-1])["checks"]}
    assert "cannot fill one global batch of 2048" in detail["global batch"]["detail"]

    bad_runtime = _cli("--manifest", str(manifest), "-S", "runtime.jit_level=O3")
    assert bad_runtime.returncode == 1
    detail = {c["name"]: c for c in json.loads(bad_runtime.stdout.splitlines()[-1])["checks"]}
    assert detail["runtime"]["status"] == "FAIL" and "jit_level" in detail["runtime"]["detail"]

    never_warm = _cli("--manifest", str(manifest), "-S", "train.epochs=1",
                      "-S", "train.warmup_steps=23")
    assert never_warm.returncode == 1
    detail = {c["name"]: c for c in json.loads(never_warm.stdout.splitlines()[-1])["checks"]}
    assert "never leaves warmup" in detail["warmup"]["detail"]


def test_a_cluster_whose_master_is_loopback_is_refused():
    plan = preflight.RunPlan(ranks=16, nodes=2, master_port=8118, device_target="Ascend")
    checks = {c.name: c for c in preflight.check_launcher(plan)}
    assert checks["master_addr"].status == preflight.FAIL
    assert "loopback" in checks["master_addr"].detail
    remote = dataclasses.replace(plan, master_addr="192.0.2.10")  # a documentation address
    checks = {c.name: c for c in preflight.check_launcher(remote)}
    assert checks["master_addr"].status == preflight.OK
    assert checks["hccl"].status in (preflight.OK, preflight.WARN)


def test_shared_memory_is_mindsporess_own_check_at_the_loaders_row_size():
    plan = preflight.RunPlan(ranks=8)
    row = 3 * 224 * 224  # uint8 pixels
    check = preflight.check_shared_memory(plan, workers=16, row_bytes=row)
    # ranks (<= 8) x workers x (max(2, min(16, 16*4 // workers)) + 2) rows, prefetch 16
    assert check.status == preflight.OK and check.detail.startswith("MindSpore's check passes")
    assert f"~{8 * 16 * (4 + 2) * row / 2**20:,.0f} MB" in check.detail
    free = shutil.disk_usage("/dev/shm").free
    too_big = preflight.check_shared_memory(plan, workers=16, row_bytes=free // 100)
    assert too_big.status == preflight.FAIL
    assert "Insufficient shared memory available" in too_big.detail  # MindSpore's own words


def test_hccls_port_range_follows_the_cann_version_and_names_the_sysctl(tmp_path):
    toolkit = tmp_path / "ascend-toolkit" / "latest"
    (toolkit / "aarch64-linux").mkdir(parents=True)
    info = toolkit / "aarch64-linux" / "ascend_toolkit_install.info"
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.3.RC1\narch=aarch64\n")
    assert preflight.cann_version({"ASCEND_HOME_PATH": str(toolkit)}) == (8, 3)
    assert preflight.cann_version({}) is None
    assert preflight.hccl_port_range((8, 0), {}) == (60000, 60015)  # CANN 8.0: 16 ports
    assert preflight.hccl_port_range((8, 3), {}) == (60000, 60031)  # 8.2 on: 32
    assert preflight.hccl_port_range(None, {}) == (60000, 60031)  # unknown: the larger range
    assert preflight.hccl_port_range((8, 3), {"HCCL_IF_BASE_PORT": "50000"}) == (50000, 50031)
    ok = preflight.check_hccl_ports((8, 3), {}, "1024,60000-60031\n")
    assert ok.status == preflight.OK and "CANN 8.3" in ok.detail
    old = preflight.check_hccl_ports((8, 3), {}, "60000-60015\n")  # reserved for CANN 8.0 only
    assert old.status == preflight.WARN and "16 of them are not reserved" in old.detail
    assert "sysctl -w net.ipv4.ip_local_reserved_ports=60000-60015,60000-60031" in old.detail
    assert preflight.check_hccl_ports((8, 0), {}, "60000-60015").status == preflight.OK
    chosen = preflight.check_hccl_ports(None, {"HCCL_HOST_SOCKET_PORT_RANGE": "auto"}, "")
    assert chosen.status == preflight.OK and "HCCL_HOST_SOCKET_PORT_RANGE=auto" in chosen.detail


def test_a_compile_cache_forced_on_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("MS_DEV_FORCE_USE_COMPILE_CACHE", "1")
    checks = []
    preflight.runtime_settings({"device_target": "Ascend"}, checks)
    named = {c.name: c for c in checks}
    assert named["compile cache"].status == preflight.WARN
    assert "MS_DEV_FORCE_USE_COMPILE_CACHE=1" in named["compile cache"].detail


def test_image_size_check_without_params_falls_back_to_the_download_default():
    from prep.fetch import DownloadSettings

    default = DownloadSettings().image_size
    assert preflight.check_image_size({}, default).status == "ok"
    assert preflight.check_image_size({}, default + 1).status == "warn"
    assert preflight.check_image_size({"resize_mode": "no"}, default + 1).status == "ok"


def test_importing_preflight_leaves_the_download_stack_out():
    """The preflight CLI starts without pandas, pyarrow and fsspec (the download module's)."""
    probe = ("import sys, ops.preflight; print(sorted(m for m in ('prep.fetch', "
             "'pandas', 'pyarrow', 'fsspec') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=PROJECT_ROOT)
    assert out.stdout.strip() == "[]", out.stdout
