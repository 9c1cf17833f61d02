"""The training loop: host Python around one compiled step (`clipms.train.step.TrainStep`) that
never waits for the host.

The step keeps its own counters on the device (optimizer step, AdamW update, the first non-finite
step) and computes the learning rate and AdamW's bias correction from them, so the loop only
launches steps. Batches reach it from the host (`HostFeed`) or, where the runtime's `data_sink` is
on (Ascend, GPU), through MindSpore's device queue (`SinkFeed`): same batches, same order; either
feed is closed when the loop ends, so no loader keeps decoding after the last step. With the
runtime's `compile_cache`, the graphs are cached in a folder keyed by everything they bake in
(`clipms.train.graphcache`).
It reads results back every `log_every` steps, before every checkpoint and at the end: then the
per-step rows (loss, grad norm, logit scale) of the steps since the last read are built, callbacks
run, and a NaN/inf is reported at the exact step it happened, before anything of that step (or
later) is saved. Under amp the skipped steps are counted, and a run that wastes them is stopped
(`Training._count_skipped`); the first reads also set the loader's rate beside the steps', so a
rank that waits on data says so in the first minute (`loader_report`). The data order is a
function of (seed, epoch, batch index) and the checkpoint holds every bit of state, so a resumed
run computes exactly the steps the interrupted one would have.

A run's state is one object, `Training`: the config, the model, its step, the trainable
parameters, the rank and the host's record of the steps.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clipms.data.preprocess import PreprocessConfig
from clipms.runtime import (
    configure,
    enable_graph_cache,
    for_data_parallel,
    for_precision,
    kernel_cache_dir,
)
from clipms.train import checkpoint
from clipms.train.feed import (
    BatchSignature,
    BatchSource,
    HostFeed,
    RandomBatches,
    ShardBatches,
    SinkFeed,
)
from clipms.train.graphcache import graph_cache_dir, graph_cache_key
from clipms.train.recipe import TrainConfig
from clipms.train.schedule import cosine_lr
from clipms.utils.atomic import atomic_write

__all__ = ["BatchSource", "Callback", "NonFiniteLossError", "RandomBatches", "ShardBatches",
           "SkippedStepsError", "TrainConfig", "TrainResult", "Training", "save_model", "train"]

log = logging.getLogger(__name__)

MAX_LOGIT_SCALE = math.log(100.0)  # open_clip clamps the learned temperature to 1/100
# Skipped amp steps never stop a run before this many: the dynamic loss scale calibrates by
# skipping, and from the default 2^16 it reaches its floor of 1 in 16 halvings (a micro CLIP
# skips its first 2 or 3 steps at 2^16: tests/clipms/train/test_loop_alarms.py,
# tests/clipms/train/test_loop.py).
CALIBRATION_SKIPS = 16
# The first reads after the first step (compilation) set the loader's rate beside the steps',
# and warn when the training process waited on data for more than this share of the time.
LOADER_REPORTS = 3
LOADER_BOUND_SHARE = 0.2


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN or inf; the message names the step. Nothing of that
    step or later is saved."""


class SkippedStepsError(NonFiniteLossError):
    """Under amp, more of the run's steps were skipped (gradients or loss not finite) than
    `train.max_skipped_share` allows: a run that would end having trained on few of its steps."""


class Callback(Protocol):
    """Rank 0's view of the run. A callback may also define `on_train_begin(run: Training)`,
    called once the model and its step are built (and resumed), before the first step: what a
    callback that evaluates the model as it trains holds on to (benchmarks/time_to_quality.py)."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_train_end(self, summary: dict[str, float]) -> None: ...


@dataclass
class TrainResult:
    model: Any  # the trained CLIP Cell
    summary: dict[str, float]
    history: list[dict[str, float]]


@dataclass
class Launched:
    """One optimizer step in flight: its device outputs, not read yet."""

    step: int  # 1-based
    epoch: int
    losses: list[Any]  # one per micro-batch
    norm: Any
    logit_scale: Any
    finite: Any  # False: amp skipped the step
    loss_scale: Any  # what the next step uses (1 in fp32)


@dataclass
class Training:
    """Everything one training run carries (see `Training.build`)."""

    cfg: TrainConfig
    model: Any  # clipms.model.clip.CLIP
    step_cell: Any  # clipms.train.step.TrainStep
    trainable: list[tuple[str, Any]]  # (name relative to the model, Parameter)
    rank: int = 0
    group_size: int = 1
    step: int = 0  # optimizer steps launched (the device's own count: step_cell.step)
    data_sink: bool = False  # feed through mindspore.data_sink (clipms.runtime's settings)
    history: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: TrainConfig, total_steps: int, distributed: bool = False,
              preprocess: PreprocessConfig | None = None, group_size: int = 1) -> Training:
        """The model and its compiled step for `cfg` (MindSpore's runtime must be configured;
        `train` does it). Benchmarks and tests use this directly."""
        from clipms.model.clip import CLIP, to_mixed_precision

        model = CLIP(cfg.model)
        if cfg.init_from:
            _init_from(model, cfg.init_from)
        trainable = []
        for name, param in model.parameters_and_names():
            locked = (cfg.lock_image and name.startswith("visual.")) or (
                cfg.lock_text and name.startswith("text."))
            param.requires_grad = not locked
            if not locked:
                trainable.append((name, param))
        if cfg.precision == "amp":
            to_mixed_precision(model)  # O2 in place: the parameter names stay CLIP's own
        _start_patch_dropout(model, cfg, distributed)  # after `trainable`: its counter is state
        preprocess = preprocess or PreprocessConfig(image_size=cfg.model.vision.image_size)
        step_cell = _build_step(cfg, model, trainable, total_steps, preprocess,
                                group_size if distributed else 1)
        return cls(cfg, model, step_cell, trainable, group_size=group_size)

    @property
    def fingerprint(self) -> str:
        """The config's fingerprint, plus the number of data-parallel ranks when there are several
        (they change the global batch, hence the data order and the weights)."""
        base = self.cfg.fingerprint()
        return base if self.group_size == 1 else f"{base}x{self.group_size}"

    def feed(self, source: BatchSource, total: int) -> HostFeed | SinkFeed:
        """What launches a micro-batch of the remaining steps (from `self.step` to `total`)."""
        start, stop = self.step * self.cfg.accum_steps, total * self.cfg.accum_steps
        if self.data_sink:
            model = self.cfg.model
            signature = BatchSignature(self.cfg.batch_size, model.vision.image_size,
                                       model.text.context_length)
            return SinkFeed(self.step_cell, source, start, stop, signature)
        return HostFeed(self.step_cell, source, start, stop)

    def launch(self, feed: HostFeed | SinkFeed, per_epoch: int) -> Launched:
        """Queue one optimizer step (accum_steps micro-batches); reads nothing back."""
        epoch = self.step * self.cfg.accum_steps // per_epoch
        if self.cfg.accum_steps == 1:
            loss, norm, finite, scale, loss_scale = feed()
        else:  # the loss over all the micro-batches: clipms.train.step.TrainStep.accumulate
            batches = [feed.batch() for _ in range(self.cfg.accum_steps)]
            loss, norm, finite, scale, loss_scale = self.step_cell.accumulate(batches)
        self.step += 1
        return Launched(self.step, epoch, [loss], norm, scale, finite, loss_scale)

    def read(self, launched: Sequence[Launched], total: int,
             seconds: float) -> list[dict[str, float]]:
        """The rows of `launched` (a sync with the device); NonFiniteLossError at the first bad
        step. `seconds` is the wall time the steps took, for their samples/s."""
        bad = int(self.step_cell.first_bad_step.asnumpy())
        rows = [self._row(item, total, seconds / max(1, len(launched))) for item in launched]
        if bad:
            row = next((r for r in rows if r["step"] == bad), None)
            what = (f"loss is {row['loss']}" if row and not math.isfinite(row["loss"]) else
                    f"gradient norm is {row['grad_norm']}" if row else "a value is not finite")
            raise NonFiniteLossError(
                f"{what} at step {bad} (epoch {row['epoch'] if row else '?'}); stopping. Nothing "
                f"of step {bad} or later was saved; the last good checkpoint (if any) is intact.")
        self._count_skipped(rows, total)
        self.history.extend(rows)
        return rows

    def _count_skipped(self, rows: list[dict[str, Any]], total: int) -> None:
        """Turn each row's `skipped` flag into the run's `skipped_steps` so far, and stop a run
        whose amp steps are wasted (`_wasted`), or whose loss is not finite
        `max_nonfinite_steps` steps in a row (the weights are intact: amp skipped those steps)."""
        cfg = self.cfg
        skipped = int(self.history[-1].get("skipped_steps", 0)) if self.history else 0
        streak = 0
        for row in reversed(self.history):
            if math.isfinite(row["loss"]):
                break
            streak += 1
        for row in rows:
            skipped += int(row.pop("skipped"))
            row["skipped_steps"] = skipped
            streak = 0 if math.isfinite(row["loss"]) else streak + 1
            step = int(row["step"])
            if streak >= cfg.max_nonfinite_steps:
                raise NonFiniteLossError(
                    f"the loss is not finite at steps {step - streak + 1}-{step}, "
                    f"{streak} in a row (train.max_nonfinite_steps: {cfg.max_nonfinite_steps}); "
                    f"stopping. amp skipped those steps, so the weights are those of step "
                    f"{step - streak}; the forward overflows fp16 (bad data, or a learning rate "
                    f"too high): train in fp32 or lower train.lr.")
            if _wasted(skipped, total, cfg.max_skipped_share):
                raise SkippedStepsError(
                    f"{skipped} of the first {step} steps were skipped (amp: gradients or loss "
                    f"not finite; loss scale now {row['loss_scale']:g}), more than "
                    f"train.max_skipped_share {cfg.max_skipped_share:g} of the run's {total} "
                    f"steps; stopping: the run would end having trained on few of its steps. "
                    f"Lower train.loss_scale (it only halves once per skipped step), or train "
                    f"in fp32.")

    def _row(self, item: Launched, total: int, seconds: float) -> dict[str, float]:
        cfg = self.cfg
        samples = cfg.batch_size * cfg.accum_steps * self.group_size
        return {"step": item.step, "epoch": item.epoch,
                "loss": float(np.mean([float(loss.asnumpy()) for loss in item.losses])),
                "lr": cosine_lr(item.step - 1, cfg.lr, cfg.warmup_steps, total),
                "grad_norm": float(item.norm.asnumpy()),
                "logit_scale": float(item.logit_scale.asnumpy()),
                "samples_per_s": samples / seconds if seconds > 0 else 0.0,
                "loss_scale": float(item.loss_scale.asnumpy()),
                "skipped": not bool(item.finite.asnumpy())}

    def state_tensors(self) -> dict[str, Any]:
        """Every tensor a checkpoint holds: the model (its own names), both AdamW moments, the
        step's counters and loss scale."""
        tensors = dict(model_tensors(self.model))
        opt = self.step_cell.optimizer
        for (name, _), m, v in zip(self.trainable, opt.exp_avg, opt.exp_avg_sq, strict=True):
            tensors[f"adam_m.{name}"] = m
            tensors[f"adam_v.{name}"] = v
        tensors.update(self.step_cell.state())
        return tensors

    def save(self, writer: checkpoint.CheckpointWriter) -> None:
        meta = {"step": self.step, "config": self.cfg.to_dict(), "fingerprint": self.fingerprint,
                "group_size": self.group_size, "history": self.history}
        writer.submit(self.step, self.state_tensors(), meta)

    def resume_or_start(self, folder: Path, resume: bool = True,
                        barrier: Callable[[], None] | None = None) -> None:
        """Continue from the newest checkpoint in `folder` if it is this run's; otherwise (rank 0)
        move the folder's checkpoints aside (`checkpoint.set_aside`, never deleted) and start.

        `barrier` (data parallel: `clipms.train.collectives.barrier`) returns once every rank has
        read the folder, so rank 0 never moves a file another rank is still reading."""
        import mindspore as ms

        found = checkpoint.load_latest(folder)
        if barrier is not None:
            barrier()
        if not resume or found is None or found.meta.get("fingerprint") != self.fingerprint:
            if self.rank == 0:  # the only writer; the other ranks just start fresh too
                stale = found.meta.get("fingerprint") if found else None
                moved = checkpoint.set_aside(folder, stale)
                if moved is not None:
                    why = ("train.resume is off" if not resume else "they belong to another "
                           "configuration or other data" if found else "none of them reads back")
                    log.warning("checkpoints in %s moved to %s (%s); starting fresh", folder,
                                moved, why)
            return
        for name, param in self.state_tensors().items():
            if name not in found.tensors:
                raise ValueError(f"{found.path}: missing '{name}'; cannot resume from it")
            param.set_data(ms.Tensor(found.tensors[name], param.dtype))
        self.step, self.history = found.meta["step"], list(found.meta["history"])
        log.info("resuming from %s (step %d)", found.path, self.step)


def train(cfg: TrainConfig, source: BatchSource, checkpoint_dir: Path | str | None = None,
          callbacks: Sequence[Callback] = (), resume: bool = True, distributed: bool = False,
          preprocess: PreprocessConfig | None = None) -> TrainResult:
    """Train CLIP on `source`; checkpoints go to `checkpoint_dir` (rank 0 only).

    With `resume`, a checkpoint in `checkpoint_dir` whose fingerprint matches is continued.
    Checkpoints of another configuration (all of them, without `resume`) are moved into
    `checkpoint_dir/stale-<fingerprint>/`, never deleted, and only once the model is built and the
    run has at least one step. Checkpoints are written on a background thread
    (`checkpoint.CheckpointWriter`). With `distributed`, `mindspore.communication.init()` must
    have run (msrun): gradients are averaged, features all-gathered, and only rank 0 writes.
    `preprocess` gives the mean/std the step normalises uint8 pixels with (default OpenAI's).
    """
    rank, group_size, data_sink = setup_runtime(cfg, distributed)
    per_epoch = source.batches_per_epoch  # batches (micro-batches) per epoch
    total = cfg.max_steps or (cfg.epochs * per_epoch) // cfg.accum_steps
    if total < 1:
        raise ValueError(f"{per_epoch} batches per epoch x {cfg.epochs} epochs is fewer than "
                         f"accum_steps={cfg.accum_steps}: not one optimizer step")
    preprocess = preprocess or PreprocessConfig(image_size=cfg.model.vision.image_size)
    if cfg.runtime.compile_cache:  # before the first graph of this run compiles
        key = graph_cache_key(cfg, total, group_size, preprocess.mean, preprocess.std)
        enable_graph_cache(graph_cache_dir(kernel_cache_dir(), key, rank))
    run = Training.build(cfg, total, distributed, preprocess, group_size)
    run.rank, run.data_sink = rank, data_sink
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt_dir is not None:
        run.resume_or_start(ckpt_dir, resume, _barrier() if distributed else None)
    if distributed:
        from clipms.train.collectives import check_same_start

        check_same_start(run.step)  # hosts without a shared checkpoint folder would diverge
    writer = (checkpoint.CheckpointWriter(ckpt_dir, cfg.keep_checkpoints)
              if rank == 0 and ckpt_dir is not None else None)
    log.info("training %d steps (%d batches per epoch), %d samples a step, rank %d/%d, from "
             "step %d", total, per_epoch, cfg.batch_size * cfg.accum_steps * group_size, rank,
             group_size, run.step)
    started = time.perf_counter()
    for callback in callbacks if rank == 0 else ():
        if hasattr(callback, "on_train_begin"):
            callback.on_train_begin(run)
    try:
        timed = _loop(run, source, total, writer, callbacks if rank == 0 else ())
    finally:
        if writer:
            writer.close()  # the last (good) checkpoint is on disk; a failed write raises here
    samples, seconds = timed
    run.model.set_train(False)  # trained: from here on it evaluates (no patch dropout)
    summary = {
        "final_loss": run.history[-1]["loss"] if run.history else float("nan"),
        "steps": float(run.step),
        "epochs": run.step * cfg.accum_steps / per_epoch,
        "samples_per_s": samples / seconds if seconds else 0.0,
        "wall_time_s": time.perf_counter() - started,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        # amp: steps skipped (never more than train.max_skipped_share), the final loss scale
        "skipped_steps": float(run.history[-1]["skipped_steps"]) if run.history else 0.0,
        "loss_scale": float(run.step_cell.scale.asnumpy()) if cfg.precision == "amp" else 1.0,
    }
    if run.model.logit_bias is not None:  # SigLIP's learned bias, as trained
        summary["logit_bias"] = float(run.model.logit_bias.asnumpy())
    if rank == 0:
        for callback in callbacks:
            callback.on_train_end(summary)
    return TrainResult(model=run.model, summary=summary, history=run.history)


def _loop(run: Training, source: BatchSource, total: int,
          writer: checkpoint.CheckpointWriter | None,
          callbacks: Sequence[Callback]) -> tuple[int, float]:
    """Launch steps until `total`, reading them back when a log line, a checkpoint or the end is
    due; returns (samples, seconds) timed after the first step (graph compilation)."""
    per_epoch = source.batches_per_epoch
    feed = run.feed(source, total)
    try:
        return _launch_all(run, feed, per_epoch, total, writer, callbacks,
                           getattr(source, "workers", None))
    finally:
        feed.close()  # nothing decodes or sends after the last step (or an error)


def _launch_all(run: Training, feed: HostFeed | SinkFeed, per_epoch: int, total: int,
                writer: checkpoint.CheckpointWriter | None,
                callbacks: Sequence[Callback], workers: int | None = None) -> tuple[int, float]:
    cfg, accum = run.cfg, run.cfg.accum_steps
    pending: list[Launched] = []
    first, samples, seconds, loader_reports = True, 0, 0.0, LOADER_REPORTS
    tick, fed = time.perf_counter(), (0, 0.0)
    while run.step < total:
        pending.append(run.launch(feed, per_epoch))
        save = writer is not None and (run.step % cfg.checkpoint_every == 0 or run.step == total)
        if first or save or run.step % cfg.log_every == 0 or run.step == total:
            rows = run.read(pending, total, time.perf_counter() - tick)  # waits for the device
            elapsed = time.perf_counter() - tick
            if not first:
                samples += len(rows) * cfg.batch_size * accum * run.group_size
                seconds += elapsed
                if loader_reports:
                    loader_reports -= 1
                    _report_loader(int(rows[-1]["step"]), feed.clock.samples - fed[0],
                                   feed.clock.waited - fed[1], elapsed, workers)
            _report(rows, total, callbacks)
            pending, first, tick = [], False, time.perf_counter()
            fed = (feed.clock.samples, feed.clock.waited)
        if save:
            run.save(writer)
    return samples, seconds


def loader_report(samples: int, waited: float, elapsed: float,
                  workers: int | None = None) -> tuple[str, bool]:
    """(the log line, whether the device waits on data) for `samples` this rank's steps took in
    `elapsed` seconds, `waited` of them spent waiting for the loader."""
    steps = samples / elapsed if elapsed > 0 else 0.0
    loader = (f"{samples / waited:.1f} samples/s while waited for" if waited > 0 else
              "never waited for")
    share = waited / elapsed if elapsed > 0 else 0.0
    line = (f"loader {loader} (waited {waited:.2f} s of {elapsed:.2f} s), steps "
            f"{steps:.1f} samples/s on this rank")
    bound = share > LOADER_BOUND_SHARE
    if bound:
        now = f" (now {workers})" if workers is not None else ""
        line += (f": the device waits on data {share:.0%} of the time; raise train.workers{now}"
                 f" or decode on the device (train.decode, docs/ascend.md)")
    return line, bound


def _report_loader(step: int, samples: int, waited: float, elapsed: float,
                   workers: int | None) -> None:
    line, bound = loader_report(samples, waited, elapsed, workers)
    (log.warning if bound else log.info)("step %d: %s", step, line)


def _wasted(skipped: int, total: int, share: float) -> bool:
    """More than `share` of the run's `total` steps skipped, known as soon as it is certain (no
    later step can bring the run back below it), past the loss scale's calibration
    (`CALIBRATION_SKIPS`)."""
    return skipped > share * total and skipped > CALIBRATION_SKIPS


def _report(rows: list[dict[str, float]], total: int, callbacks: Sequence[Callback]) -> None:
    last = rows[-1]
    log.info("step %d/%d epoch %d loss %.4f lr %.3g logit_scale %.2f samples/s %.1f "
             "loss_scale %g skipped %d", last["step"], total, last["epoch"], last["loss"],
             last["lr"], last["logit_scale"], last["samples_per_s"], last["loss_scale"],
             last["skipped_steps"])
    for row in rows:
        for callback in callbacks:
            callback.on_step_end(int(row["step"]), dict(row))


def model_tensors(model: Any) -> dict[str, Any]:
    """The CLIP Cell's parameters under their names relative to the Cell (the models/clip.ckpt
    contract; MindSpore renames Parameter.name when the Cell is wrapped)."""
    return dict(model.parameters_and_names())


def save_model(model: Any, path: Path | str) -> None:
    """models/clip.ckpt: only the CLIP weights, atomically."""
    import mindspore as ms

    items = [{"name": name, "data": ms.Tensor(param.asnumpy())}
             for name, param in model_tensors(model).items()]
    with atomic_write(path) as tmp:
        ms.save_checkpoint(items, str(tmp))


# --------------------------------------------------------------------------------------------
# setup


def setup_runtime(cfg: TrainConfig, distributed: bool) -> tuple[int, int, bool]:
    """Device, mode, kernel fusion (clipms.runtime) and seed for `cfg`, before any graph
    compiles; returns (rank, group size, whether batches are sunk to the device)."""
    runtime = for_precision(cfg.runtime, cfg.precision)
    settings = configure(for_data_parallel(runtime) if distributed else runtime)
    import mindspore as ms

    from clipms.train.collectives import init_distributed

    ms.set_seed(cfg.seed)  # same seed on every rank: identical initial weights
    return (*(init_distributed() if distributed else (0, 1)), settings.data_sink)


def _barrier() -> Callable[[], None]:
    from clipms.train.collectives import barrier

    return barrier


def _init_from(model: Any, path: str) -> None:
    import mindspore as ms

    if not Path(path).is_file():
        raise FileNotFoundError(f"train.init_from: {path} does not exist "
                                "(convert open_clip weights with `python -m clipms.model.convert`)")
    params = ms.load_checkpoint(path)
    expected = model_tensors(model)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ValueError(f"train.init_from: {path} lacks {len(missing)} parameters of this model, "
                         f"e.g. {missing[:5]}")
    for name, param in expected.items():
        value = params[name].asnumpy()
        if value.shape != tuple(param.shape):
            raise ValueError(f"train.init_from: {name} has shape {value.shape} in {path} but "
                             f"{tuple(param.shape)} in the model (config mismatch?)")
        param.set_data(ms.Tensor(value, param.dtype))


def _build_step(cfg: TrainConfig, model: Any, trainable: list[tuple[str, Any]], total_steps: int,
                preprocess: PreprocessConfig, group_size: int) -> Any:
    from clipms.train.loss import build_loss
    from clipms.train.optim import Schedule, build_adamw
    from clipms.train.step import ClipWithLoss, PixelNormalize, TrainStep, use_cpu_safe_gather

    loss = use_cpu_safe_gather(build_loss(cfg.loss, gather=group_size > 1))
    net_with_loss = ClipWithLoss(model, loss, PixelNormalize(preprocess.mean, preprocess.std))
    optimizer = build_adamw(trainable, cfg.betas, cfg.decay_embeddings)
    schedule = Schedule(cfg.lr, cfg.warmup_steps, total_steps, cfg.betas, cfg.eps,
                        cfg.weight_decay)
    return TrainStep(
        net_with_loss, optimizer, schedule, accum_steps=cfg.accum_steps,
        max_grad_norm=cfg.grad_clip_norm or 0.0,
        loss_scale=cfg.loss_scale if cfg.precision == "amp" else None,
        loss_scale_window=cfg.loss_scale_window, logit_scale=model.logit_scale,
        max_logit_scale=MAX_LOGIT_SCALE, group_size=group_size,
        micro_batch=cfg.batch_size).set_train(True)


def _start_patch_dropout(model: Any, cfg: TrainConfig, distributed: bool) -> None:
    """Seed the model's patch dropout (if any) with the run's seed; this rank's rows are samples
    rank * batch_size.. of each global batch (clipms.model.patch_dropout)."""
    import mindspore as ms

    from clipms.model.patch_dropout import PatchDropout, start_patch_dropout

    dropping = any(isinstance(cell, PatchDropout) and cell.prob > 0
                   for _, cell in model.cells_and_names())
    if dropping and ms.get_context("mode") != ms.GRAPH_MODE:
        # A PyNative step runs the forward twice (the draw counter advances by two): the
        # gradient then follows another draw of patches than the loss it reports, and a step's
        # update differs from graph mode's (the same step without patch dropout agrees).
        raise ValueError("train.model.vision.patch_dropout needs runtime.mode: graph (in "
                         "pynative mode the gradient would see another patch draw than the loss)")
    rank = 0
    if distributed:
        from mindspore.communication import get_rank

        rank = get_rank()
    start_patch_dropout(model, cfg.seed, rank * cfg.batch_size)
