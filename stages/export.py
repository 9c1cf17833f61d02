"""Stage `export`: the two towers as MindIR (dynamic batch) + tokenizer + preprocessing spec in
models/export/, then a parity check of each MindIR graph against the checkpoint on real val samples.

`python -m stages.export`; reads the `export` and `runtime` sections. `export.precision` (fp32 |
fp16) is the bundle's; the parity bar is that precision's (clipms.deploy.mindir.PARITY) unless
`export.tolerance` is set. The gate is computed on the host CPU, where the bars were calibrated;
on a device (runtime.device_target GPU/Ascend) the device's own errors are recorded beside it as
`device_*`, not gated (clipms.deploy.hostparity says why). Fails (exit 1) when an error exceeds
the bar; metrics/export.json holds the errors either way.
"""

# tested by: tests/clipms/deploy/test_mindir.py

from __future__ import annotations

import os
import sys
import time
from typing import Literal

import numpy as np
from pydantic import Field

from clipms.runtime import RuntimeConfig, configure, for_precision
from clipms.schema import Section
from pipeline import paths
from pipeline.params import ParamsError, load_section

READS = (paths.CHECKPOINT, paths.RUN_CONFIG, paths.TOKENIZER, paths.SHARDS_VAL, paths.MANIFEST,
         paths.MLFLOW_RUN)
WRITES = (paths.BUNDLE, paths.EXPORT_METRICS)


class ExportParams(Section):
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 7, 32], min_length=1)
    precision: Literal["fp32", "fp16"] = "fp32"  # of the MindIR graphs (I/O stay float32)
    # null: the precision's bar (clipms.deploy.mindir.PARITY)
    tolerance: float | None = Field(None, gt=0)
    split: str = "val"  # where the real parity samples come from


def parity_inputs(params: ExportParams, preprocess, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The first max(batch_sizes) images of the split and all their captions, model-ready."""
    from clipms.data.dataset import iter_eval_batches

    wanted = max(params.batch_sizes)
    batch = next(iter_eval_batches(paths.SHARDS, preprocess, wanted, split=params.split), None)
    if batch is None:
        raise ValueError(f"{paths.SHARDS}: split {params.split!r} has no samples to check against")
    captions = [caption for captions in batch.captions for caption in captions]
    return batch.images, tokenizer.encode(captions[:wanted])


def main() -> int:
    started = time.perf_counter()
    try:
        params = load_section("export", ExportParams)
        if min(params.batch_sizes) < 1:
            raise ParamsError(f"export.batch_sizes = {params.batch_sizes}: sizes must be >= 1")
        runtime = load_section("runtime", RuntimeConfig)
    except ParamsError as err:
        print(f"export: error: {err}", file=sys.stderr)
        return 1
    # The parity texts are tokenised before MindSpore forks its kernel-build servers, and HF
    # tokenizers' Rust pool does not survive a fork (it warns, then runs serially): a few texts
    # need no pool, so say so up front (`make run` printed that warning here).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the device and mode of the `runtime` section, before any graph compiles; an fp16 bundle's
    # parity graphs run unfused on CPU, as amp training does (clipms.runtime.for_precision)
    configure(for_precision(runtime, params.precision))
    from clipms.deploy.hostparity import gate_on_host, host_parity
    from clipms.deploy.mindir import ParityError, assert_parity, export_bundle, parity_report
    from clipms.text.clip_tokenizer import Tokenizer
    from clipms.train.trained import RunConfig, TrainedModelError, load_clip
    from clipms.utils.jsonio import read_json, write_json

    try:
        run = RunConfig.read(paths.RUN_CONFIG)
        export_bundle(load_clip(paths.CHECKPOINT, run.model), run.preprocess, paths.TOKENIZER,
                      paths.BUNDLE, params.precision)
        images, tokens = parity_inputs(params, run.preprocess, Tokenizer.load(paths.TOKENIZER))
        reference = load_clip(paths.CHECKPOINT, run.model)  # fresh from disk: the truth
        here = parity_report(reference, paths.BUNDLE, images, tokens, params.batch_sizes,
                             params.precision, params.tolerance)
        report = gate_on_host(here, runtime.device_target, lambda: host_parity(
            paths.BUNDLE, paths.CHECKPOINT, run.model, images, tokens, params.batch_sizes,
            params.precision, params.tolerance))
    except (TrainedModelError, ValueError, RuntimeError) as err:
        print(f"export: error: {err}", file=sys.stderr)
        return 1
    # An amp-trained checkpoint holds fp32 master weights: the bar is the bundle's precision's
    # (docs/ascend.md); the training precision is recorded beside it so the two are never confused.
    trained = (read_json(paths.RUN_CONFIG).get("train") or {}).get("precision", "fp32")
    report.update(trained_precision=trained, parity_images=int(images.shape[0]),
                  parity_captions=int(tokens.shape[0]),
                  **{f"{p.stem}_mb": round(p.stat().st_size / 2**20, 3)
                     for p in sorted(paths.BUNDLE.glob("*.mindir"))})
    write_json(paths.EXPORT_METRICS, report)
    from tracking.files import FILES
    from tracking.run import log_stage  # MLflow: the pipeline's run (docs/mlflow.md)

    log_stage("export", params.model_dump(), FILES, report)
    try:
        assert_parity(report)
    except ParityError as err:
        print(f"export: FAILED: {err}", file=sys.stderr)
        return 1
    print(f"export: {paths.BUNDLE} written and checked in {time.perf_counter() - started:.1f} s: "
          f"{params.precision} (trained {trained}), {report['gate_metric']} image "
          f"{report['image_' + report['gate_metric']]:.2e}, text "
          f"{report['text_' + report['gate_metric']]:.2e} (tolerance {report['tolerance']:g}, "
          f"batch sizes {params.batch_sizes})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
