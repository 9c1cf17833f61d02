"""`dvc repro train` end to end on the tiny pipeline (real metadata -> shards -> tokenizer stages),
then the stage's outputs against their contracts, and resume from the persisted checkpoints."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest

from harness.dvc_workspace import make_workspace, run, set_params, tool_env
from pipeline.params import ParamsError, validate_section
from stages.train import TrainParams


def test_params_reject_unknown_keys_and_bad_values():
    with pytest.raises(ParamsError, match=r"train.precision = 'fp8'"):
        validate_section("train", TrainParams, {"precision": "fp8"})
    with pytest.raises(ParamsError, match=r"train.distributed.hosts: unknown key"):
        validate_section("train", TrainParams, {"distributed": {"hosts": 2}})
    params = validate_section("train", TrainParams, {"distributed": {"workers": 8}})
    assert params.resume == "auto" and params.distributed.workers == 8


@pytest.mark.parametrize(("overrides", "message"), [
    ({"vision": {"patch_size": 7}}, "vision.image_size=64 is not a multiple of vision.patch_size"),
    ({"vision": {"layers": 0}}, "vision.layers=0 must be a positive number"),
    ({"text": {"width": -256}}, "text.width=-256 must be a positive number"),
    ({"text": {"heads": 3}}, "text.width=256 is not a multiple of text.heads=3"),
    ({"vision": {"width": 100}}, "vision.width=100 is not a multiple of vision.head_width=64"),
    ({"embed_dim": 0}, "model.embed_dim=0 must be a positive number"),
    ({"vision": {"depth": 2}}, "unknown vision config key"),
])
def test_model_overrides_that_cannot_be_built_are_params_errors(overrides, message):
    with pytest.raises(ParamsError, match=r"train\.model = .*" + re.escape(message)):
        validate_section("train", TrainParams, {"preset": "tiny", "model": overrides})


def test_the_loss_chooses_the_models_initial_temperature_and_bias_under_the_overrides():
    """train.loss: siglip starts from open_clip_train's --siglip init (logit scale log 10, bias
    -10) unless train.model says otherwise; a bias the softmax loss cannot train is refused."""
    from stages.train import model_for

    clip = validate_section("train", TrainParams, {})
    assert model_for(clip.preset, clip.loss, clip.model).init_logit_bias is None
    siglip = validate_section("train", TrainParams, {"loss": "siglip"})
    model = model_for(siglip.preset, siglip.loss, siglip.model)
    assert (model.init_logit_scale, model.init_logit_bias) == (math.log(10), -10.0)
    mine = validate_section("train", TrainParams, {"loss": "siglip",
                                                   "model": {"init_logit_bias": -5.0}})
    model = model_for(mine.preset, mine.loss, mine.model)
    assert (model.init_logit_scale, model.init_logit_bias) == (math.log(10), -5.0)
    with pytest.raises(ParamsError, match=r"train.model = .*train.loss='clip' but the model has "
                                          r"init_logit_bias=-5.0"):
        validate_section("train", TrainParams, {"model": {"init_logit_bias": -5.0}})
    with pytest.raises(ParamsError, match=r"train.loss = 'focal'"):
        validate_section("train", TrainParams, {"loss": "focal"})
    with pytest.raises(ParamsError, match=r"vision.patch_dropout=1 must be a share in \[0, 1\)"):
        validate_section("train", TrainParams, {"model": {"vision": {"patch_dropout": 1}}})


def test_a_train_split_smaller_than_one_global_batch_stops_before_any_work(tmp_path, monkeypatch):
    from clipms.runtime import RuntimeConfig
    from stages.train import build_job

    (tmp_path / "data/shards").mkdir(parents=True)
    manifest = {"splits": {"train": {"samples": 48, "shards": []}}}
    (tmp_path / "data/shards/manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)  # no tokenizer, no model: the check comes first
    params = validate_section("train", TrainParams, {"batch_size": 16, "accum_steps": 2,
                                                     "distributed": {"workers": 2}})
    with pytest.raises(ParamsError, match=r"holds 48 samples, fewer than one global batch of 64 "
                       r"\(train.batch_size 16 x train.accum_steps 2 x train.distributed.workers "
                       r"2\)"):
        build_job(params, RuntimeConfig())


def test_params_yaml_documents_every_key_of_the_train_and_runtime_schemas():
    from clipms.runtime import RuntimeConfig
    from harness.dvc_workspace import PROJECT_ROOT
    from pipeline.params import read_params

    params = read_params(PROJECT_ROOT / "params.yaml")
    assert set(params["train"]) == set(TrainParams.model_fields)
    assert set(params["runtime"]) == set(RuntimeConfig.model_fields)
    text = (PROJECT_ROOT / "params.yaml").read_text()
    section = text[text.index("\ntrain:"):text.index("\nevaluate:")]
    undocumented = [line for line in section.splitlines()[1:]
                    if line.startswith("  ") and not line.startswith("    ") and "#" not in line]
    assert undocumented == []  # every key carries its comment (the user's docs)


def test_the_schema_default_preset_is_the_default_runs_and_every_preset_is_documented():
    from clipms.model.architecture import DEFAULT_PRESET, PRESETS
    from harness.dvc_workspace import PROJECT_ROOT
    from pipeline.params import read_params

    assert TrainParams().preset == DEFAULT_PRESET == read_params(PROJECT_ROOT / "params.yaml")[
        "train"]["preset"]
    text = (PROJECT_ROOT / "params.yaml").read_text()
    preset_line = next(line for line in text.splitlines() if line.startswith("  preset:"))
    assert all(name in preset_line for name in PRESETS)  # the comment lists every preset


@pytest.mark.slow
def test_dvc_repro_train_writes_its_contract_outputs_and_resumes(tmp_path):
    ws = make_workspace(tmp_path)
    env = tool_env()
    env.pop("OMP_WAIT_POLICY", None)  # as in a user's shell (conftest.py exports it for pytest)
    out = run(["dvc", "repro", "train"], cwd=ws, timeout=900, env=env).stdout
    assert "step 1/" in out  # the periodic log line
    assert "was imported before" not in out  # the stage sets MindSpore's import-time env first
    for path in ("models/clip.ckpt", "models/clip.json", "metrics/train.json", "plots/train.csv"):
        assert (ws / path).is_file(), path

    metrics = json.loads((ws / "metrics/train.json").read_text())
    for key in ("final_loss", "steps", "samples_per_s", "wall_time_s", "peak_rss_mb"):
        assert key in metrics, key
    rows = list(csv.DictReader((ws / "plots/train.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, int(metrics["steps"]) + 1))
    assert set(rows[0]) >= {"step", "epoch", "loss", "lr", "logit_scale", "samples_per_s"}
    assert float(rows[-1]["loss"]) == pytest.approx(metrics["final_loss"], rel=1e-5)

    run_config = json.loads((ws / "models/clip.json").read_text())
    tokenizer = json.loads((ws / "models/tokenizer.json").read_text())
    assert run_config["tokenizer"] == "models/tokenizer.json"
    assert run_config["model"]["embed_dim"] == 32  # the TINY_PARAMS override reached the model
    assert run_config["preprocess"]["image_size"] == run_config["model"]["vision"]["image_size"]
    assert json.dumps(tokenizer)  # readable; vocab/context checked by loading the model below
    check = (
        "from clipms.train.trained import RunConfig, load_clip\n"
        "from clipms.text.clip_tokenizer import Tokenizer\n"
        "cfg = RunConfig.read('models/clip.json')\n"
        "tok = Tokenizer.load('models/tokenizer.json')\n"
        "assert cfg.model.text.vocab_size == tok.vocab_size, cfg.model.text\n"
        "assert cfg.model.text.context_length == tok.context_length\n"
        "load_clip('models/clip.ckpt', cfg.model)\n"
        "print('LOADED')\n"
    )
    assert "LOADED" in run(["python", "-c", check], cwd=ws).stdout

    # DVC deletes a stage's outs before running it, but not the persisted checkpoints: a rerun
    # after losing the weights resumes from the final checkpoint instead of training again.
    checkpoints = sorted(p.name for p in (ws / "models/checkpoints").glob("step-*.ckpt"))
    assert checkpoints and checkpoints[-1] == f"step-{int(metrics['steps']):08d}.ckpt"
    (ws / "models/clip.ckpt").unlink()
    again = run(["dvc", "repro", "train"], cwd=ws, timeout=900).stdout
    assert "resuming from" in again
    assert (ws / "models/clip.ckpt").is_file()
    resumed = json.loads((ws / "metrics/train.json").read_text())
    assert resumed["final_loss"] == metrics["final_loss"]

    # The same stage on 2 data-parallel msrun workers: the 1-process checkpoints do not match
    # (another global batch), so it trains afresh; rank 0 writes the same contract outputs.
    set_params(ws / "params.yaml", {"train.distributed.workers": 2})
    parallel = run(["dvc", "repro", "train"], cwd=ws, timeout=900).stdout
    assert "msrun --worker_num=2" in parallel
    rank0_log = (ws / "models/checkpoints/msrun/worker_0.log").read_text()
    assert "belong to another configuration" in rank0_log and "from step 0" in rank0_log
    metrics = json.loads((ws / "metrics/train.json").read_text())
    assert metrics["devices"] == 2 and metrics["global_batch_size"] == 16
    rows = list(csv.DictReader((ws / "plots/train.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, int(metrics["steps"]) + 1))
    assert sorted(p.name for p in (ws / "models/checkpoints/msrun").glob("worker_*.log")) == [
        "worker_0.log", "worker_1.log"]
