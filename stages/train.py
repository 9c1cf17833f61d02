"""Stage `train`: data/shards + models/tokenizer.json -> models/clip.ckpt, models/clip.json,
metrics/train.json, plots/train.csv (checkpoints in models/checkpoints, kept across runs).

`python -m stages.train`; reads the `train` and `runtime` sections. The model is a preset with
optional overrides, laid over `train.loss`'s initial temperature and bias; its vocabulary size
and context length always come from the tokenizer, its image size sets the preprocessing.
`distributed.workers: N > 1` runs N data-parallel processes via msrun. To add metric sinks
(MLflow), append objects with `on_step_end`/`on_train_end` to `callbacks()`.

`init_from` is a checkpoint path, or a registered version (`models:/clip@champion`): a warm start.
Its checkpoint is fetched here (registry.carryover: same tokenizer and architecture, or the stage
stops) and the library gets the local file; the night then runs `warm_start`'s own budget
(steps, peak learning rate, warmup) instead of `epochs`/`max_steps`, and the run's lineage names
the version it started from. No version of that model registered yet: the first night, cold.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from clipms.model.architecture import DEFAULT_PRESET, CLIPConfig, resolve_model
from clipms.runtime import RuntimeConfig, for_precision, prepare_import
from clipms.schema import Section
from clipms.train.recipe import LOSS_INIT, TrainSettings, check_loss_fits
from pipeline import paths
from pipeline.params import ParamsError, load_section
from registry.versions import is_model_uri

READS = (paths.TOKENIZER, paths.TOKENIZER_METRICS, paths.SHARDS_TRAIN, paths.MANIFEST,
         paths.CHANGES_METRICS)
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


class WarmStartParams(Section):
    """The budget of a night that starts from a registered version's weights (`init_from:
    models:/...`), instead of epochs/max_steps, lr and warmup_steps."""

    max_steps: int = Field(300, ge=1)
    lr: float | None = Field(None, ge=0)  # null: train.lr
    warmup_steps: int = Field(20, ge=0)


class TrainParams(TrainSettings):
    """The `train` section: the library's TrainSettings (clipms.train.recipe, the one train
    schema) plus the stage's own keys. params.yaml documents every key."""

    model_config = ConfigDict(frozen=False)

    preset: str = DEFAULT_PRESET  # a name of clipms.model.architecture.PRESETS
    model: dict[str, Any] = Field(default_factory=dict)  # overrides, e.g. {vision: {layers: 2}}
    resume: Literal["auto", "never"] = "auto"
    distributed: DistributedParams = Field(default_factory=DistributedParams)
    warm_start: WarmStartParams = Field(default_factory=WarmStartParams)

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
    (SigLIP's; clipms.train.recipe.LOSS_INIT)."""
    return resolve_model(preset, {**LOSS_INIT[loss], **overrides})


def callbacks() -> list[Any]:
    """Metric sinks for the training loop (duck-typed: on_step_end, on_train_end)."""
    return []


def build_job(params: TrainParams, runtime: RuntimeConfig) -> Any:
    """The TrainJob the params describe; a ParamsError when the train split cannot fill one
    global batch (before anything compiles)."""
    from clipms.data.dataset import split_sample_count
    from clipms.data.decode import usable_cores
    from clipms.text.clip_tokenizer import Tokenizer
    from clipms.train.job import Outputs, TrainJob, data_fingerprint
    from clipms.train.recipe import TrainConfig

    cluster = params.distributed.cluster()
    global_batch = params.batch_size * params.accum_steps * cluster.workers
    samples = split_sample_count(paths.SHARDS, "train")
    if samples < global_batch:
        raise ParamsError(
            f"train: the train split holds {samples} samples, fewer than one global batch of "
            f"{global_batch} (train.batch_size {params.batch_size} x train.accum_steps "
            f"{params.accum_steps} x train.distributed.workers {cluster.workers})")
    tokenizer = Tokenizer.load(paths.TOKENIZER)
    model = resolved_model(params, tokenizer)
    _check_grouping(params, tokenizer, model.vision.image_size, cluster.workers)
    settings = params.model_dump(include=set(TrainSettings.model_fields))
    config = TrainConfig(**settings, model=model, runtime=runtime,
                         data_fingerprint=data_fingerprint(paths.SHARDS, paths.TOKENIZER))
    outputs = Outputs(checkpoint=str(paths.CHECKPOINT), run_config=str(paths.RUN_CONFIG),
                      metrics=str(paths.TRAIN_METRICS), plot=str(paths.TRAIN_CURVE))
    return TrainJob(config=config, shards_dir=str(paths.SHARDS), tokenizer=str(paths.TOKENIZER),
                    checkpoint_dir=str(paths.CHECKPOINTS), outputs=outputs,
                    resume=params.resume == "auto", local_ranks=cluster.local_workers,
                    launcher_cores=usable_cores())  # workers: each rank resolves its own


def resolved_model(params: TrainParams, tokenizer: Any) -> Any:
    """The CLIPConfig trained: the preset, its overrides, the tokenizer's vocabulary and context."""
    model = model_for(params.preset, params.loss, params.model)
    return dataclasses.replace(model, text=dataclasses.replace(
        model.text, vocab_size=tokenizer.vocab_size, context_length=tokenizer.context_length))


def warm_start(params: TrainParams) -> tuple[TrainParams, Any]:
    """For `init_from: models:/...`: the params the night trains with (the fetched checkpoint's
    local path, the warm_start budget; cold on the first night) and what was carried over
    (registry.carryover.CarriedOver); `params` unchanged and None for anything else."""
    if not is_model_uri(params.init_from):
        return params, None
    from clipms.text.clip_tokenizer import Tokenizer
    from registry.carryover import fetch_init_checkpoint

    model = resolved_model(params, Tokenizer.load(paths.TOKENIZER))
    carried = fetch_init_checkpoint(str(params.init_from), paths.WARM_START, paths.TOKENIZER,
                                    model.to_dict())
    if carried.version is None:
        print(f"train: {carried.lineage('init')['lineage.init_from']}: training cold")
        return params.model_copy(update={"init_from": None}), carried
    budget = params.warm_start
    print(f"train: warm start from {carried.version.fixed_uri} ({params.init_from}): "
          f"{budget.max_steps} steps")
    return params.model_copy(update={
        "init_from": str(carried.path), "max_steps": budget.max_steps,
        "lr": params.lr if budget.lr is None else budget.lr,
        "warmup_steps": budget.warmup_steps}), carried


def lineage_tags(carried: Any) -> dict[str, str]:
    """Where the tokenizer (metrics/tokenizer.json) and the initial weights came from."""
    from clipms.utils.jsonio import read_json

    record = read_json(paths.TOKENIZER_METRICS) if paths.TOKENIZER_METRICS.exists() else {}
    tags = {k: str(v) for k, v in record.items() if k.startswith("lineage.") and v is not None}
    return {**tags, **(carried.lineage("init") if carried is not None else {})}


def _check_grouping(params: TrainParams, tokenizer: Any, image_size: int,
                    world_size: int) -> None:
    """train.group_by must name labels every train sample has, at a fraction its groups can fill:
    the loader's own check (a DataError naming the field), run here before anything compiles."""
    if not params.group_by:
        return
    from clipms.data.dataset import TrainSamples, index_shards
    from clipms.data.preprocess import PreprocessConfig

    TrainSamples(index_shards(paths.SHARDS, "train"), tokenizer,
                 PreprocessConfig(image_size=image_size), params.batch_size,
                 params.loader(world_size=world_size), epochs=1)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stdout)
    from registry.carryover import CarryOverError

    try:
        params = load_section("train", TrainParams)
        runtime = load_section("runtime", RuntimeConfig)
        prepare_import(for_precision(runtime, params.precision))  # before MindSpore's import
        cluster = params.distributed.cluster()  # bad combinations fail here, before any work
        trained_params, carried = warm_start(params)  # every host needs the weights
        job = build_job(trained_params, runtime)
    except (ParamsError, ValueError, FileNotFoundError, CarryOverError) as err:
        print(f"train: error: {err}", file=sys.stderr)
        return 1
    if not cluster.writes_outputs:
        return _join_as_worker_node(job, cluster)
    from clipms.parallel.launch import LaunchError
    from clipms.train import job as train_job
    from clipms.train.loop import NonFiniteLossError
    from tracking.callback import TrainCallback
    from tracking.files import FILES
    from tracking.run import PipelineRun  # MLflow: one run per pipeline run (docs/mlflow.md)

    # Never blocks training (a background sender, a journal); a training that resumes from a
    # checkpoint continues the MLflow run that wrote it (paths.CHECKPOINTS_RUN).
    run = PipelineRun.open("train", params.model_dump(), FILES,
                           resume_record=paths.CHECKPOINTS_RUN)
    run.set_tags(lineage_tags(carried))
    run.start_system_metrics()
    sinks = [*callbacks(), TrainCallback(run)]
    try:
        with run.failure_recorded():  # any error, SIGTERM too: the run ends FAILED with it
            if cluster.workers > 1:
                from clipms.parallel.launch import launch

                launch(job, cluster, paths.MSRUN_LOGS)  # a rank's alarm: LaunchError, its log
                summary = train_job.replay(job.outputs, sinks)
            else:
                summary = train_job.run(job, sinks).summary
    except (NonFiniteLossError, LaunchError) as err:  # a diverging or wasted run, too
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
