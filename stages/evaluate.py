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

# tested by: tests/clipms/eval/test_scoring_run.py

from __future__ import annotations

import sys
import time

from clipms.eval.options import EvaluateParams
from clipms.model.architecture import DEFAULT_PRESET
from clipms.runtime import RuntimeConfig, configure
from pipeline import paths
from pipeline.params import ParamsError, load_section, read_params

READS = (paths.CHECKPOINT, paths.RUN_CONFIG, paths.TOKENIZER, paths.SHARDS_VAL, paths.MANIFEST,
         paths.MLFLOW_RUN)
WRITES = (paths.RECALL_CURVE, paths.RECALL_PLOT, paths.CONFUSION_CSV, paths.CONFUSION_PNG,
          paths.GALLERY, paths.CLIP_BENCHMARK, paths.EVAL_METRICS, paths.EVAL_QUALITY)


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
    from clipms.eval.metrics import MetricsInputError
    from clipms.eval.outputs import (
        EvalOutputs,
        GallerySpec,
        write_benchmark_files,
        write_gallery,
        write_outputs,
    )
    from clipms.eval.scoring import EvaluationError, evaluate
    from clipms.text.clip_tokenizer import Tokenizer
    from clipms.train.trained import RunConfig, TrainedModelError, load_clip

    zs = params.zeroshot
    spec = params.zeroshot_spec()
    shards, split, _ = paths.evaluation_set(params.split, params.pinned_set)
    out = EvalOutputs(metrics=paths.EVAL_METRICS, recall_curve=paths.RECALL_CURVE,
                      recall_plot=paths.RECALL_PLOT, predictions=paths.CONFUSION_CSV,
                      confusion_png=paths.CONFUSION_PNG, gallery_png=paths.GALLERY,
                      clip_benchmark_dir=paths.CLIP_BENCHMARK, quality_dir=paths.EVAL_QUALITY)
    g = params.gallery
    try:
        if params.pinned_set:  # a frozen set must be the one recorded, shard for shard
            from clipms.data.evalset import verify

            verify(shards)
        benchmark_run = BenchmarkRun(model=model_name, pretrained=str(paths.CHECKPOINT))
        run = RunConfig.read(paths.RUN_CONFIG)
        net = load_clip(paths.CHECKPOINT, run.model)
        report = evaluate(net, Tokenizer.load(paths.TOKENIZER), run.preprocess, shards,
                          params.batch_size, spec, split=split)
        write_outputs(report, out)
        files = write_benchmark_files(report, out.clip_benchmark_dir, dataset,
                                      params.clip_benchmark.zeroshot_dataset, benchmark_run)
        write_gallery(report, out.gallery_png, shards, split,
                      GallerySpec(g.text_queries, g.image_queries, g.top_k),
                      spec.label_fields if spec.source == "labels" else ())
    except (TrainedModelError, EvaluationError, MetricsInputError, BenchmarkFormatError,
            ValueError) as err:
        print(f"evaluate: error: {err}", file=sys.stderr)
        return 1
    from tracking.files import FILES
    from tracking.run import log_stage  # MLflow: the pipeline's run (docs/mlflow.md)

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
