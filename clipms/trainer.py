"""The training loop: one compiled step (forward, backward, accumulation, loss scaling, clipping,
AdamW, logit-scale clamp), checkpoints with exact resume, NaN guard, callbacks.

The loop is host Python around one graph-mode Cell (`TrainStep`). Everything that varies per step
(learning rate, AdamW's folded bias correction) enters the graph as a scalar tensor, so the graph
compiles once. The data order is a function of (seed, epoch, batch index) -- `BatchSource.epoch(e,
skip)` -- and the checkpoint holds every bit of state, so a resumed run computes exactly the steps
the interrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import resource
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from clipms import checkpoint
from clipms.atomic import atomic_write
from clipms.config import CLIPConfig
from clipms.runtime import RuntimeConfig, configure

log = logging.getLogger(__name__)

MAX_LOGIT_SCALE = math.log(100.0)  # open_clip clamps the learned temperature to 1/100


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; the message names the step. No checkpoint is written for it."""


class BatchSource(Protocol):
    """Deterministic batches. `stream(start, stop)` yields this rank's batches of global batch
    indices start..stop-1 (batch i is in epoch i // batches_per_epoch), identical for identical
    (seed, i) whatever `start` is -- what makes a resumed run exact."""

    batches_per_epoch: int

    def stream(self, start: int, stop: int) -> Iterable[tuple[np.ndarray, np.ndarray]]: ...


class Callback(Protocol):
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_train_end(self, summary: dict[str, float]) -> None: ...


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (plus how often to checkpoint/log)."""

    model: CLIPConfig
    batch_size: int = 64  # global batch per optimizer step = batch_size * accum_steps
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (overrides epochs)
    lr: float = 5.0e-4
    warmup_steps: int = 30
    weight_decay: float = 0.2
    decay_embeddings: bool = True  # open_clip's rule; False also spares token/positional tables
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1.0e-6
    grad_clip_norm: float | None = 1.0  # None or 0: no clipping
    accum_steps: int = 1
    precision: Literal["fp32", "amp"] = "fp32"
    seed: int = 0
    lock_image: bool = False
    lock_text: bool = False
    init_from: str | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # device, mode, fusion
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    loss_scale: float = 2.0**16  # amp: initial dynamic loss scale
    loss_scale_window: int = 1000  # amp: finite steps before doubling the scale
    data_fingerprint: str = ""  # hash of the data/tokenizer the batches come from
    decode: str = "pil"  # where training images decode (clipms.loader): its pixels differ

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        d["betas"] = list(self.betas)
        d["runtime"] = self.runtime.model_dump()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        d["model"] = CLIPConfig.from_dict(d["model"])
        d["betas"] = tuple(d.get("betas", (0.9, 0.98)))
        d["runtime"] = RuntimeConfig.model_validate(d.get("runtime", {}))
        return cls(**d)

    def fingerprint(self) -> str:
        """Hash of what makes two runs produce the same weights (not checkpoint/log cadence)."""
        d = self.to_dict()
        for key in ("checkpoint_every", "keep_checkpoints", "log_every"):
            d.pop(key)
        d["runtime"].pop("device_id")  # which device of a host: the same weights
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    adam_t: int = 0  # AdamW's own step count (amp: overflowed steps are skipped, as torch's scaler)
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class TrainResult:
    model: Any  # the trained CLIP Cell
    summary: dict[str, float]
    history: list[dict[str, float]]


class RandomBatches:
    """Random images and token rows, a pure function of (seed, epoch, batch index): for benchmarks
    and tests. Tokens end in the highest id (EOT) like real captions."""

    def __init__(self, cfg: CLIPConfig, batch_size: int, batches_per_epoch: int, seed: int = 0,
                 rank: int = 0, group_size: int = 1) -> None:
        self.cfg, self.batch_size, self.batches_per_epoch = cfg, batch_size, batches_per_epoch
        self.seed, self.rank, self.group_size = seed, rank, group_size

    def global_batch(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch, index])
        n, v, t = self.batch_size * self.group_size, self.cfg.vision, self.cfg.text
        images = rng.standard_normal((n, 3, v.image_size, v.image_size), dtype=np.float32)
        tokens = rng.integers(1, t.vocab_size - 1, (n, t.context_length), dtype=np.int32)
        lengths = rng.integers(2, t.context_length + 1, n)
        for row, length in zip(tokens, lengths, strict=True):
            row[length - 1] = t.vocab_size - 1
            row[length:] = 0
        return images, tokens

    def stream(self, start: int, stop: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for index in range(start, stop):
            images, tokens = self.global_batch(*divmod(index, self.batches_per_epoch))
            yield images[lo:hi], tokens[lo:hi]


class ShardBatches:
    """The webdataset shards through `clipms.data.build_train_dataset` as a BatchSource."""

    def __init__(self, shards_dir: Path | str, tokenizer: Any, preprocess: Any, batch_size: int,
                 seed: int = 0, rank: int = 0, group_size: int = 1, workers: int = 2,
                 augment: bool = False, decode: str = "pil") -> None:
        from clipms import data

        self.shards_dir, self.tokenizer, self.preprocess = shards_dir, tokenizer, preprocess
        self.batch_size, self.seed, self.rank, self.group_size = batch_size, seed, rank, group_size
        self.workers, self.augment, self.decode = workers, augment, decode
        self.batches_per_epoch = data.steps_per_epoch(shards_dir, batch_size, group_size)

    def stream(self, start: int, stop: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        from clipms import data

        if start >= stop:
            return
        dataset = data.build_train_dataset(
            self.shards_dir, self.tokenizer, self.preprocess, self.batch_size,
            epochs=-(-stop // self.batches_per_epoch), start_step=start, seed=self.seed,
            rank=self.rank, world_size=self.group_size, workers=self.workers,
            augment=self.augment, decode=self.decode)
        batches = dataset.create_tuple_iterator(num_epochs=1, output_numpy=True)
        for _, (images, tokens) in zip(range(stop - start), batches, strict=False):
            yield images, tokens


def train(cfg: TrainConfig, source: BatchSource, checkpoint_dir: Path | str | None = None,
          callbacks: Sequence[Callback] = (), resume: bool = True,
          distributed: bool = False) -> TrainResult:
    """Train CLIP on `source`; checkpoints go to `checkpoint_dir` (rank 0 only).

    With `resume`, a checkpoint in `checkpoint_dir` whose config fingerprint matches `cfg` is
    continued. Checkpoints of another configuration (all of them, without `resume`) are moved
    into `checkpoint_dir/stale-<fingerprint>/`, never deleted, and only once the model is built
    and the run has at least one step: a configuration that fails to start leaves them in place.
    Checkpoints are written on a background thread (`checkpoint.CheckpointWriter`).
    With `distributed`, `mindspore.communication.init()` must have run (msrun): gradients are
    averaged, features all-gathered, and only rank 0 writes.
    """
    import mindspore as ms

    rank, group_size = setup_runtime(cfg, distributed)
    model, step_cell, named_trainable = build_training(cfg, distributed, group_size)
    per_epoch = source.batches_per_epoch  # batches (micro-batches) per epoch
    total = cfg.max_steps or (cfg.epochs * per_epoch) // cfg.accum_steps
    if total < 1:
        raise ValueError(f"{per_epoch} batches per epoch x {cfg.epochs} epochs is fewer than "
                         f"accum_steps={cfg.accum_steps}: not one optimizer step")
    state = TrainState()
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt_dir is not None:
        state = _maybe_resume(cfg, ckpt_dir, step_cell, named_trainable, model, rank,
                              group_size, resume)
    if distributed:
        from clipms.distributed import check_same_start

        check_same_start(state.step)  # hosts without a shared checkpoint folder would diverge
    writer = (checkpoint.CheckpointWriter(ckpt_dir, cfg.keep_checkpoints)
              if rank == 0 and ckpt_dir is not None else None)
    samples_per_step = cfg.batch_size * cfg.accum_steps * group_size
    log.info("training %d steps (%d batches per epoch), %d samples a step, rank %d/%d, from "
             "step %d", total, per_epoch, samples_per_step, rank, group_size, state.step)

    started = time.perf_counter()
    trained_samples, train_seconds = 0, 0.0
    batches = iter(source.stream(state.step * cfg.accum_steps, total * cfg.accum_steps))
    while state.step < total:
        epoch = state.step * cfg.accum_steps // per_epoch
        t0 = time.perf_counter()
        loss, norm, applied = _one_step(cfg, step_cell, batches, state, total, ms)
        if not math.isfinite(loss):
            if writer:
                writer.close()  # the last good checkpoint is complete on disk before we stop
            raise NonFiniteLossError(
                f"loss is {loss} at step {state.step + 1} (epoch {epoch}); stopping. The last "
                f"good checkpoint (if any) in {ckpt_dir} is untouched.")
        seconds = time.perf_counter() - t0
        state.step += 1
        state.adam_t += int(applied)
        if state.step > 1 or total == 1:  # the first step includes graph compilation
            trained_samples += samples_per_step
            train_seconds += seconds
        row = {"step": state.step, "epoch": epoch, "loss": loss,
               "lr": _lr(cfg, state.step - 1, total), "grad_norm": norm,
               "logit_scale": float(np.exp(model.logit_scale.asnumpy())),
               "samples_per_s": samples_per_step / seconds}
        state.history.append(row)
        if rank == 0:
            _report(cfg, row, total, callbacks)
        if writer and (state.step % cfg.checkpoint_every == 0 or state.step == total):
            _save(cfg, writer, step_cell, named_trainable, model, state, group_size)
    if writer:
        writer.close()  # the last checkpoint is on disk (a failed write raises here)

    summary = {
        "final_loss": state.history[-1]["loss"] if state.history else float("nan"),
        "steps": float(state.step),
        "epochs": state.step * cfg.accum_steps / per_epoch,
        "samples_per_s": trained_samples / train_seconds if train_seconds else 0.0,
        "wall_time_s": time.perf_counter() - started,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }
    if rank == 0:
        for callback in callbacks:
            callback.on_train_end(summary)
    return TrainResult(model=model, summary=summary, history=state.history)


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


def setup_runtime(cfg: TrainConfig, distributed: bool) -> tuple[int, int]:
    """Device, mode, kernel fusion (clipms.runtime) and seed for `cfg`, before any graph
    compiles; returns (rank, group size)."""
    configure(cfg.runtime)
    import mindspore as ms

    ms.set_seed(cfg.seed)  # same seed on every rank: identical initial weights
    return init_distributed() if distributed else (0, 1)


_DISTRIBUTED: tuple[int, int] | None = None


def init_distributed() -> tuple[int, int]:
    """Join the msrun process group once (HCCL on Ascend, NCCL on GPU, mccl on CPU, chosen by
    MindSpore from the device); returns (rank, group size)."""
    global _DISTRIBUTED
    if _DISTRIBUTED is None:
        from mindspore.communication import get_group_size, get_rank, init

        # No auto-parallel context: the train step averages gradients itself
        # (DistributedGradReducer) and the loss all-gathers features, so the graph stays the
        # single-device graph plus three collectives.
        init()
        _DISTRIBUTED = (get_rank(), get_group_size())
    return _DISTRIBUTED


def build_training(cfg: TrainConfig, distributed: bool = False,
                   group_size: int = 1) -> tuple[Any, Any, list[tuple[str, Any]]]:
    """(CLIP Cell, its TrainStep, trainable (name, parameter) pairs) for `cfg` (benchmarks use
    this too). MindSpore's mode/device must already be set."""
    model, network, named_trainable = _build_model(cfg)
    step_cell = _build_step(cfg, model, network, named_trainable, distributed, group_size)
    return model, step_cell, named_trainable


def _build_model(cfg: TrainConfig) -> tuple[Any, Any, list[tuple[str, Any]]]:
    """(the CLIP Cell, the Cell to train, trainable (name, param)); amp sets O2 on the Cell."""
    from clipms.model import CLIP, to_mixed_precision

    model = CLIP(cfg.model)
    if cfg.init_from:
        _init_from(model, cfg.init_from)
    named = []
    for name, param in model.parameters_and_names():
        locked = (cfg.lock_image and name.startswith("visual.")) or (
            cfg.lock_text and name.startswith("text."))
        param.requires_grad = not locked
        if not locked:
            named.append((name, param))
    if cfg.precision == "amp":
        to_mixed_precision(model)  # O2 in place: the parameter names stay CLIP's own
    return model, model, named


def _init_from(model: Any, path: str) -> None:
    import mindspore as ms

    if not Path(path).is_file():
        raise FileNotFoundError(f"train.init_from: {path} does not exist "
                                "(convert open_clip weights with `python -m clipms.convert`)")
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


def _build_step(cfg: TrainConfig, model: Any, network: Any,
                named_trainable: list[tuple[str, Any]], distributed: bool, group_size: int) -> Any:
    from clipms.loss import ClipLoss
    from clipms.optim import build_adamw
    from clipms.train_step import ClipWithLoss, TrainStep, use_cpu_safe_gather

    loss = use_cpu_safe_gather(ClipLoss(gather=distributed))
    net_with_loss = ClipWithLoss(network, loss)
    optimizer = build_adamw(named_trainable, cfg.betas, cfg.decay_embeddings)
    return TrainStep(
        net_with_loss, optimizer, accum_steps=cfg.accum_steps,
        max_grad_norm=cfg.grad_clip_norm or 0.0,
        loss_scale=cfg.loss_scale if cfg.precision == "amp" else None,
        loss_scale_window=cfg.loss_scale_window, logit_scale=model.logit_scale,
        max_logit_scale=MAX_LOGIT_SCALE, group_size=group_size if distributed else 1)


# --------------------------------------------------------------------------------------------
# the loop body


def _lr(cfg: TrainConfig, step: int, total: int) -> float:
    from clipms.optim import cosine_lr

    return cosine_lr(step, cfg.lr, cfg.warmup_steps, total)


def _one_step(cfg: TrainConfig, step_cell: Any, batches: Iterator, state: TrainState, total: int,
              ms: Any) -> tuple[float, float, bool]:
    """Run accum_steps micro-batches and one optimizer update; (loss, grad norm, update applied)."""
    from clipms.optim import folded_hyper

    hyper = folded_hyper(_lr(cfg, state.step, total), state.adam_t + 1, cfg.betas, cfg.eps,
                         cfg.weight_decay)
    scalars = [ms.Tensor(x) for x in hyper.tensors()]
    losses = []
    for micro in range(cfg.accum_steps):
        images, tokens = next(batches)
        apply = micro == cfg.accum_steps - 1
        loss, norm, finite = step_cell(ms.Tensor(images), ms.Tensor(tokens), *scalars, apply)
        losses.append(float(loss.asnumpy()))
    return float(np.mean(losses)), float(norm.asnumpy()), bool(finite.asnumpy())


def _report(cfg: TrainConfig, row: dict[str, float], total: int,
            callbacks: Sequence[Callback]) -> None:
    step = int(row["step"])
    if step == 1 or step % cfg.log_every == 0 or step == total:
        log.info("step %d/%d epoch %d loss %.4f lr %.3g logit_scale %.2f samples/s %.1f",
                 step, total, row["epoch"], row["loss"], row["lr"], row["logit_scale"],
                 row["samples_per_s"])
    for callback in callbacks:
        callback.on_step_end(step, dict(row))


# --------------------------------------------------------------------------------------------
# checkpoints


def _state_tensors(step_cell: Any, named_trainable: list[tuple[str, Any]],
                   model: Any) -> dict[str, Any]:
    tensors = dict(model_tensors(model))
    opt = step_cell.optimizer
    for (name, _), m, v in zip(named_trainable, opt.exp_avg, opt.exp_avg_sq, strict=True):
        tensors[f"adam_m.{name}"] = m
        tensors[f"adam_v.{name}"] = v
    tensors["loss_scale"] = step_cell.scale
    tensors["loss_scale_good_steps"] = step_cell.good_steps
    return tensors


def _save(cfg: TrainConfig, writer: checkpoint.CheckpointWriter, step_cell: Any,
          named_trainable: list, model: Any, state: TrainState, group_size: int = 1) -> None:
    meta = {"step": state.step, "adam_t": state.adam_t, "config": cfg.to_dict(),
            "fingerprint": _run_fingerprint(cfg, group_size), "group_size": group_size,
            "history": state.history}
    writer.submit(state.step, _state_tensors(step_cell, named_trainable, model), meta)


def _run_fingerprint(cfg: TrainConfig, group_size: int) -> str:
    """The config's fingerprint, plus the number of data-parallel ranks when there are several
    (they change the global batch, hence the data order and the weights)."""
    return cfg.fingerprint() if group_size == 1 else f"{cfg.fingerprint()}x{group_size}"


def _maybe_resume(cfg: TrainConfig, folder: Path, step_cell: Any, named_trainable: list,
                  model: Any, rank: int = 0, group_size: int = 1,
                  resume: bool = True) -> TrainState:
    import mindspore as ms

    found = checkpoint.load_latest(folder)
    if not resume or found is None or (
            found.meta.get("fingerprint") != _run_fingerprint(cfg, group_size)):
        if rank == 0:  # the only writer; the other ranks just start fresh too
            moved = checkpoint.set_aside(folder, found.meta.get("fingerprint") if found else None)
            if moved is not None:
                why = ("train.resume is off" if not resume else "they belong to another "
                       "configuration or other data" if found else "none of them reads back")
                log.warning("checkpoints in %s moved to %s (%s); starting fresh", folder, moved,
                            why)
        return TrainState()
    for name, param in _state_tensors(step_cell, named_trainable, model).items():
        if name not in found.tensors:
            raise ValueError(f"{found.path}: missing '{name}'; cannot resume from it")
        param.set_data(ms.Tensor(found.tensors[name], param.dtype))
    log.info("resuming from %s (step %d)", found.path, found.meta["step"])
    return TrainState(step=found.meta["step"], adam_t=found.meta["adam_t"],
                      history=list(found.meta["history"]))
