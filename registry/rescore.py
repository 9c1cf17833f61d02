"""Score a registered version on an evaluation set it was not scored on: the gate's re-scoring.

When the data grows, new images hash into the val split too, so a new version is evaluated on
another set than the champion was. Before deciding, the gate scores the champion again on the new
version's set (as MLflow's evaluate scores a baseline model on the candidate's data): the
champion's export bundle is downloaded from the registry (`registry.versions`: its MindIR graphs,
its own tokenizer and preprocessing), opened with `clipms.deploy.infer.Encoder`, and scored by
`clipms.eval.scoring.evaluate_towers`, the code the `evaluate` stage runs, with the same shards,
split, batch size and zero-shot settings. So every metric `evaluate` writes, retrieval and
zero-shot alike, can be the primary one.

It runs on CPU in the register process, with the Encoder's defaults: that process has already
loaded the new version's pyfunc there (MLflow checks the input example when it logs the model),
and MindSpore picks one device per process. The new version's value comes from its checkpoint
(the evaluate stage), the champion's from its MindIR graphs; export's parity check holds the two
to a max abs error of 1e-5 on the embeddings (fp32).

Anything that goes wrong - the bundle cannot be downloaded or loaded, the set cannot be read, the
metric is missing - is a `RescoreError` (a `GateError`): `register` fails and no alias moves.
"""

# not unit-tested: the gate calls it against a real registry;
# tests/registry/test_gate_mlflow.py re-scores a champion on a new set.

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry import gate

if TYPE_CHECKING:
    from clipms.eval.scoring import ZeroShotSpec


class RescoreError(gate.GateError):
    """The champion could not be re-scored on the new version's evaluation set."""


@dataclass(frozen=True)
class EvaluationSet:
    """The set the `evaluate` stage scored the new version on, and how it scored it."""

    shards_dir: Path  # a folder in the shard stage's format (manifest.json + <split>/*.tar)
    split: str
    digest: str | None  # tracking.lineage.val_digest of that split: which samples, exactly
    name: str  # how decisions name it, e.g. "split val of data/shards"
    zeroshot: ZeroShotSpec
    batch_size: int


def source_label(model_name: str, version: str, digest: str | None) -> str:
    """Where a re-scored value came from, as the decision records it."""
    return (f"re-scored from models:/{model_name}/{version} (its registered MindIR bundle) on "
            f"evaluation set {digest}")


def rescore(mlflow_client: Any, model_name: str, champion: gate.Candidate,
            evaluation_set: EvaluationSet, primary_metric: str) -> gate.Candidate:
    """`champion` with its `primary_metric` scored on `evaluation_set`; RescoreError otherwise."""
    where = (f"champion v{champion.version} of '{model_name}' on this version's evaluation set "
             f"{evaluation_set.name} ({evaluation_set.digest})")
    try:
        metrics = _score(mlflow_client, model_name, champion.version, evaluation_set)
    except Exception as err:  # a download, a broken bundle, unreadable shards: never a pass
        raise RescoreError(f"could not re-score {where}: {gate.first_line(err)}; no alias was "
                           "moved") from err
    return rescored_on(model_name, champion, evaluation_set, primary_metric, metrics)


def rescored_on(model_name: str, champion: gate.Candidate, evaluation_set: EvaluationSet,
                primary_metric: str, metrics: dict[str, float]) -> gate.Candidate:
    """`champion` carrying its `primary_metric` from `metrics` (its scores on `evaluation_set`),
    labelled with that set's digest: the new version's, so the gate compares the two."""
    value = metrics.get(primary_metric)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RescoreError(
            f"could not re-score champion v{champion.version} of '{model_name}' on this "
            f"version's evaluation set {evaluation_set.name} ({evaluation_set.digest}): the "
            f"evaluation gave no '{primary_metric}' (register.primary_metric; it gave "
            f"{sorted(metrics)[:12]}...); no alias was moved")
    return gate.rescored(champion, float(value), str(evaluation_set.digest),
                         source_label(model_name, champion.version, evaluation_set.digest))


def _score(mlflow_client: Any, model_name: str, version: str,
           evaluation_set: EvaluationSet) -> dict[str, float]:
    """Every metric of the `evaluate` stage, for the registered version's bundle."""
    from clipms.deploy.infer import Encoder
    from clipms.eval.scoring import evaluate_towers
    from registry.versions import download_bundle, resolve

    found = resolve(mlflow_client, f"models:/{model_name}/{version}")
    with tempfile.TemporaryDirectory(prefix=f"clipms-rescore-v{version}-") as tmp:
        encoder = Encoder(download_bundle(mlflow_client, found, tmp),
                          batch_size=evaluation_set.batch_size)
        report = evaluate_towers(encoder, encoder.preprocess, evaluation_set.shards_dir,
                                 evaluation_set.batch_size, evaluation_set.zeroshot,
                                 evaluation_set.split)
    return report.metrics
