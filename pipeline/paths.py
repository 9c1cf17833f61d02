"""Every file and folder the pipeline reads or writes, named once.

Only stages name files: the library (clipms/, registry/) takes paths as arguments. Each stage module
declares the paths it reads (`READS`) and writes (`WRITES`) from this module; dvc.yaml mirrors them,
and tests/pipeline/test_paths.py fails when a stage's deps/outs in dvc.yaml are not exactly its
declaration. All paths are relative to the project root, where DVC runs every stage.
"""

from __future__ import annotations

from pathlib import Path

PARAMS = Path("params.yaml")
LOCK = Path("dvc.lock")

# data/
METADATA = Path("data/metadata.parquet")
SYNTHETIC = Path("data/synthetic")  # relative on purpose: synthetic URLs embed it (file:data/...)
IMAGES = Path("data/images.parquet")
DOWNLOAD = Path("data/download")
SHARDS = Path("data/shards")
SHARDS_TRAIN = SHARDS / "train"
SHARDS_VAL = SHARDS / "val"
MANIFEST = SHARDS / "manifest.json"
EVALSETS = Path("data/evalsets")  # frozen evaluation sets, one folder each (ops.pin_evalset)
SHARD_CHECKS = Path("data/shard-checks")  # what decoding each input tar found (stage shard)
CHANGES_STATE = Path("data/changes")  # the snapshots of the last accepted runs (stage changes)

# models/
TOKENIZER = Path("models/tokenizer.json")
CHECKPOINT = Path("models/clip.ckpt")
RUN_CONFIG = Path("models/clip.json")
MLFLOW_RUN = Path("models/mlflow_run.json")  # the MLflow run the stages after train log into
MLFLOW_JOURNAL = Path("models/mlflow-journal")  # tracking records not sent yet (not a DVC out)
CHECKPOINTS = Path("models/checkpoints")
CHECKPOINTS_RUN = CHECKPOINTS / "mlflow_run.json"  # the MLflow run that wrote the checkpoints
MSRUN_LOGS = CHECKPOINTS / "msrun"
BUNDLE = Path("models/export")
INDEX = Path("models/index")  # the search index of the bundle's embeddings (serving/)
WARM_START = Path("models/warm-start")  # train: the registered checkpoint it starts from (no out)

# metrics/ (`dvc metrics show`) and plots/ (`dvc plots show`); cache: false in dvc.yaml
DEDUPE_METRICS = Path("metrics/dedupe.json")
DOWNLOAD_METRICS = Path("metrics/download.json")
SHARD_METRICS = Path("metrics/shard.json")
TOKENIZER_METRICS = Path("metrics/tokenizer.json")  # where models/tokenizer.json came from
CHANGES_METRICS = Path("metrics/changes.json")  # the data-change report (also an MLflow artifact)
TRAIN_METRICS = Path("metrics/train.json")
EVAL_METRICS = Path("metrics/eval.json")
EVAL_QUALITY = Path("metrics/quality")  # the same figures, one row per task (dvc metrics show)
CLIP_BENCHMARK = Path("metrics/clip_benchmark")  # the same results as CLIP_benchmark JSON files
EXPORT_METRICS = Path("metrics/export.json")
INDEX_METRICS = Path("metrics/index.json")
REGISTER_METRICS = Path("metrics/register.json")
TRAIN_CURVE = Path("plots/train.csv")
RECALL_CURVE = Path("plots/recall_at_k.csv")
RECALL_PLOT = Path("plots/recall_at_k.png")
CONFUSION_CSV = Path("plots/confusion_matrix.csv")
CONFUSION_PNG = Path("plots/confusion_matrix.png")
GALLERY = Path("plots/retrieval_gallery.png")


def evaluation_set(split: str, pinned_set: str | None) -> tuple[Path, str, str]:
    """(shards folder, split, name) of the samples `evaluate` scores and the gate compares on:
    `split` of data/shards, or the frozen set `pinned_set` (its val split)."""
    if pinned_set:
        folder = EVALSETS / pinned_set
        return folder, "val", f"pinned set {pinned_set} ({folder})"
    return SHARDS, split, f"split {split} of {SHARDS}"
