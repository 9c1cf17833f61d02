"""Log the export bundle as an MLflow pyfunc model (models from code: nothing of ours is pickled).

The model's artifacts are exactly the export bundle (two MindIR graphs, tokenizer.json,
preprocess.json, bundle.json); its code is `registry/pyfunc_model.py` plus a copy of the `clipms`
package (so the model loads anywhere its pinned requirements are installed); a signature and an
input example (one caption, one base64 PNG) are logged with it.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

MODEL_CODE = Path(__file__).with_name("pyfunc_model.py")
CLIPMS_DIR = Path(__file__).resolve().parents[1] / "clipms"
BUNDLE_FILES = ("image_encoder.mindir", "text_encoder.mindir", "tokenizer.json",
                "preprocess.json", "bundle.json")
ALLOWED_SUFFIXES = (".mindir", ".json")
# The pyfunc's artifact key of the bundle: pyfunc_model.py reads context.artifacts["bundle"], and
# serving/source.py finds the bundle's folder under it in a downloaded model's MLmodel.
BUNDLE_ARTIFACT = "bundle"
# What clipms.deploy.infer needs at serving time; versions are pinned to the ones installed here.
REQUIREMENTS = ("mlflow", "mindspore", "numpy", "pandas", "pillow", "tokenizers", "ftfy", "regex",
                "pyyaml")


def check_bundle(bundle_dir: Path | str) -> Path:
    """The bundle folder, if complete and made only of MindIR/JSON files; else a clear error."""
    bundle = Path(bundle_dir)
    missing = [name for name in BUNDLE_FILES if not (bundle / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{bundle}: export bundle incomplete, missing {missing} "
                                "(run the export stage)")
    foreign = [p.name for p in bundle.rglob("*") if p.is_file()
               and p.suffix not in ALLOWED_SUFFIXES]
    if foreign:
        raise ValueError(f"{bundle}: only MindIR/JSON files may be packaged, found {foreign}")
    return bundle


def pinned_requirements() -> list[str]:
    pins = []
    for name in REQUIREMENTS:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            continue
    return pins


def example_image(size: int = 32) -> str:
    """A small base64 PNG (a red disc on grey) for the input example and smoke tests."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (128, 128, 128))
    ImageDraw.Draw(image).ellipse((size // 4, size // 4, 3 * size // 4, 3 * size // 4),
                                  fill=(220, 30, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def input_example() -> Any:
    import pandas as pd

    return pd.DataFrame({"text": ["a photo of a red circle"], "image": [example_image()]})


def signature() -> Any:
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema
    from mlflow.types.schema import Array

    inputs = Schema([ColSpec(DataType.string, "text", required=False),
                     ColSpec(DataType.string, "image", required=False)])
    outputs = Schema([ColSpec(Array(DataType.float), "text_embedding", required=False),
                      ColSpec(Array(DataType.float), "image_embedding", required=False)])
    return ModelSignature(inputs=inputs, outputs=outputs)


def _check_active_run(project_uri: str) -> None:
    """The caller's active run must live in the project's store: logging into a run that store
    has never seen ends in MLflow's "Run with id=... not found" half-way through; say which two
    stores disagree instead (e.g. mlflow.set_tracking_uri left pointing elsewhere)."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    active = mlflow.active_run()
    if active is None:
        raise RuntimeError("registry.pyfunc.log_model: give run_id, or call it inside an active "
                           "run (mlflow.start_run())")
    try:
        MlflowClient(tracking_uri=project_uri).get_run(active.info.run_id)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise RuntimeError(f"registry.pyfunc.log_model: the active run {active.info.run_id} "
                           f"was started against {mlflow.get_tracking_uri()!r} "
                           "(mlflow.set_tracking_uri), which is not the project's tracking "
                           f"URI {project_uri!r} (MLFLOW_TRACKING_URI): use one store for "
                           "both") from None


@contextmanager
def _fluent_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (the only way to log a pyfunc) at `uri` for the block, then put
    back what the caller had. Left set, the process-global URI outranks MLFLOW_TRACKING_URI in
    every later MLflow call of the process, which would then read and write the wrong store."""
    import mlflow
    from mlflow.tracking._tracking_service import utils  # MLflow has no public getter for it

    previous_global, previous_variable = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous_global)  # which also sets or unsets the variable
        if previous_variable is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous_variable


def log_model(bundle_dir: Path | str, name: str = "clip", run_id: str | None = None,
              step: int = 0) -> Any:
    """Log the bundle as a pyfunc into run `run_id` (opened against the project's tracking URI)
    or into the caller's active run, in the store that run lives in, at `step` (MLflow links the
    run's metrics of that step to the logged model); returns its ModelInfo."""
    import mlflow

    from tracking.settings import tracking_uri

    bundle = check_bundle(bundle_dir)
    if run_id is None:
        _check_active_run(tracking_uri())
    with tempfile.TemporaryDirectory() as tmp:
        code = Path(tmp) / "clipms"  # the package without bytecode caches
        shutil.copytree(CLIPMS_DIR, code, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        kwargs: dict[str, Any] = dict(
            name=name, python_model=str(MODEL_CODE), artifacts={BUNDLE_ARTIFACT: str(bundle)},
            code_paths=[str(code)], signature=signature(), input_example=input_example(),
            pip_requirements=pinned_requirements(), step=step)
        if run_id is None:
            return mlflow.pyfunc.log_model(**kwargs)
        with _fluent_tracking_uri(tracking_uri()), mlflow.start_run(run_id=run_id):
            return mlflow.pyfunc.log_model(**kwargs)
