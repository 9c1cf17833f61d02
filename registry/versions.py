"""Registered model versions as local files: resolve `models:/NAME@ALIAS` or `models:/NAME/VERSION`
and download what a version holds, each part on its own:

- its export bundle (the pyfunc's artifacts: two MindIR graphs, tokenizer.json, preprocess.json,
  bundle.json), which the gate re-scores on a new evaluation set (`registry.rescore`);
- its tokenizer (`tokenizer.json` of that bundle), which a night pins (`tokenizer.pin`);
- its training checkpoint (`clip.ckpt`, `clip.json` and the tokenizer it was trained with),
  logged by `register` into the version's run under `checkpoint/<logged model id>/`
  (`CHECKPOINT_ARTIFACT`), which a warm start begins from (`train.init_from:
  models:/clip@champion`). It is kept out of the logged model on purpose: serving and
  `mlflow models serve` download the whole logged model, and need no training weights.

Only the files asked for are downloaded (the logged model's index, the search collection's
embeddings, is never fetched here). A URI that names nothing usable is a `VersionError` naming the
URI and what is missing; any other registry error propagates unchanged (callers fail closed).
"""

# tested by: tests/registry/test_carryover_params.py

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_URI = re.compile(r"^models:/(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)"
                       r"(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>\d+))$")
CHECKPOINT_ARTIFACT = "checkpoint"  # run artifacts: checkpoint/<logged model id>/<CHECKPOINT_FILES>
CHECKPOINT_FILES = ("clip.ckpt", "clip.json", "tokenizer.json")
_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


class VersionError(RuntimeError):
    """A model URI that names no usable version: no such model, alias or version, or the version
    lacks the files asked for (e.g. registered before checkpoints were logged with versions)."""


class NoRegisteredModel(VersionError):
    """The registered model itself does not exist (yet): no version of it was ever registered."""


@dataclass(frozen=True)
class Version:
    """A resolved registered version: what the URI pointed at when it was read."""

    uri: str  # as given, e.g. models:/clip@champion
    name: str
    version: str
    run_id: str | None
    model_id: str | None  # the logged model it was registered from

    @property
    def fixed_uri(self) -> str:
        """The URI of exactly this version (an alias may move later)."""
        return f"models:/{self.name}/{self.version}"


@dataclass(frozen=True)
class CheckpointFiles:
    """A version's trained weights on local disk."""

    version: Version
    checkpoint: Path  # clip.ckpt
    run_config: Path  # clip.json
    tokenizer: Path  # the tokenizer.json it was trained with


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """(name, alias, version) of `models:/NAME@ALIAS` or `models:/NAME/VERSION`."""
    match = MODEL_URI.match(uri)
    if match is None:
        raise VersionError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    return match["name"], match["alias"], match["version"]


def is_model_uri(value: str | None) -> bool:
    return bool(value) and str(value).startswith("models:/")


def resolve(mlflow_client: Any, uri: str) -> Version:
    """The version `uri` names now. NoRegisteredModel when the model was never registered,
    VersionError for a missing alias or version of an existing model; registry errors
    propagate."""
    from mlflow.exceptions import MlflowException

    name, alias, number = parse_model_uri(uri)
    try:
        if alias is not None:
            found = mlflow_client.get_model_version_by_alias(name, alias)
        else:
            found = mlflow_client.get_model_version(name, number)
    except MlflowException as err:
        if err.error_code not in _NOT_FOUND:
            raise
        _require_model(mlflow_client, name, uri)
        what = f"no alias '{alias}'" if alias is not None else f"no version {number}"
        raise VersionError(f"{uri}: registered model '{name}' has {what}") from None
    return Version(uri, name, str(found.version), found.run_id or None, logged_model_id(found))


def logged_model_id(version: Any) -> str | None:
    """The id of the logged model a version was registered from. MLflow's SQL registry leaves the
    version's `model_id` empty and keeps the id in its source, `models:/<model_id>`."""
    if getattr(version, "model_id", None):
        return str(version.model_id)
    rest = (getattr(version, "source", None) or "").removeprefix("models:/")
    return rest if rest != version.source and rest and "/" not in rest else None


def _require_model(mlflow_client: Any, name: str, uri: str) -> None:
    """NoRegisteredModel if `name` does not exist; returns when it does."""
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code not in _NOT_FOUND:
            raise
        raise NoRegisteredModel(f"{uri}: there is no registered model '{name}' (no version "
                                "was ever registered)") from None


def bundle_folder(model_dir: Path) -> Path | None:
    """The bundle's folder in a downloaded pyfunc model, as its MLmodel file names it (MLflow
    keeps the source folder's name: artifacts/export for the pipeline's models/export)."""
    import yaml

    from registry.pyfunc import BUNDLE_ARTIFACT

    try:
        mlmodel = yaml.safe_load((model_dir / "MLmodel").read_text())
        relative = mlmodel["flavors"]["python_function"]["artifacts"][BUNDLE_ARTIFACT]["path"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    folder = (model_dir / relative).resolve()
    return folder if folder.is_relative_to(model_dir.resolve()) else None


def _download(artifact_uri: str, dst: Path, tracking_uri: str | None) -> Path:
    import mlflow

    dst.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(dst),
                                                    tracking_uri=tracking_uri))


def _model_root(mlflow_client: Any, version: Version) -> str:
    return str(mlflow_client.get_model_version_download_uri(version.name, version.version))


def download_bundle(mlflow_client: Any, version: Version, dst: Path | str) -> Path:
    """The version's export bundle (only it: not the index) in a folder under `dst`."""
    dst = Path(dst)
    root = _model_root(mlflow_client, version)
    uri = mlflow_client.tracking_uri
    _download(f"{root}/MLmodel", dst / "model", uri)
    relative = _bundle_relative(dst / "model", version)
    return _download(f"{root}/{relative}", dst / "model" / Path(relative).parent, uri)


def download_tokenizer(mlflow_client: Any, version: Version, dst: Path | str) -> Path:
    """The tokenizer.json of the version's export bundle (the file its text graph was exported
    with), without the MindIR graphs."""
    import json

    dst = Path(dst)
    root = _model_root(mlflow_client, version)
    uri = mlflow_client.tracking_uri
    _download(f"{root}/MLmodel", dst / "model", uri)
    relative = _bundle_relative(dst / "model", version)
    folder = dst / "model" / relative
    _download(f"{root}/{relative}/bundle.json", folder, uri)
    name = json.loads((folder / "bundle.json").read_text())["text_encoder"]["input"]["tokenizer"]
    if Path(name).name != name:
        raise VersionError(f"{version.fixed_uri}: bundle.json names tokenizer {name!r}, not a "
                           "file of the bundle")
    return _download(f"{root}/{relative}/{name}", folder, uri)


def _bundle_relative(model_dir: Path, version: Version) -> str:
    folder = bundle_folder(model_dir)
    if folder is None:
        raise VersionError(f"{version.fixed_uri}: its model has no export bundle (not logged by "
                           "registry.pyfunc?)")
    return folder.relative_to(model_dir.resolve()).as_posix()


def checkpoint_path(model_id: str) -> str:
    """Where `register` logs a version's checkpoint in its run's artifacts."""
    return f"{CHECKPOINT_ARTIFACT}/{model_id}"


def download_checkpoint(mlflow_client: Any, version: Version, dst: Path | str) -> CheckpointFiles:
    """The trained weights the version's bundle was exported from, in `dst`; VersionError when
    the version has none logged."""
    if version.run_id is None or version.model_id is None:
        raise VersionError(f"{version.uri} (v{version.version}): no run or logged model to find "
                           "a checkpoint in")
    where = checkpoint_path(version.model_id)
    present = {Path(item.path).name for item in mlflow_client.list_artifacts(version.run_id, where)}
    missing = [name for name in CHECKPOINT_FILES if name not in present]
    if missing:
        raise VersionError(
            f"{version.uri} (v{version.version}): no training checkpoint logged with it (missing "
            f"{missing} in run {version.run_id}'s artifacts {where}/; versions registered before "
            "checkpoints were logged with them have none): register a version with this "
            "pipeline first, or give train.init_from a checkpoint path")
    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    folder = _download(f"runs:/{version.run_id}/{where}", dst, mlflow_client.tracking_uri)
    files = [folder / name for name in CHECKPOINT_FILES]
    return CheckpointFiles(version, *files)
