"""A project workspace as the stages before `register` leave it, written from files instead of
run, and the real register stage run in it (registry and tracking tests against a real server).

`write_pipeline_state(root)` writes the dvc.lock and shard manifest the lineage is read from;
`prepare_workspace(root, bundle, eval_metrics)` adds params, the export bundle, metrics/eval.json
and the pipeline's MLflow run; `register_in(root)` runs the register stage there. `bundle` and
`workspace` are fixtures: assign them to names in a test module (`workspace` also needs the
module's `server`, harness.mlflow_server).
"""

from __future__ import annotations

import json
from contextlib import chdir
from pathlib import Path

import pytest
import yaml

from harness.mlflow_server import MlflowServer
from tracking import run as tracking_run
from tracking.callback import TrainCallback
from tracking.files import FILES

MODEL = "clip-test"
ALIAS = "/api/2.0/mlflow/registered-models/alias"  # GET: the gate's champion lookup; POST: a move


def write_pipeline_state(root: Path, shards_md5: str = "1" * 32, val_sha: str = "f" * 64) -> None:
    """A dvc.lock and shard manifest as the data stages leave them."""
    lock = {"schema": "2.0", "stages": {
        "metadata": {"cmd": "python -m stages.metadata",
                     "params": {"params.yaml": {"metadata": {"source": "synthetic", "seed": 0,
                                                             "sha256": None}}},
                     "outs": [{"path": "data/metadata.parquet", "md5": "2" * 32, "size": 10}]},
        "shard": {"cmd": "python -m stages.shard",
                  "params": {"params.yaml": {"shard": {"samples_per_shard": 16}}},
                  "outs": [{"path": "data/shards", "md5": shards_md5 + ".dir", "size": 99}]},
        "split_outs": {"cmd": "true",  # as dvc.yaml declares the shard outs: one per part
                       "outs": [{"path": "data/parts/val", "md5": "4" * 32 + ".dir"},
                                {"path": "data/parts/manifest.json", "md5": "5" * 32}]},
        "tokenizer": {"cmd": "python -m stages.tokenizer",
                      "params": {"params.yaml": {"tokenizer.vocab_size": 400}},
                      "outs": [{"path": "models/tokenizer.json", "md5": "3" * 32, "size": 5}]},
    }}
    (root / "dvc.lock").write_text(yaml.safe_dump(lock))
    manifest = {"samples_per_shard": 16, "splits": {
        "train": {"samples": 30, "bytes": 1, "shards": [
            {"name": "train/000000.tar", "samples": 30, "bytes": 1, "sha256": "e" * 64}]},
        "val": {"samples": 10, "bytes": 1, "shards": [
            {"name": "val/000000.tar", "samples": 10, "bytes": 1, "sha256": val_sha}]}}}
    (root / "data" / "shards").mkdir(parents=True, exist_ok=True)
    (root / "data" / "shards" / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: MlflowServer) -> Path:
    """A project-like cwd with dvc.lock + manifest, tracking to the test server."""
    write_pipeline_state(tmp_path)
    (tmp_path / "params.yaml").write_text("register:\n  experiment: test-exp\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    return tmp_path


def train_like(run: tracking_run.PipelineRun, steps: int, start: int = 1) -> None:
    """Steps `start`.. of a training run's metrics, logged as the train stage's callback does."""
    callback = TrainCallback(run, flush_every_s=0.0, prefix="")
    for step in range(start, start + steps):
        callback.on_step_end(step, {"loss": 2.0 / step, "lr": 1e-3})


def scores(i2t_r5: float, mean_rank: float = 10.0) -> dict[str, float]:
    """metrics/eval.json of a model with this i2t_R@5 and mean rank."""
    return {"i2t_R@5": i2t_r5, "i2t_mean_rank": mean_rank, "mAP@10": i2t_r5 / 3,
            "num_images": 10, "chance_i2t_R@5": 0.5}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real export bundle (two MindIR graphs) of a tiny random-init CLIP."""
    from harness.tiny_model import export_tiny_bundle

    return export_tiny_bundle(tmp_path_factory.mktemp("export"), seed=0)


def prepare_workspace(root: Path, bundle: Path, eval_metrics: dict, model: str = MODEL,
                      primary_metric: str = "i2t_R@5", val_sha: str = "f" * 64,
                      train_params: dict | None = None, val_images: int | None = None) -> Path:
    """A workspace as the stages before register leave it: dvc.lock, manifest, params, the export
    bundle and the checkpoint it came from, metrics/eval.json, and the pipeline's MLflow run
    (train opened it, evaluate logged). The val split is a manifest entry only (`val_sha`), or
    real shards of `val_images` images (harness.tiny_model.make_val_shards)."""
    import shutil

    from clipms.utils.jsonio import write_json
    from harness.tiny_model import make_val_shards

    root.mkdir(parents=True)
    write_pipeline_state(root, val_sha=val_sha)
    if val_images is not None:
        make_val_shards(root / "data" / "shards", n_images=val_images)
    (root / "params.yaml").write_text(
        f"register:\n  model_name: {model}\n  experiment: test-exp\n"
        f"  primary_metric: {primary_metric}\n  margin: 0.0\n")
    shutil.copytree(bundle, root / "models" / "export")
    for name in ("clip.ckpt", "clip.json", "tokenizer.json"):  # what the bundle was exported from
        shutil.copy2(bundle.parent / "trained" / name, root / "models" / name)
    write_json(root / "metrics" / "eval.json", eval_metrics)
    with chdir(root):
        tracking_run.PipelineRun.open("train", train_params or {"lr": 1e-3}, FILES).close()
        tracking_run.log_stage("evaluate", {"batch_size": 16}, FILES, eval_metrics)
    return root


def register_in(root: Path) -> tuple[int, dict | None]:
    """The real register stage, in-process, in `root`: (exit code, metrics/register.json)."""
    from clipms.utils.jsonio import read_json
    from stages import register

    with chdir(root):
        code = register.main()
        out = Path("metrics/register.json")
        return code, read_json(out) if out.exists() else None


def read_run_id(workspace: Path) -> str:
    """The pipeline's MLflow run id, as the train stage recorded it in the workspace."""
    from clipms.utils.jsonio import read_json

    return str(read_json(workspace / "models" / "mlflow_run.json")["run_id"])
