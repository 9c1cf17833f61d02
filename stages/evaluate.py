"""Stage `evaluate`: retrieval (every caption) and zero-shot classification of the model.

`python -m stages.evaluate`; reads the `evaluate` and `runtime` sections (and `metadata.source`,
`train.preset` for the names in the CLIP_benchmark files). Inputs: models/clip.ckpt,
models/clip.json, models/tokenizer.json and the evaluated split of data/shards. Outputs:
metrics/eval.json (flat keys: i2t_R@1/5/10, t2i_R@1/5/10, mAP@10, ranks, zeroshot_*,
zeroshot_<field>_* per attribute, counts and chance_* levels), metrics/quality/ (the same figures
as one row per task: `dvc metrics show metrics/quality`), metrics/clip_benchmark/ (the same
results as CLIP_benchmark JSON files), plots/recall_at_k.csv + .png, plots/confusion_matrix.csv (one
row per image: actual, predicted) + .png, and plots/retrieval_gallery.png.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Literal

from pydantic import Field, field_validator

from clipms.model.config import DEFAULT_PRESET
from clipms.runtime import RuntimeConfig, configure
from clipms.schema import Section
from pipeline.params import ParamsError, load_section, read_params
from stages import paths

READS = (paths.CHECKPOINT, paths.RUN_CONFIG, paths.TOKENIZER, paths.SHARDS_VAL, paths.MANIFEST,
         paths.MLFLOW_RUN)
WRITES = (paths.RECALL_CURVE, paths.RECALL_PLOT, paths.CONFUSION_CSV, paths.CONFUSION_PNG,
          paths.GALLERY, paths.CLIP_BENCHMARK, paths.EVAL_METRICS, paths.EVAL_QUALITY)
_FIELD = re.compile(r"[A-Za-z0-9_]+")


def _checked_templates(templates: list[str]) -> list[str]:
    missing = [t for t in templates if "{}" not in t]
    if missing:
        raise ValueError(f"templates need a '{{}}' placeholder for the class name: {missing}")
    return templates


class ZeroShotParams(Section):
    source: Literal["labels", "folder", "webdataset", "none"] = "labels"
    label_fields: list[str] = Field(default_factory=lambda: ["colour", "shape"], min_length=1)
    templates: list[str] = Field(default_factory=lambda: ["a picture of a {}."], min_length=1)
    path: str | None = None
    class_names: list[str] | None = None
    # label field -> its prompt templates: one zero-shot classification per field
    attributes: dict[str, list[str]] = Field(default_factory=dict)

    _templates = field_validator("templates")(_checked_templates)

    @field_validator("attributes")
    @classmethod
    def _attribute_fields(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, templates in value.items():
            if not _FIELD.fullmatch(name):
                raise ValueError(f"{name!r}: a label field name is letters, digits and _")
            if not templates:
                raise ValueError(f"{name}: needs at least one prompt template")
            _checked_templates(templates)
        return value


class GalleryParams(Section):
    text_queries: int = Field(6, ge=0, le=24)  # captions whose top-K images are shown
    image_queries: int = Field(3, ge=0, le=12)  # images whose top-K captions are shown
    top_k: int = Field(5, ge=1, le=10)


class ClipBenchmarkParams(Section):
    dataset: str | None = None  # null: <metadata.source>_<split>
    zeroshot_dataset: str | None = None  # null: <dataset>/<label fields> (source: labels)
    model: str | None = None  # null: clipms-<train.preset>


class EvaluateParams(Section):
    batch_size: int = Field(128, ge=1)
    split: str = "val"
    zeroshot: ZeroShotParams = ZeroShotParams()
    gallery: GalleryParams = GalleryParams()
    clip_benchmark: ClipBenchmarkParams = ClipBenchmarkParams()


def benchmark_names(params: EvaluateParams) -> tuple[str, str]:
    """(dataset, model) of the CLIP_benchmark files: given, or from metadata.source/train.preset."""
    others = read_params()
    source = (others.get("metadata") or {}).get("source", "synthetic")
    preset = (others.get("train") or {}).get("preset", DEFAULT_PRESET)
    names = params.clip_benchmark
    return names.dataset or f"{source}_{params.split}", names.model or f"clipms-{preset}"


def main() -> int:
    started = time.perf_counter()
    try:
        params = load_section("evaluate", EvaluateParams)
        dataset, model_name = benchmark_names(params)
        runtime = load_section("runtime", RuntimeConfig)
    except ParamsError as err:
        print(f"evaluate: error: {err}", file=sys.stderr)
        return 1
    configure(runtime)  # the device and mode of the `runtime` section, before any graph compiles
    from clipms.eval.clip_benchmark import BenchmarkFormatError, BenchmarkRun
    from clipms.eval.evaluate import EvaluationError, ZeroShotSpec, evaluate
    from clipms.eval.metrics import MetricsInputError
    from clipms.eval.outputs import (
        EvalOutputs,
        GallerySpec,
        write_benchmark_files,
        write_gallery,
        write_outputs,
    )
    from clipms.text.tokenizer import Tokenizer
    from clipms.train.trained import RunConfig, TrainedModelError, load_clip

    zs = params.zeroshot
    spec = ZeroShotSpec(source=zs.source, templates=tuple(zs.templates),
                        label_fields=tuple(zs.label_fields), path=zs.path,
                        class_names=tuple(zs.class_names) if zs.class_names else None,
                        attributes=tuple((f, tuple(t)) for f, t in zs.attributes.items()))
    out = EvalOutputs(metrics=paths.EVAL_METRICS, recall_curve=paths.RECALL_CURVE,
                      recall_plot=paths.RECALL_PLOT, predictions=paths.CONFUSION_CSV,
                      confusion_png=paths.CONFUSION_PNG, gallery_png=paths.GALLERY,
                      clip_benchmark_dir=paths.CLIP_BENCHMARK, quality_dir=paths.EVAL_QUALITY)
    g = params.gallery
    try:
        benchmark_run = BenchmarkRun(model=model_name, pretrained=str(paths.CHECKPOINT))
        run = RunConfig.read(paths.RUN_CONFIG)
        net = load_clip(paths.CHECKPOINT, run.model)
        report = evaluate(net, Tokenizer.load(paths.TOKENIZER), run.preprocess, paths.SHARDS,
                          params.batch_size, spec, split=params.split)
        write_outputs(report, out)
        files = write_benchmark_files(report, out.clip_benchmark_dir, dataset,
                                      params.clip_benchmark.zeroshot_dataset, benchmark_run)
        write_gallery(report, out.gallery_png, paths.SHARDS, params.split,
                      GallerySpec(g.text_queries, g.image_queries, g.top_k),
                      spec.label_fields if spec.source == "labels" else ())
    except (TrainedModelError, EvaluationError, MetricsInputError, BenchmarkFormatError,
            ValueError) as err:
        print(f"evaluate: error: {err}", file=sys.stderr)
        return 1
    from registry.run import log_stage  # MLflow: the pipeline's run (docs/mlflow.md)
    from stages.tracking import FILES

    artifacts = [(p, "plots") for p in (out.recall_curve, out.predictions, *out.pictures)]
    artifacts += [(out.clip_benchmark_dir / name, "clip_benchmark") for name in files]
    log_stage("evaluate", params.model_dump(), FILES, report.metrics, artifacts)
    print_summary(report.metrics, time.perf_counter() - started, list(zs.attributes))
    return 0


def print_summary(m: dict[str, float], seconds: float, attributes: list[str]) -> None:
    print(f"evaluate: {m['num_images']} images, {m['num_captions']} captions in {seconds:.1f} s")
    keys = ["i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5", "mAP@10", "zeroshot_top1"]
    keys += [f"zeroshot_{name}_top1" for name in attributes]
    for key in keys:
        if key in m:
            print(f"  {key:<22} {m[key]:.4f}   (chance {m[f'chance_{key}']:.4f})")


if __name__ == "__main__":
    sys.exit(main())
