"""Register the exported model: log it to the run, create a version, tag it, apply the gate.

The gate runs under the registry's lock (`registry.gatelock`) and reads the champion there, after
this version exists, so two registrations racing against one registry compare in turn, never
against the same old champion. When the champion was scored on another evaluation set, it is
re-scored on this version's (`registry.rescore`) there too, so the value compared is always the
current champion's (another registration waits up to `register.lock_timeout` meanwhile). It
fails closed (`gate.GateError`): no alias moves.

The training checkpoint the bundle was exported from (clip.ckpt, clip.json, tokenizer.json) is
logged with the version, into its run under `checkpoint/<logged model id>/`
(`registry.versions`), so a later night can warm-start from it.
"""

# tested by: tests/registry/test_carryover.py

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipms.eval.metrics import metric_direction
from clipms.utils.redact import redact_text
from registry import gate, index_store, pyfunc
from registry.gatelock import gate_lock
from registry.retention import LINEAGE_ARTIFACT
from registry.versions import checkpoint_path
from tracking.journal import mlflow_key, now_ms
from tracking.lineage import val_digest
from tracking.run import PipelineRun
from tracking.settings import RegisterParams, client, tracking_uri

if TYPE_CHECKING:
    from registry.rescore import EvaluationSet

MODEL_ARTIFACT = "clip"  # the logged model's name inside the run
# MLflow's log_model links every run metric of the model's step to the logged model. Step 0 holds
# every stage's summary (counts, chance levels, train and export figures), so the model is logged
# at a step no stage uses and only the quality metrics are linked to it, at that step.
MODEL_STEP = -1


MODEL_DESCRIPTION_START = "CLIP image-text embedding model (MindSpore, exported MindIR)"
MODEL_DESCRIPTION = (
    MODEL_DESCRIPTION_START + " registered by the clipms pipeline's register stage. Alias "
    "`champion`: the version the gate promoted, best `{metric}` ({better} is better, margin "
    "{margin:g}) on the same evaluation set (tag `lineage.val_digest`; a champion scored on "
    "another set is re-scored on the new version's first); `challenger`: the latest "
    "version that did not beat it. Each version's description is the gate's decision; its tags "
    "are its lineage and the gate's inputs; its metrics are on its logged model (experiment > "
    "Models).")


class RegistryError(RuntimeError):
    """The registry failed before the gate ran (logging, registering or tagging the version)."""


_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


@contextmanager
def _quiet_log_model() -> Iterator[None]:
    """log_model reloads the model to check its input example and says so at INFO, then draws a
    download bar of the bundle's files on stderr: a stage's output the user cannot act on. Its
    warnings and errors still show."""
    bar = os.environ.get(_PROGRESS_BAR)
    os.environ.setdefault(_PROGRESS_BAR, "false")
    logger = logging.getLogger("mlflow.pyfunc")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
        if bar is None:  # the caller's environment, as it was: later MLflow calls draw their bars
            os.environ.pop(_PROGRESS_BAR, None)


@contextmanager
def _step(what: str) -> Iterator[None]:
    try:
        yield
    except Exception as err:  # an HTTP 5xx, a timeout, a locked database: say which step
        text = str(err).strip()
        raise RegistryError(f"the registry failed while {what} ({type(err).__name__}: "
                            f"{text.splitlines()[0][:300] if text else ''}); no alias was "
                            "moved") from err


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def quality_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics that rank models (counts and chance levels left out), under MLflow's names."""
    return {mlflow_key(k): v for k, v in metrics.items() if metric_direction(k)}


def link_metrics(mlflow_client: Any, run_id: str, model_id: str,
                 metrics: Mapping[str, float]) -> None:
    """The evaluation metrics again, attached to the logged model (MLflow 3's LoggedModel
    metrics): the experiment's Models view and `search_logged_models` compare versions by them."""
    from mlflow.entities import Metric

    now = now_ms()
    mlflow_client.log_batch(run_id, metrics=[
        Metric(key, value, now, MODEL_STEP, model_id=model_id)
        for key, value in quality_metrics(metrics).items()])


def version_tags(run_tags: Mapping[str, str], digest: str | None, primary_metric: str,
                 metrics: Mapping[str, float], eval_set_name: str | None = None) -> dict[str, str]:
    """A version's tags: its lineage (from the run) and the gate's inputs (the val digest and
    the name of that evaluation set, the primary metric's value). Every other metric is on the
    logged model, not in the tags."""
    tags = {k: v for k, v in run_tags.items() if k.startswith("lineage.")}
    tags["lineage.val_digest"] = digest or run_tags.get("lineage.val_digest", "")
    if eval_set_name:
        tags["lineage.eval_set"] = eval_set_name
    tags[gate.metric_tag(primary_metric)] = repr(metrics[primary_metric])
    return tags


def log_checkpoint(mlflow_client: Any, run_id: str, model_id: str,
                   files: Sequence[Path | str]) -> None:
    """The trained weights behind the bundle, beside it in the run (registry.versions reads
    them back for a warm start)."""
    for path in files:
        mlflow_client.log_artifact(run_id, str(path), checkpoint_path(model_id))


def log_lineage_lock(mlflow_client: Any, run_id: str, model_id: str, lock: Path) -> None:
    """The pipeline's dvc.lock as this version was made, beside it in the run (none: nothing).
    Its params hold the source URLs as given, signatures and tokens included: those are redacted
    (retention reads only the outs' digests)."""
    if lock.is_file():
        mlflow_client.log_text(run_id, redact_text(lock.read_text()),
                               f"{LINEAGE_ARTIFACT}/{model_id}/{lock.name}")


def log_index(mlflow_client: Any, run_id: str, model_id: str,
              index_dir: Path | str) -> dict[str, int]:
    """The index's chunks the store lacks, then its reference into the logged model; what it
    cost: {"index_bytes": the index's size, "index_added_bytes": what was uploaded}."""
    experiment_id = mlflow_client.get_run(run_id).info.experiment_id
    ref = index_store.store_index(mlflow_client, experiment_id, index_dir)
    with tempfile.TemporaryDirectory(prefix="clipms-index-ref-") as tmp:
        index_store.write_ref(ref, Path(tmp))
        mlflow_client.log_model_artifacts(model_id, tmp, index_store.INDEX_ARTIFACT)
    # A retention sweep that read the references before this one was logged may have removed a
    # chunk this index re-used; now that the reference is visible to every later sweep, store
    # again whatever the store no longer holds.
    again = index_store.store_index(mlflow_client, experiment_id, index_dir)
    return {"index_bytes": ref["total_bytes"],
            "index_added_bytes": ref["added_bytes"] + again["added_bytes"]}


def describe_model(mlflow_client: Any, params: RegisterParams) -> None:
    """The registered model's description, unless someone wrote another one."""
    text = MODEL_DESCRIPTION.format(metric=params.primary_metric,
                                    better=metric_direction(params.primary_metric),
                                    margin=params.margin)
    current = mlflow_client.get_registered_model(params.model_name).description or ""
    if current != text and (not current or current.startswith(MODEL_DESCRIPTION_START)):
        mlflow_client.update_registered_model(params.model_name, description=text)


def register_version(run: PipelineRun, bundle_dir: Path | str, params: RegisterParams,
                     eval_metrics: Mapping[str, Any],
                     index_dir: Path | str | None = None,
                     evaluation_set: EvaluationSet | None = None,
                     checkpoint_files: Sequence[Path | str] = ()) -> dict[str, Any]:
    """Log + register the bundle as a new version of `params.model_name`; returns the gate's
    record. GateError (before anything is logged) for a primary metric evaluate did not write.
    `index_dir` (the index stage's output) is logged into the logged model, and
    `checkpoint_files` (the stage passes clip.ckpt, clip.json, tokenizer.json) beside it in the
    run, before the version exists: the stage never registers a version without them (a warm
    start from one registered without them fails, naming it). `evaluation_set` is the set
    `eval_metrics` were computed on; the champion is re-scored on it when it was scored on
    another one (None: the shard manifest's val split names the set, and nothing can be
    re-scored)."""
    import mlflow

    metrics = numeric(eval_metrics)
    direction = gate.primary_direction(params.primary_metric, metrics)
    run.require_sent()  # replays anything earlier stages could not send; raises if unreachable
    mlflow_client = client()
    # log_model checks the input example by running the model here, tokenising its two texts; HF
    # tokenizers' Rust pool does not survive a later fork and prints a warning the user cannot act
    # on (seen once in register on a fresh tiny `dvc repro`; three reruns did not fork). Two texts
    # need no pool, as in the export stage.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with _step("logging the model"), _quiet_log_model():
        info = pyfunc.log_model(bundle_dir, name=MODEL_ARTIFACT, run_id=run.run_id,
                                step=MODEL_STEP)
        index = None if index_dir is None else log_index(mlflow_client, run.run_id,
                                                         info.model_id, index_dir)
        log_checkpoint(mlflow_client, run.run_id, info.model_id, checkpoint_files)
        log_lineage_lock(mlflow_client, run.run_id, info.model_id, run.files.lock)
        link_metrics(mlflow_client, run.run_id, info.model_id, metrics)
    with _step(f"registering a new version of '{params.model_name}'"):
        number = str(mlflow.register_model(info.model_uri, params.model_name).version)
        describe_model(mlflow_client, params)
    digest = evaluation_set.digest if evaluation_set else val_digest(run.files.manifest)
    set_name = evaluation_set.name if evaluation_set else None
    with _step(f"tagging version {number}"):
        tags = version_tags(mlflow_client.get_run(run.run_id).data.tags, digest,
                            params.primary_metric, metrics, set_name)
        for key, value in tags.items():
            mlflow_client.set_model_version_tag(params.model_name, number, key, value)

    new = gate.Candidate(number, metrics[params.primary_metric],
                         tags["lineage.val_digest"] or None, gate.EVALUATED_IN_THIS_RUN)
    with gate_lock(tracking_uri(), params.model_name, params.lock_timeout) as lock:
        champion = _comparable(mlflow_client, params, new,
                               gate.current_champion(mlflow_client, params.model_name,
                                                     params.primary_metric), evaluation_set)
        decision = gate.decide(new, champion, params.primary_metric, params.margin, direction,
                               set_name)
        gate.apply(mlflow_client, params.model_name, number, decision)

    record = {"model_name": params.model_name, "version": int(number), "run_id": run.run_id,
              "model_uri": f"models:/{params.model_name}/{number}", "lock": lock,
              **(index or {}), **decision.to_dict()}
    run.set_tags({"register.version": number, "register.decision": decision.alias,
                  "register.reason": decision.reason})
    run.log_metrics({"register.version": int(number),
                     "register.is_champion": int(decision.alias == gate.CHAMPION)})
    return record


def _comparable(mlflow_client: Any, params: RegisterParams, new: gate.Candidate,
                champion: gate.Candidate | None,
                evaluation_set: EvaluationSet | None) -> gate.Candidate | None:
    """The champion with a value on the new version's evaluation set: as recorded, or re-scored
    there when it was scored on another set (RescoreError when that fails). Without a set to
    score on, as recorded (the gate then declines to compare)."""
    if evaluation_set is None or champion is None or not gate.needs_rescore(new, champion):
        return champion
    from registry.rescore import rescore

    return rescore(mlflow_client, params.model_name, champion, evaluation_set,
                   params.primary_metric)
