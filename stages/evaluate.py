"""Stage `evaluate`: retrieval (every val caption) and zero-shot classification of the model.

`python -m stages.evaluate`; reads the `evaluate` section. Inputs: models/clip.ckpt,
models/clip.json, models/tokenizer.json and the val split of data/shards. Outputs:
metrics/eval.json (flat keys: i2t_R@1/5/10, t2i_R@1/5/10, mAP@10, ranks, zeroshot_*, counts and
chance_* levels),
plots/recall_at_k.csv, plots/confusion_matrix.csv (one row per image: actual, predicted) and
plots/confusion_matrix.png.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from stages.params import ParamsError, Section, load_section

CHECKPOINT = Path("models/clip.ckpt")
RUN_CONFIG = Path("models/clip.json")
TOKENIZER = Path("models/tokenizer.json")
SHARDS_DIR = Path("data/shards")


class ZeroShotParams(Section):
    source: Literal["labels", "folder", "webdataset", "none"] = "labels"
    label_fields: list[str] = Field(default_factory=lambda: ["colour", "shape"], min_length=1)
    templates: list[str] = Field(default_factory=lambda: ["a picture of a {}."], min_length=1)
    path: str | None = None
    class_names: list[str] | None = None


class EvaluateParams(Section):
    batch_size: int = Field(128, ge=1)
    split: str = "val"
    zeroshot: ZeroShotParams = ZeroShotParams()


def main() -> int:
    started = time.perf_counter()
    try:
        params = load_section("evaluate", EvaluateParams)
    except ParamsError as err:
        print(f"evaluate: error: {err}", file=sys.stderr)
        return 1
    from clipms.evaluation import EvaluationError, ZeroShotSpec, evaluate, write_outputs
    from clipms.metrics import MetricsInputError
    from clipms.tokenizer import Tokenizer
    from clipms.trained import RunConfig, TrainedModelError, load_clip

    zs = params.zeroshot
    spec = ZeroShotSpec(source=zs.source, templates=tuple(zs.templates),
                        label_fields=tuple(zs.label_fields), path=zs.path,
                        class_names=tuple(zs.class_names) if zs.class_names else None)
    try:
        run = RunConfig.read(RUN_CONFIG)
        net = load_clip(CHECKPOINT, run.model)
        report = evaluate(net, Tokenizer.load(TOKENIZER), run.preprocess, SHARDS_DIR,
                          params.batch_size, spec, split=params.split)
    except (TrainedModelError, EvaluationError, MetricsInputError, ValueError) as err:
        print(f"evaluate: error: {err}", file=sys.stderr)
        return 1
    write_outputs(report)
    from clipms.evaluation import EvalOutputs
    from registry.run import log_stage  # MLflow: the pipeline's run (docs/mlflow.md)

    out = EvalOutputs()
    log_stage("evaluate", params.model_dump(), report.metrics,
              [(p, "plots") for p in (out.recall_curve, out.predictions, out.confusion_png)])
    m = report.metrics
    print(f"evaluate: {m['num_images']} images, {m['num_captions']} captions in "
          f"{time.perf_counter() - started:.1f} s")
    for key in ("i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5", "mAP@10", "zeroshot_top1"):
        if key in m:
            print(f"  {key:<14} {m[key]:.4f}   (chance {m[f'chance_{key}']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
