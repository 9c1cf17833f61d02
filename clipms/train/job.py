"""One training run from files to files: shards + tokenizer in; clip.ckpt, clip.json, train metrics
and the per-step CSV out. The same function runs in-process and in every `msrun` worker (rank 0
writes), so single-device and data-parallel runs share all their code.
"""

# tested by: tests/clipms/train/test_checkpoint.py

from __future__ import annotations

import csv
import hashlib
import io
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipms.train.graphcache import training_code_digest
from clipms.train.recipe import TrainConfig
from clipms.utils.atomic import write_text
from clipms.utils.jsonio import read_json, write_json

if TYPE_CHECKING:
    from clipms.train.loop import Callback, TrainResult

log = logging.getLogger(__name__)

CSV_COLUMNS = ("step", "epoch", "loss", "lr", "logit_scale", "samples_per_s", "grad_norm",
               "loss_scale", "skipped_steps")


@dataclass(frozen=True)
class Outputs:
    """Where a finished run's files go (the train stage names them)."""

    checkpoint: str
    run_config: str
    metrics: str
    plot: str


@dataclass(frozen=True)
class TrainJob:
    """Everything a training process needs; JSON round-trips (the msrun workers read it)."""

    config: TrainConfig
    shards_dir: str
    tokenizer: str
    checkpoint_dir: str
    outputs: Outputs
    resume: bool = True
    # what `train.workers: auto` is resolved from in each rank's process: the host's ranks, and
    # the cores the launching process could use (a rank with fewer is bound to cores of its own)
    local_ranks: int = 1
    launcher_cores: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = self.config.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainJob:
        d = dict(d)
        d["config"] = TrainConfig.from_dict(d["config"])
        d["outputs"] = Outputs(**d["outputs"])
        return cls(**d)


def data_fingerprint(shards_dir: Path | str, tokenizer: Path | str) -> str:
    """Hash of the shard manifest (which holds every shard's sha256), the tokenizer file and the
    training code: a checkpoint is resumed only when all of them are what it was trained with
    (as DVC would rerun the stage for any of them). The code part is `clipms.utils.codehash`'s
    digest of the modules the training imports, so a comment or docstring edit keeps a
    checkpoint (`clipms.train.graphcache.training_code_digest`)."""
    digest = hashlib.sha256()
    for path in (Path(shards_dir) / "manifest.json", Path(tokenizer)):
        digest.update(path.read_bytes())
    digest.update(training_code_digest().encode())
    return digest.hexdigest()[:16]


def run(job: TrainJob, callbacks: Sequence[Callback] = (),
        distributed: bool = False) -> TrainResult:
    """Train as `job` says and (on rank 0) write its outputs."""
    from clipms.data.decode import usable_cores
    from clipms.data.preprocess import PreprocessConfig
    from clipms.runtime import configure, for_data_parallel, for_precision
    from clipms.text.clip_tokenizer import Tokenizer
    from clipms.train.collectives import init_distributed
    from clipms.train.feed import rank_loader_workers
    from clipms.train.loop import ShardBatches, train

    tokenizer = Tokenizer.load(job.tokenizer)
    preprocess = PreprocessConfig(image_size=job.config.model.vision.image_size)
    if distributed:
        runtime = for_data_parallel(for_precision(job.config.runtime, job.config.precision))
        configure(runtime)  # before init()
        rank, group_size = init_distributed()
    else:
        rank, group_size = 0, 1
    cfg = job.config
    workers = rank_loader_workers(cfg.workers, job.local_ranks, job.launcher_cores)
    log.info("rank %d: %d loader workers (train.workers: %s; %d usable cores, %d ranks on this "
             "host, %d cores where the run was launched)", rank, workers, cfg.workers,
             usable_cores(), job.local_ranks, job.launcher_cores)
    source = ShardBatches(job.shards_dir, tokenizer, preprocess, cfg.batch_size,
                          cfg.loader(rank=rank, world_size=group_size, workers=workers))
    result = train(cfg, source, job.checkpoint_dir, callbacks=callbacks, resume=job.resume,
                   distributed=distributed, preprocess=preprocess)
    if rank == 0:
        write_outputs(job, result, preprocess.to_dict(), group_size)
    return result


def write_outputs(job: TrainJob, result: TrainResult, preprocess: dict[str, Any],
                  group_size: int = 1) -> None:
    from clipms.train.loop import save_model

    out = job.outputs
    save_model(result.model, out.checkpoint)
    write_json(out.run_config, {"model": job.config.model.to_dict(), "tokenizer": job.tokenizer,
                                "preprocess": preprocess, "train": job.config.to_dict()})
    write_json(out.metrics, {**result.summary, "devices": group_size,
                             "global_batch_size": job.config.batch_size
                             * job.config.accum_steps * group_size})
    write_text(out.plot, history_csv(result.history))


def history_csv(history: Sequence[dict[str, float]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: (f"{row[k]:.6g}" if isinstance(row[k], float) else row[k])
                         for k in CSV_COLUMNS})
    return buffer.getvalue()


def replay(outputs: Outputs, callbacks: Sequence[Callback]) -> dict[str, float]:
    """Feed a finished run's CSV and metrics to callbacks (the msrun launcher's process never saw
    the steps happen); returns the summary."""
    summary = read_json(outputs.metrics)
    with open(outputs.plot, newline="") as handle:
        for row in csv.DictReader(handle):
            metrics = {k: float(v) for k, v in row.items() if k != "step"}
            for callback in callbacks:
                callback.on_step_end(int(row["step"]), metrics)
    for callback in callbacks:
        callback.on_train_end(summary)
    return summary
