"""The evaluation results in LAION-AI/CLIP_benchmark's output format, so they drop into its tables.

CLIP_benchmark (`clip_benchmark eval`) writes one JSON file per (dataset, model, pretrained,
language, task), named by its default output template
`{dataset}_{pretrained}_{model}_{language}_{task}.json` (a `/` in the dataset name becomes `_`; a
pretrained path that names a file is reduced to its base name), holding
`{"dataset", "model", "pretrained", "task", "metrics", "language"}` (+ "classnames"/"templates"
with its --dump flags, which are always written here). `clip_benchmark build` reads those files.

Its metric definitions, and the keys of metrics/eval.json (clipms.eval.metrics) they equal:
- `zeroshot_retrieval`: `image_retrieval_recall@K` = share of captions whose image is among the K
  best images (`t2i_R@K`); `text_retrieval_recall@K` = share of images with at least one of their
  captions among the K best captions (`i2t_R@K`).
- `zeroshot_classification`: `acc1`, `acc5` = top-1/top-5 accuracy (`zeroshot_top1`/`_top5`;
  CLIP_benchmark writes NaN for acc5 below 5 classes, and so does this module);
  `mean_per_class_recall` = scikit-learn's balanced accuracy, the mean top-1 recall over the classes
  that have images (`zeroshot_mean_per_class_recall`).
Every value is a fraction in [0, 1], as CLIP_benchmark writes them.
"""

# tested by: tests/clipms/eval/test_scoring.py

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipms.utils.atomic import write_text

RETRIEVAL_TASK = "zeroshot_retrieval"
CLASSIFICATION_TASK = "zeroshot_classification"
OUTPUT_TEMPLATE = "{dataset}_{pretrained}_{model}_{language}_{task}.json"
RETRIEVAL_KS = (1, 5, 10)
# CLIP_benchmark name -> the suffix of the eval.json key after the task's prefix ("zeroshot_...")
CLASSIFICATION_METRICS = {"acc1": "top1", "acc5": "top5",
                          "mean_per_class_recall": "mean_per_class_recall"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+/-]*")


class BenchmarkFormatError(ValueError):
    """A name that cannot go into a CLIP_benchmark file name, or a metric that is missing."""


@dataclass(frozen=True)
class BenchmarkRun:
    """The identity columns of CLIP_benchmark's result rows."""

    model: str  # the architecture (CLIP_benchmark: an open_clip model name)
    pretrained: str  # the weights (a path or a tag)
    language: str = "en"

    def __post_init__(self) -> None:
        for name in (self.model, self.language):
            check_name(name)
        if not self.pretrained:
            raise BenchmarkFormatError("pretrained: empty (a checkpoint path or a tag)")


@dataclass(frozen=True)
class ClassificationResult:
    """A zero-shot classification whose metrics live in eval.json under `prefix` + suffix."""

    dataset: str
    prefix: str  # "zeroshot_" or "zeroshot_<field>_"
    class_names: Sequence[str]
    templates: Sequence[str]


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name) or ".." in name:
        raise BenchmarkFormatError(
            f"{name!r}: CLIP_benchmark names here are letters, digits and _ . + - / "
            "(starting with a letter or digit, no '..')")
    return name


def output_name(dataset: str, run: BenchmarkRun, task: str) -> str:
    """The file name CLIP_benchmark's default `--output` template gives."""
    pretrained = run.pretrained
    if Path(pretrained).is_file():  # as CLIP_benchmark: a checkpoint path -> its base name
        pretrained = Path(pretrained).name
    return OUTPUT_TEMPLATE.format(dataset=check_name(dataset).replace("/", "_"),
                                  pretrained=check_name(pretrained).replace("/", "_"),
                                  model=run.model,
                                  language=run.language, task=task)


def _value(metrics: Mapping[str, float], key: str) -> float:
    if key not in metrics:
        raise BenchmarkFormatError(f"metric {key!r} is not in the evaluation results")
    return float(metrics[key])


def retrieval_record(metrics: Mapping[str, float], dataset: str,
                     run: BenchmarkRun) -> dict[str, Any]:
    found = {}
    for k in RETRIEVAL_KS:
        found[f"image_retrieval_recall@{k}"] = _value(metrics, f"t2i_R@{k}")
        found[f"text_retrieval_recall@{k}"] = _value(metrics, f"i2t_R@{k}")
    return _record(dataset, run, RETRIEVAL_TASK, found)


def classification_record(metrics: Mapping[str, float], result: ClassificationResult,
                          run: BenchmarkRun) -> dict[str, Any]:
    found = {}
    for name, suffix in CLASSIFICATION_METRICS.items():
        key = result.prefix + suffix
        # acc5 needs >= 5 classes: clipms leaves it out, CLIP_benchmark writes NaN.
        found[name] = math.nan if name == "acc5" and key not in metrics else _value(metrics, key)
    record = _record(result.dataset, run, CLASSIFICATION_TASK, found)
    record["classnames"] = list(result.class_names)
    record["templates"] = list(result.templates)
    return record


def _record(dataset: str, run: BenchmarkRun, task: str, found: dict[str, float]) -> dict[str, Any]:
    return {"dataset": check_name(dataset), "model": run.model, "pretrained": run.pretrained,
            "task": task, "metrics": found, "language": run.language}


def benchmark_records(metrics: Mapping[str, float], retrieval_dataset: str,
                      classifications: Sequence[ClassificationResult],
                      run: BenchmarkRun) -> dict[str, dict[str, Any]]:
    """{file name: record} for the retrieval results and each zero-shot classification."""
    records = [retrieval_record(metrics, retrieval_dataset, run)]
    records += [classification_record(metrics, result, run) for result in classifications]
    named = {output_name(r["dataset"], run, r["task"]): r for r in records}
    if len(named) != len(records):
        raise BenchmarkFormatError(f"two results share a file name: {sorted(named)}")
    return named


def write_records(folder: Path | str, records: Mapping[str, dict[str, Any]]) -> None:
    """Write each record as CLIP_benchmark does (`json.dump`, NaN allowed); remove the .json
    files of an earlier run that this run did not write, so the folder is this run's results."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, record in records.items():
        write_text(folder / name, json.dumps(record))
    for stale in folder.glob("*.json"):
        if stale.name not in records:
            stale.unlink()
