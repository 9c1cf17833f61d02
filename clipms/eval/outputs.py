"""The files an evaluation writes: the flat metrics JSON, the same figures as a table of one row per
task (`quality_rows`), the recall@K curves (CSV + PNG), the per-image zero-shot rows (CSV) and
confusion matrix (PNG), the retrieval gallery (PNG, clipms.eval.gallery) and the same results as
CLIP_benchmark files (clipms.eval.clip_benchmark).

The caller names every path (`EvalOutputs`); nothing here has a default location.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from clipms.data.dataset import index_shards
from clipms.data.preprocess import decode_image
from clipms.eval import clip_benchmark
from clipms.eval.embed import EvaluationError
from clipms.eval.gallery import Gallery, build_gallery, render_gallery
from clipms.eval.scoring import EvalReport
from clipms.eval.zeroshot import class_names_from_labels
from clipms.utils.atomic import atomic_write, write_text
from clipms.utils.jsonio import write_json


@dataclass(frozen=True)
class EvalOutputs:
    metrics: Path  # flat JSON (DVC metrics)
    recall_curve: Path  # CSV k, i2t, t2i
    recall_plot: Path  # PNG of the same curves
    predictions: Path  # CSV actual, predicted (one row per zero-shot image)
    confusion_png: Path
    gallery_png: Path
    clip_benchmark_dir: Path  # one CLIP_benchmark JSON per dataset and task
    quality_dir: Path | None = None  # one JSON per task with the same short keys (quality_rows)

    @property
    def pictures(self) -> tuple[Path, ...]:
        return self.recall_plot, self.confusion_png, self.gallery_png


@dataclass(frozen=True)
class GallerySpec:
    text_queries: int = 6
    image_queries: int = 3
    top_k: int = 5


def _csv(path: Path, header: tuple[str, ...], rows: list[tuple]) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    write_text(path, buffer.getvalue())


# Short names of the table's columns: the flat key of each, with {task} for i2t/t2i and
# {zs} for `zeroshot` or `zeroshot_<attribute>`. Chance levels sit beside the figure they scale.
RETRIEVAL_COLUMNS = {"R@1": "{task}_R@1", "R@5": "{task}_R@5", "R@10": "{task}_R@10",
                     "R@5_chance": "chance_{task}_R@5"}
ZEROSHOT_COLUMNS = {"top1": "{zs}_top1", "top5": "{zs}_top5",
                    "class_recall": "{zs}_mean_per_class_recall",
                    "top1_chance": "chance_{zs}_top1"}


def quality_rows(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """The evaluation's figures as one row per task - `i2t`, `t2i`, `zeroshot` and one
    `zeroshot_<attribute>` per attribute - with the same short keys in every row, so that a table
    of the rows (`dvc metrics show metrics/quality`) is a few columns wide. The flat metrics
    (every key, ranks and counts too) stay what the registry and the summaries read."""
    rows: dict[str, dict[str, float]] = {}
    for task in ("i2t", "t2i"):
        row = _row(metrics, RETRIEVAL_COLUMNS, task=task)
        if task == "i2t" and "mAP@10" in metrics:
            row["mAP@10"] = metrics["mAP@10"]  # image -> text (clipms.eval.metrics)
        if row:
            rows[task] = row
    groups = sorted({k.removesuffix("_top1") for k in metrics
                     if k.startswith("zeroshot") and k.endswith("_top1")})
    for zs in groups:
        rows[zs] = _row(metrics, ZEROSHOT_COLUMNS, zs=zs)
    return rows


def _row(metrics: dict[str, float], columns: dict[str, str], **names: str) -> dict[str, float]:
    keys = {short: flat.format(**names) for short, flat in columns.items()}
    return {short: metrics[flat] for short, flat in keys.items() if flat in metrics}


def write_quality_rows(folder: Path, metrics: dict[str, float]) -> None:
    """`quality_rows` as `<folder>/<task>.json`; a task of an earlier run that this one did not
    score (an attribute no longer labelled) is removed, so the folder is this run's table."""
    rows = quality_rows(metrics)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.json"):
        if stale.stem not in rows:
            stale.unlink()
    for task, row in rows.items():
        write_json(folder / f"{task}.json", row)


def write_outputs(report: EvalReport, outputs: EvalOutputs) -> None:
    """metrics JSON (and its table), recall@K CSV + PNG, per-image zero-shot CSV and the
    confusion PNG."""
    write_json(outputs.metrics, report.metrics)
    if outputs.quality_dir is not None:
        write_quality_rows(outputs.quality_dir, report.metrics)
    _csv(outputs.recall_curve, ("k", "i2t", "t2i"),
         [(row["k"], row["i2t"], row["t2i"]) for row in report.recall_curve])
    _csv(outputs.predictions, ("actual", "predicted"),
         [(row["actual"], row["predicted"]) for row in report.predictions])
    plot_recall_curves(outputs.recall_plot, report)
    top1 = report.metrics.get("zeroshot_top1")
    title = ("zero-shot confusion (rows: true class)" if top1 is None else
             f"zero-shot confusion: top-1 {top1:.3f}, chance "
             f"{report.metrics['chance_zeroshot_top1']:.3f}")
    plot_confusion(outputs.confusion_png, report.confusion, report.class_names, title)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display here; and never pop up a window from a pipeline stage
    import matplotlib.pyplot as plt

    return plt


def plot_recall_curves(path: Path, report: EvalReport) -> None:
    """Recall@K of both directions against K, with the chance curve of t2i (K / images)."""
    plt = _pyplot()
    ks = [row["k"] for row in report.recall_curve]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(ks, [row["i2t"] for row in report.recall_curve], label="image -> text", marker=".")
    ax.plot(ks, [row["t2i"] for row in report.recall_curve], label="text -> image", marker=".")
    n_images = report.metrics["num_images"]
    ax.plot(ks, [min(k, n_images) / n_images for k in ks], label="chance (t2i)", color="grey",
            linestyle="--")
    ax.set(xlabel="K", ylabel="recall@K", ylim=(0, 1.02), xlim=(1, max(ks)))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"retrieval recall@K ({n_images} images, {report.metrics['num_captions']} "
                 "captions)", fontsize=9)
    fig.tight_layout()
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def plot_confusion(path: Path, matrix: np.ndarray | None, class_names: list[str],
                   title: str) -> None:
    """A PNG heat map of (true, predicted) counts (an empty note when zero-shot did not run)."""
    plt = _pyplot()
    size = 3 + 0.25 * len(class_names)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    if matrix is None or matrix.size == 0:
        ax.text(0.5, 0.5, "zero-shot evaluation did not run", ha="center", va="center")
        ax.set_axis_off()
    else:
        image = ax.imshow(matrix, cmap="Blues")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="images")
        ticks = range(len(class_names))
        fontsize = 8 if len(class_names) <= 20 else 5
        ax.set_xticks(ticks, class_names, rotation=90, fontsize=fontsize)
        ax.set_yticks(ticks, class_names, fontsize=fontsize)
        ax.set_xlabel("predicted class")
        ax.set_ylabel("true class")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def write_gallery(report: EvalReport, path: Path, shards_dir: Path | str, split: str,
                  spec: GallerySpec, label_fields: tuple[str, ...] = ()) -> Gallery:
    """Render the retrieval gallery of the split the report embedded (and return it).
    With `label_fields`, an image of the query's class counts as a hit (clipms.eval.gallery)."""
    val = report.embeddings
    if val is None:
        raise EvaluationError("the report holds no embeddings to draw a gallery from")
    index = index_shards(shards_dir, split)
    if index.keys != val.keys:
        raise EvaluationError(f"{shards_dir}: split {split!r} changed since it was embedded")
    classes = class_names_from_labels(val.labels, label_fields)[0] if label_fields else None
    gallery = build_gallery(val, classes, spec.text_queries, spec.image_queries, spec.top_k)

    def read_image(row: int) -> Image.Image:
        return decode_image(index.read(row)[0], name=f"{split}/{val.keys[row]}")

    hits = sum(found.hit for query in gallery.text_queries for found in query.results)
    title = (f"retrieval gallery: text -> image top-{spec.top_k} (hits {hits} of "
             f"{len(gallery.text_queries) * spec.top_k}), image -> text top-{spec.top_k}")
    render_gallery(path, gallery, val, read_image, title)
    return gallery


def write_benchmark_files(report: EvalReport, folder: Path, dataset: str,
                          zeroshot_dataset: str | None,
                          run: clip_benchmark.BenchmarkRun) -> list[str]:
    """The report as CLIP_benchmark result files: the retrieval on `dataset`, the main zero-shot
    set on `zeroshot_dataset` (None: `<dataset>/<label fields joined by ->`) and each attribute
    on `<dataset>/<field>`. Returns the file names."""
    results = []
    for task in report.tasks:
        if task.name:
            name = f"{dataset}/{task.name}"
        elif zeroshot_dataset:
            name = zeroshot_dataset
        elif task.fields:
            name = f"{dataset}/{'-'.join(task.fields)}"
        else:
            raise EvaluationError("evaluate.clip_benchmark.zeroshot_dataset: required for a "
                                  "folder or webdataset zero-shot set (its dataset name)")
        results.append(clip_benchmark.ClassificationResult(name, task.prefix, task.class_names,
                                                           task.templates))
    records = clip_benchmark.benchmark_records(report.metrics, dataset, results, run)
    clip_benchmark.write_records(folder, records)
    return sorted(records)
