"""A night that starts from the champion, against a real MLflow server: the pinned tokenizer is
the champion's file (same ids), a retrain builds another; a warm start begins from exactly the
champion's weights and its lineage names the version; every way the champion cannot be carried
over stops the stage with a message, except a model never registered (the first night)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from contextlib import chdir
from pathlib import Path

import numpy as np
import pytest
import yaml

from harness import mlflow_server as server_fixtures
from harness import register_workspace
from harness.dvc_workspace import PROJECT_ROOT, checkpoint_arrays, tool_env
from harness.mlflow_server import MlflowServer
from harness.register_workspace import prepare_workspace, register_in
from harness.tiny_model import CAPTIONS, make_train_and_val_shards
from tracking import settings

pytestmark = pytest.mark.slow
mlflow_server = server_fixtures.mlflow_server  # module fixtures, found by name
bundle = register_workspace.bundle

# The tiny architecture of harness/tiny_model.py as train params (vocabulary and context: the
# tokenizer's, 600 and 16 for the champion's).
TINY_TRAIN = {
    "preset": "tiny", "batch_size": 4, "workers": 0, "log_every": 1, "checkpoint_every": 1,
    "resume": "never", "seed": 1, "warmup_steps": 0, "lr": 0.0, "max_steps": 2,
    "model": {"embed_dim": 32, "vision": {"image_size": 32, "patch_size": 8, "width": 64,
                                          "layers": 1, "head_width": 32},
              "text": {"width": 64, "heads": 2, "layers": 1}},
}


@pytest.fixture
def champion(mlflow_server: MlflowServer, bundle: Path, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """A registered champion (the tiny bundle and the checkpoint it was exported from) of a
    model named after the test; returns the model's name."""
    if mlflow_server.proc is None:
        mlflow_server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    model = "carry-" + hashlib.sha256(request.node.name.encode()).hexdigest()[:10]
    code, record = register_in(prepare_workspace(tmp_path / "v1", bundle, {"i2t_R@5": 0.5},
                                                 model))
    assert code == 0 and record is not None and record["alias"] == "champion"
    return model


def night(root: Path, params: dict) -> Path:
    """A project folder as the data stages leave it (train + val shards), with `params`."""
    make_train_and_val_shards(root / "data" / "shards")
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


def tokenizer_stage(root: Path) -> int:
    from stages import tokenizer

    with chdir(root):
        return tokenizer.main()


def record(root: Path) -> dict:
    return json.loads((root / "metrics" / "tokenizer.json").read_text())


def test_a_pinned_tokenizer_is_the_champions_and_a_retrain_builds_another(
        champion: str, bundle: Path, tmp_path: Path) -> None:
    from clipms.text.clip_tokenizer import Tokenizer

    pin = f"models:/{champion}@champion"
    root = night(tmp_path / "night", {"tokenizer": {"pin": pin, "vocab_size": 560,
                                                    "context_length": 16}})
    assert tokenizer_stage(root) == 0
    ours, theirs = root / "models" / "tokenizer.json", bundle / "tokenizer.json"
    assert ours.read_bytes() == theirs.read_bytes()
    np.testing.assert_array_equal(Tokenizer.load(ours).encode(CAPTIONS),
                                  Tokenizer.load(theirs).encode(CAPTIONS))
    assert record(root)["lineage.tokenizer_from"] == f"models:/{champion}/1"
    assert record(root)["lineage.tokenizer_from_uri"] == pin

    (root / "params.yaml").write_text(yaml.safe_dump(  # the run asks to retrain it
        {"tokenizer": {"pin": None, "vocab_size": 560, "context_length": 16}}))
    assert tokenizer_stage(root) == 0
    assert ours.read_bytes() != theirs.read_bytes()
    from clipms.data.dataset import iter_captions

    Tokenizer.train(list(iter_captions(root / "data" / "shards", "train")), 560, 16).save(
        tmp_path / "expected.json")  # this night's captions, as the stage trains them
    assert ours.read_bytes() == (tmp_path / "expected.json").read_bytes()
    assert record(root)["lineage.tokenizer_from"] == "trained on this run's train captions"


def test_a_pin_to_a_model_never_registered_builds_one_and_a_missing_alias_stops(
        champion: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = night(tmp_path / "first", {"tokenizer": {"pin": "models:/never-registered@champion",
                                                     "vocab_size": 560}})
    assert tokenizer_stage(first) == 0
    assert record(first)["lineage.tokenizer_from"] == "trained on this run's train captions"
    assert "the first night" in capsys.readouterr().out

    missing = night(tmp_path / "missing", {"tokenizer": {"pin": f"models:/{champion}@nightly"}})
    assert tokenizer_stage(missing) == 1
    err = capsys.readouterr().err
    assert f"tokenizer.pin: models:/{champion}@nightly: registered model '{champion}' has no " \
           "alias 'nightly'" in err, err
    assert not (missing / "models" / "tokenizer.json").exists()


def train_stage(root: Path, uri: str) -> subprocess.CompletedProcess[str]:
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT), "MLFLOW_TRACKING_URI": uri,
           "CLIPMS_KERNEL_FUSION": "0"}
    return subprocess.run([sys.executable, "-m", "stages.train"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)


def run_tags(root: Path) -> dict[str, str]:
    run_id = json.loads((root / "models" / "mlflow_run.json").read_text())["run_id"]
    return settings.client().get_run(run_id).data.tags


def test_a_warm_start_begins_from_the_champions_weights_and_names_it(
        champion: str, bundle: Path, tmp_path: Path, mlflow_server: MlflowServer) -> None:
    """Trained with learning rate 0 (and so no weight decay either), the weights a run ends
    with are the ones it started from: the champion's to the bit when warm, not when cold."""
    pin = f"models:/{champion}@champion"
    params = {"tokenizer": {"pin": pin}, "runtime": {"kernel_fusion": False},
              "register": {"experiment": "carryover"},
              "train": {**TINY_TRAIN, "init_from": pin,
                        "warm_start": {"max_steps": 1, "lr": 0.0, "warmup_steps": 0}}}
    root = night(tmp_path / "warm", params)
    assert tokenizer_stage(root) == 0
    warm = train_stage(root, mlflow_server.uri)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert f"warm start from models:/{champion}/1" in warm.stdout

    champion_ckpt = bundle.parent / "trained" / "clip.ckpt"
    ours, theirs = checkpoint_arrays(root / "models/clip.ckpt"), checkpoint_arrays(champion_ckpt)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    assert json.loads((root / "metrics/train.json").read_text())["steps"] == 1  # its budget
    v1 = settings.client().get_model_version(champion, "1")
    tags = run_tags(root)
    assert tags["lineage.init_from"] == f"models:/{champion}/1"
    assert tags["lineage.init_from_uri"] == pin
    assert tags["lineage.init_from_run"] == v1.run_id
    assert tags["lineage.init_sha256"] == hashlib.sha256(champion_ckpt.read_bytes()).hexdigest()
    assert tags["lineage.tokenizer_from"] == f"models:/{champion}/1"
    init_from = json.loads((root / "models/clip.json").read_text())["train"]["init_from"]
    assert init_from == f"models/warm-start/{tags['lineage.init_sha256'][:16]}/clip.ckpt"

    cold_params = {**params, "train": {**TINY_TRAIN, "init_from": None}}
    cold = night(tmp_path / "cold", cold_params)
    (cold / "models").mkdir()
    shutil.copy2(root / "models" / "tokenizer.json", cold / "models" / "tokenizer.json")
    result = train_stage(cold, mlflow_server.uri)
    assert result.returncode == 0, result.stderr[-3000:]
    cold_weights = checkpoint_arrays(cold / "models/clip.ckpt")
    assert any(not np.array_equal(cold_weights[n], theirs[n]) for n in theirs)
    assert json.loads((cold / "metrics/train.json").read_text())["steps"] == 2
    assert "lineage.init_from" not in run_tags(cold)


# ---------------------------------------------------------------------------------------------
# what cannot be carried over (the registry layer, in this process)


def champion_model(bundle: Path) -> dict:
    """The champion's architecture: harness/tiny_model.py's, with its tokenizer's vocabulary."""
    from clipms.text.clip_tokenizer import Tokenizer
    from harness.tiny_model import tiny_config

    return tiny_config(Tokenizer.load(bundle / "tokenizer.json").vocab_size).to_dict()


def fetch(uri: str, root: Path, tokenizer: Path, model: dict):  # noqa: ANN201
    from registry.carryover import fetch_init_checkpoint

    return fetch_init_checkpoint(uri, root / "warm-start", tokenizer, model)


def test_what_cannot_be_carried_over_stops_with_a_message(
        champion: str, bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.tiny_model import write_trained
    from registry.carryover import CarryOverError

    tokenizer, model = bundle / "tokenizer.json", champion_model(bundle)
    good = fetch(f"models:/{champion}@champion", tmp_path, tokenizer, model)
    assert good.version is not None and good.version.version == "1"
    assert good.path is not None and good.path.read_bytes() == (
        bundle.parent / "trained" / "clip.ckpt").read_bytes()

    with pytest.raises(CarryOverError, match=f"registered model '{champion}' has no alias "
                                             "'nightly'"):
        fetch(f"models:/{champion}@nightly", tmp_path, tokenizer, model)
    with pytest.raises(CarryOverError, match=f"registered model '{champion}' has no version 9"):
        fetch(f"models:/{champion}/9", tmp_path, tokenizer, model)
    other = write_trained(tmp_path / "other", seed=0)["tokenizer"]
    other.write_text(other.read_text().replace('"context_length": 16', '"context_length": 17'))
    with pytest.raises(CarryOverError, match="was trained with another tokenizer"):
        fetch(f"models:/{champion}@champion", tmp_path, other, model)
    wider = {**model, "embed_dim": 64}
    with pytest.raises(CarryOverError, match=r"another architecture .*embed_dim: 32 \(theirs\) "
                                             r"!= 64"):
        fetch(f"models:/{champion}@champion", tmp_path, tokenizer, wider)
    assert fetch("models:/never-registered@champion", tmp_path, tokenizer, model).version is None

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with pytest.raises(CarryOverError, match="could not read models:/never-registered@champion "
                                             "from the registry"):
        fetch("models:/never-registered@champion", tmp_path, tokenizer, model)


def test_a_version_registered_without_its_checkpoint_cannot_be_warm_started(
        champion: str, bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version registered before checkpoints were logged with versions (or by hand). Registering
    leaves no process-global tracking URI behind: one left set outranked MLFLOW_TRACKING_URI and
    sent a later test's registry calls of this process to this test's server."""
    import mlflow

    from registry.carryover import CarryOverError
    from registry.registration import register_version
    from tracking.files import FILES
    from tracking.run import PipelineRun
    from tracking.settings import RegisterParams

    root = prepare_workspace(tmp_path / "v2", bundle, {"i2t_R@5": 0.9}, champion)
    with chdir(root):
        record = register_version(PipelineRun.resume(FILES), "models/export",
                                  RegisterParams(model_name=champion), {"i2t_R@5": 0.9})
    assert record["alias"] == "champion" and record["version"] == 2
    with pytest.raises(CarryOverError, match=r"models:/.*@champion \(v2\): no training checkpoint "
                                             r"logged with it"):
        fetch(f"models:/{champion}@champion", tmp_path, bundle / "tokenizer.json",
              champion_model(bundle))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "elsewhere").as_uri())
    assert mlflow.get_tracking_uri() == (tmp_path / "elsewhere").as_uri()
