"""Register the exported model: log it to the run, create a version, tag it, apply the gate."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from registry import gate, pyfunc
from registry.journal import mlflow_key
from registry.lineage import val_digest
from registry.run import PipelineRun
from registry.settings import client

MODEL_ARTIFACT = "clip"  # the logged model's name inside the run
INDEX_ARTIFACT = "index"  # the search index's folder among the run's artifacts (serving/ reads it)


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def register_version(run: PipelineRun, bundle_dir: Path | str, model_name: str,
                     primary_metric: str, margin: float,
                     eval_metrics: Mapping[str, Any],
                     index_dir: Path | str | None = None) -> dict[str, Any]:
    """Log + register the bundle as a new version of `model_name`; returns the gate's record.
    `index_dir` (the index stage's output) is logged beside it, so the version's run holds both."""
    import mlflow

    metrics = numeric(eval_metrics)
    if primary_metric not in metrics:
        raise KeyError(f"register.primary_metric '{primary_metric}' is not in the evaluation "
                       f"metrics; available: {sorted(metrics)}")
    run.require_sent()  # replays anything earlier stages could not send; raises if unreachable
    mlflow_client = client()
    info = pyfunc.log_model(bundle_dir, name=MODEL_ARTIFACT, run_id=run.run_id)
    if index_dir is not None:
        mlflow_client.log_artifacts(run.run_id, str(index_dir), INDEX_ARTIFACT)
    version = mlflow.register_model(info.model_uri, model_name)
    number = str(version.version)

    run_tags = mlflow_client.get_run(run.run_id).data.tags
    tags = {k: v for k, v in run_tags.items() if k.startswith("lineage.")}
    tags["lineage.val_digest"] = val_digest() or run_tags.get("lineage.val_digest", "")
    tags.update({f"metric.{mlflow_key(k)}": repr(v) for k, v in metrics.items()})
    tags["run_id"] = run.run_id or ""
    for key, value in tags.items():
        mlflow_client.set_model_version_tag(model_name, number, key, value)

    champion = gate.current_champion(mlflow_client, model_name, primary_metric)
    new = gate.Candidate(number, metrics[primary_metric], tags["lineage.val_digest"] or None)
    decision = gate.decide(new, champion, primary_metric, margin)
    gate.apply(mlflow_client, model_name, number, decision)

    record = {"model_name": model_name, "version": int(number), "run_id": run.run_id,
              "model_uri": f"models:/{model_name}/{number}", **decision.to_dict()}
    run.set_tags({"register.version": number, "register.decision": decision.alias,
                  "register.reason": decision.reason})
    run.log_metrics({"register.version": int(number),
                     "register.is_champion": int(decision.alias == gate.CHAMPION)})
    return record
