"""Stage `train`: data/shards + models/tokenizer.json -> models/clip.ckpt, models/clip.json,
metrics/train.json, plots/train.csv (checkpoints in models/checkpoints, kept across runs).

`python -m stages.train`; reads the `train` and `runtime` sections. The model is a preset with
optional overrides; its vocabulary size and context length always come from the tokenizer, its
image size sets the preprocessing. `distributed.workers: N > 1` runs N data-parallel processes
via msrun. To add metric sinks (MLflow), append objects with `on_step_end`/`on_train_end` to
`callbacks()`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Annotated, Any, Literal

from pydantic import Field

from clipms.runtime import RuntimeConfig
from stages import paths
from stages.params import ParamsError, Section, load_section

READS = (paths.TOKENIZER, paths.SHARDS_TRAIN, paths.MANIFEST)
WRITES = (paths.CHECKPOINT, paths.RUN_CONFIG, paths.MLFLOW_RUN, paths.CHECKPOINTS,
          paths.TRAIN_METRICS, paths.TRAIN_CURVE)


class DistributedParams(Section):
    """msrun's cluster (clipms.distributed.Cluster); docs/ascend.md has the multi-host recipe."""

    workers: int = Field(1, ge=1, le=1024)  # data-parallel processes in all hosts; 1 = no msrun
    nodes: int = Field(1, ge=1, le=128)  # hosts; each runs workers / nodes of them
    node_rank: int = Field(0, ge=0)  # this host's index (0 writes the outputs)
    master_addr: str = "127.0.0.1"  # the host running msrun's scheduler (node 0's address)
    master_port: int | None = Field(None, ge=1024, le=65535)  # null: a free port (one node)

    def cluster(self) -> Any:
        from clipms.distributed import Cluster

        return Cluster(workers=self.workers, nodes=self.nodes, node_rank=self.node_rank,
                       master_addr=self.master_addr, master_port=self.master_port)


class TrainParams(Section):
    preset: str = "tiny"  # tiny | small | ViT-B-32 | ViT-B-16
    model: dict[str, Any] = Field(default_factory=dict)  # overrides, e.g. {vision: {layers: 2}}
    precision: Literal["fp32", "amp"] = "fp32"
    batch_size: int = Field(64, ge=1)  # per device and micro-batch
    accum_steps: int = Field(1, ge=1)  # micro-batches per optimizer step
    epochs: int = Field(8, ge=1)
    max_steps: int | None = Field(None, ge=1)  # stop early after this many optimizer steps
    lr: float = Field(5.0e-4, ge=0)
    warmup_steps: int = Field(30, ge=0)
    weight_decay: float = Field(0.2, ge=0)
    decay_embeddings: bool = True  # open_clip: token/positional embedding tables are decayed
    grad_clip_norm: float | None = Field(1.0, ge=0)  # null/0: no clipping
    seed: int = 0
    augment: bool = False  # open_clip's RandomResizedCrop(0.9-1.0) on training images
    decode: Literal["pil", "cpu", "ascend"] = "pil"  # where images decode (clipms.loader)
    workers: Literal["auto"] | Annotated[int, Field(ge=0)] = "auto"  # decode processes per rank
    checkpoint_every: int = Field(100, ge=1)  # optimizer steps
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(10, ge=1)
    resume: Literal["auto", "never"] = "auto"
    init_from: str | None = None  # a MindSpore checkpoint from `python -m clipms.convert`
    lock_image: bool = False
    lock_text: bool = False
    distributed: DistributedParams = Field(default_factory=DistributedParams)


def callbacks() -> list[Any]:
    """Metric sinks for the training loop (duck-typed: on_step_end, on_train_end)."""
    return []


def build_job(params: TrainParams, runtime: RuntimeConfig) -> Any:
    from clipms.config import CLIPConfig, get_preset
    from clipms.loader import loader_workers
    from clipms.tokenizer import Tokenizer
    from clipms.train_job import Outputs, TrainJob, data_fingerprint
    from clipms.trainer import TrainConfig

    tokenizer = Tokenizer.load(paths.TOKENIZER)
    base = get_preset(params.preset).to_dict()
    model = CLIPConfig.from_dict(_merge(base, params.model))
    model = dataclasses.replace(model, text=dataclasses.replace(
        model.text, vocab_size=tokenizer.vocab_size, context_length=tokenizer.context_length))
    config = TrainConfig(
        model=model, batch_size=params.batch_size, epochs=params.epochs,
        max_steps=params.max_steps, lr=params.lr, warmup_steps=params.warmup_steps,
        weight_decay=params.weight_decay, decay_embeddings=params.decay_embeddings,
        grad_clip_norm=params.grad_clip_norm or None,
        accum_steps=params.accum_steps, precision=params.precision, seed=params.seed,
        lock_image=params.lock_image, lock_text=params.lock_text, init_from=params.init_from,
        runtime=runtime,
        checkpoint_every=params.checkpoint_every, keep_checkpoints=params.keep_checkpoints,
        log_every=params.log_every, decode=params.decode,
        data_fingerprint=data_fingerprint(paths.SHARDS, paths.TOKENIZER))
    outputs = Outputs(checkpoint=str(paths.CHECKPOINT), run_config=str(paths.RUN_CONFIG),
                      metrics=str(paths.TRAIN_METRICS), plot=str(paths.TRAIN_CURVE))
    return TrainJob(config=config, shards_dir=str(paths.SHARDS), tokenizer=str(paths.TOKENIZER),
                    checkpoint_dir=str(paths.CHECKPOINTS), outputs=outputs,
                    resume=params.resume == "auto",
                    loader_workers=loader_workers(params.workers,
                                                  params.distributed.cluster().local_workers),
                    augment=params.augment)


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge(base[key], value)
        else:
            merged[key] = value
    return merged


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stdout)
    try:
        params = load_section("train", TrainParams)
        cluster = params.distributed.cluster()  # bad combinations fail here, before any work
        job = build_job(params, load_section("runtime", RuntimeConfig))
    except (ParamsError, ValueError, FileNotFoundError) as err:
        print(f"train: error: {err}", file=sys.stderr)
        return 1
    if not cluster.writes_outputs:
        return _join_as_worker_node(job, cluster)
    from clipms import train_job
    from clipms.trainer import NonFiniteLossError
    from registry.run import PipelineRun  # MLflow: one run per pipeline run (docs/mlflow.md)
    from stages.tracking import FILES

    # Never blocks training (a background sender, a journal); a training that resumes from a
    # checkpoint continues the MLflow run that wrote it (paths.CHECKPOINTS_RUN).
    run = PipelineRun.open("train", params.model_dump(), FILES,
                           resume_record=paths.CHECKPOINTS_RUN)
    run.start_system_metrics()
    sinks = [*callbacks(), run.callback()]
    try:
        with run.failure_recorded():  # any error, SIGTERM too: the run ends FAILED with it
            if cluster.workers > 1:
                from clipms.distributed import launch

                launch(job, cluster, paths.MSRUN_LOGS)
                summary = train_job.replay(job.outputs, sinks)
            else:
                summary = train_job.run(job, sinks).summary
    except NonFiniteLossError as err:
        print(f"train: error: {err}", file=sys.stderr)
        return 1
    run.log_artifact(job.outputs.plot, "plots")
    run.close()
    print(f"train: {int(summary['steps'])} steps, final loss {summary['final_loss']:.4f}, "
          f"{summary['samples_per_s']:.1f} samples/s, {summary['wall_time_s']:.0f} s; wrote "
          f"{job.outputs.checkpoint}, {job.outputs.run_config}, {job.outputs.metrics}, "
          f"{job.outputs.plot}")
    return 0


def _join_as_worker_node(job: Any, cluster: Any) -> int:
    """Node 1.. of a multi-host run: start this host's workers; global rank 0 (on node 0) writes
    the model, the metrics and the MLflow run, so nothing is written or tracked here."""
    from clipms.distributed import LaunchError, launch

    try:
        launch(job, cluster, paths.MSRUN_LOGS)
    except LaunchError as err:
        print(f"train: error: {err}", file=sys.stderr)
        return 1
    print(f"train: node {cluster.node_rank} of {cluster.nodes} finished; the outputs are on "
          f"node 0 ({cluster.master_addr})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
