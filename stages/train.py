"""Stage `train`: data/shards + models/tokenizer.json -> models/clip.ckpt, models/clip.json,
metrics/train.json, plots/train.csv (checkpoints in models/checkpoints, kept across runs).

`python -m stages.train`; reads the `train` and `runtime` sections. The model is a preset with
optional overrides, laid over `train.loss`'s initial temperature and bias; its vocabulary size
and context length always come from the tokenizer, its image size sets the preprocessing.
`distributed.workers: N > 1` runs N data-parallel processes via msrun. To add metric sinks
(MLflow), append objects with `on_step_end`/`on_train_end` to `callbacks()`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from clipms.model.config import DEFAULT_PRESET, CLIPConfig, resolve_model
from clipms.runtime import RuntimeConfig, for_precision, prepare_import
from clipms.schema import Section
from clipms.train.config import LOSS_INIT, TrainSettings, check_loss_fits
from pipeline.params import ParamsError, load_section
from stages import paths

READS = (paths.TOKENIZER, paths.SHARDS_TRAIN, paths.MANIFEST)
WRITES = (paths.CHECKPOINT, paths.RUN_CONFIG, paths.MLFLOW_RUN, paths.CHECKPOINTS,
          paths.TRAIN_METRICS, paths.TRAIN_CURVE)


class DistributedParams(Section):
    """msrun's cluster (clipms.parallel.launch.Cluster); docs/ascend.md has the multi-host
    recipe."""

    workers: int = Field(1, ge=1, le=1024)  # data-parallel processes in all hosts; 1 = no msrun
    nodes: int = Field(1, ge=1, le=128)  # hosts; each runs workers / nodes of them
    node_rank: int = Field(0, ge=0)  # this host's index (0 writes the outputs)
    master_addr: str = "127.0.0.1"  # the host running msrun's scheduler (node 0's address)
    master_port: int | None = Field(None, ge=1024, le=65535)  # null: a free port (one node)

    def cluster(self) -> Any:
        from clipms.parallel.launch import Cluster

        return Cluster(workers=self.workers, nodes=self.nodes, node_rank=self.node_rank,
                       master_addr=self.master_addr, master_port=self.master_port)


class TrainParams(TrainSettings):
    """The `train` section: the library's TrainSettings (clipms.train.config, the one train
    schema) plus the stage's own keys. params.yaml documents every key."""

    model_config = ConfigDict(frozen=False)

    preset: str = DEFAULT_PRESET  # a name of clipms.model.config.PRESETS
    model: dict[str, Any] = Field(default_factory=dict)  # overrides, e.g. {vision: {layers: 2}}
    resume: Literal["auto", "never"] = "auto"
    distributed: DistributedParams = Field(default_factory=DistributedParams)

    @field_validator("model")
    @classmethod
    def _buildable(cls, overrides: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """The preset with these overrides must be a valid architecture (patch size divides the
        image size, widths and layer counts positive, heads divide widths) that `loss` can
        train; the ValueError names the key."""
        loss = info.data.get("loss", "clip")
        check_loss_fits(loss, model_for(info.data.get("preset", DEFAULT_PRESET), loss, overrides))
        return overrides


def model_for(preset: str, loss: str, overrides: dict[str, Any]) -> CLIPConfig:
    """The preset with `train.model`'s overrides laid over `loss`'s initial temperature and bias
    (SigLIP's; clipms.train.config.LOSS_INIT)."""
    return resolve_model(preset, {**LOSS_INIT[loss], **overrides})


def callbacks() -> list[Any]:
    """Metric sinks for the training loop (duck-typed: on_step_end, on_train_end)."""
    return []


def build_job(params: TrainParams, runtime: RuntimeConfig) -> Any:
    """The TrainJob the params describe; a ParamsError when the train split cannot fill one
    global batch (before anything compiles)."""
    from clipms.data.dataset import split_sample_count
    from clipms.data.decode import loader_workers
    from clipms.text.tokenizer import Tokenizer
    from clipms.train.config import TrainConfig
    from clipms.train.job import Outputs, TrainJob, data_fingerprint

    cluster = params.distributed.cluster()
    global_batch = params.batch_size * params.accum_steps * cluster.workers
    samples = split_sample_count(paths.SHARDS, "train")
    if samples < global_batch:
        raise ParamsError(
            f"train: the train split holds {samples} samples, fewer than one global batch of "
            f"{global_batch} (train.batch_size {params.batch_size} x train.accum_steps "
            f"{params.accum_steps} x train.distributed.workers {cluster.workers})")
    tokenizer = Tokenizer.load(paths.TOKENIZER)
    model = model_for(params.preset, params.loss, params.model)
    model = dataclasses.replace(model, text=dataclasses.replace(
        model.text, vocab_size=tokenizer.vocab_size, context_length=tokenizer.context_length))
    _check_grouping(params, tokenizer, model.vision.image_size, cluster.workers)
    settings = params.model_dump(include=set(TrainSettings.model_fields))
    settings["workers"] = loader_workers(params.workers, cluster.local_workers)
    config = TrainConfig(**settings, model=model, runtime=runtime,
                         data_fingerprint=data_fingerprint(paths.SHARDS, paths.TOKENIZER))
    outputs = Outputs(checkpoint=str(paths.CHECKPOINT), run_config=str(paths.RUN_CONFIG),
                      metrics=str(paths.TRAIN_METRICS), plot=str(paths.TRAIN_CURVE))
    return TrainJob(config=config, shards_dir=str(paths.SHARDS), tokenizer=str(paths.TOKENIZER),
                    checkpoint_dir=str(paths.CHECKPOINTS), outputs=outputs,
                    resume=params.resume == "auto")


def _check_grouping(params: TrainParams, tokenizer: Any, image_size: int, workers: int) -> None:
    """train.group_by must name labels every train sample has, at a fraction its groups can fill:
    the loader's own check (a DataError naming the field), run here before anything compiles."""
    if not params.group_by:
        return
    from clipms.data.dataset import TrainSamples, index_shards
    from clipms.data.preprocess import PreprocessConfig

    TrainSamples(index_shards(paths.SHARDS, "train"), tokenizer,
                 PreprocessConfig(image_size=image_size), params.batch_size, epochs=1,
                 world_size=workers, group_by=params.group_by,
                 group_fraction=params.group_fraction)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stdout)
    try:
        params = load_section("train", TrainParams)
        runtime = load_section("runtime", RuntimeConfig)
        prepare_import(for_precision(runtime, params.precision))  # before MindSpore's import
        cluster = params.distributed.cluster()  # bad combinations fail here, before any work
        job = build_job(params, runtime)
    except (ParamsError, ValueError, FileNotFoundError) as err:
        print(f"train: error: {err}", file=sys.stderr)
        return 1
    if not cluster.writes_outputs:
        return _join_as_worker_node(job, cluster)
    from clipms.train import job as train_job
    from clipms.train.loop import NonFiniteLossError
    from registry.callback import TrainCallback
    from registry.run import PipelineRun  # MLflow: one run per pipeline run (docs/mlflow.md)
    from stages.tracking import FILES

    # Never blocks training (a background sender, a journal); a training that resumes from a
    # checkpoint continues the MLflow run that wrote it (paths.CHECKPOINTS_RUN).
    run = PipelineRun.open("train", params.model_dump(), FILES,
                           resume_record=paths.CHECKPOINTS_RUN)
    run.start_system_metrics()
    sinks = [*callbacks(), TrainCallback(run)]
    try:
        with run.failure_recorded():  # any error, SIGTERM too: the run ends FAILED with it
            if cluster.workers > 1:
                from clipms.parallel.launch import launch

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
    from clipms.parallel.launch import LaunchError, launch

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
