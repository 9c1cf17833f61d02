"""The train schema, written once. `TrainSettings` is every tunable of a training run: the `train`
params section is it plus the stage's own keys (`stages.train.TrainParams` extends it), and the
library's `TrainConfig` is it plus what the stage resolves (the model, the runtime section, the
data fingerprint). params.yaml documents each key for the user.

The resume fingerprint is derived from the same schema: every field counts except those declared
with `clipms.schema.cadence` (how often to log or checkpoint, how many loader processes, which
device of a host), which cannot change the trained weights.
"""

# tested by: tests/clipms/data/test_sampling.py

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from clipms.model.architecture import CLIPConfig
from clipms.runtime import RuntimeConfig
from clipms.schema import Section, cadence, weights_view

if TYPE_CHECKING:  # the loader's modules read images: not loaded to validate params
    from clipms.data.loading import LoaderSettings

# The model initialisation each `train.loss` trains from (open_clip_train's main.py: `--siglip`
# sets init_logit_scale log(10) and init_logit_bias -10; CLIP keeps the model's own, no bias).
# The train stage lays these under `train.model`'s overrides.
LOSS_INIT: dict[str, dict[str, float]] = {
    "clip": {},
    "siglip": {"init_logit_scale": math.log(10), "init_logit_bias": -10.0},
}


def check_loss_fits(loss: str, model: CLIPConfig) -> None:
    """SigLIP trains the model's logit bias; the softmax loss has no use for one (ValueError)."""
    bias = model.init_logit_bias
    if loss == "siglip" and bias is None:
        raise ValueError("train.loss='siglip' needs a model with a logit bias "
                         "(model.init_logit_bias; the train stage sets SigLIP's "
                         f"{LOSS_INIT['siglip']} unless train.model sets them)")
    if loss == "clip" and bias is not None:
        raise ValueError(f"train.loss='clip' but the model has init_logit_bias={bias} (a "
                         "SigLIP model's bias, which the softmax loss never trains): set "
                         "train.loss: siglip, or leave init_logit_bias unset")


class TrainSettings(Section):
    """The tunables of a training run (the `train` section of params.yaml documents each)."""

    model_config = ConfigDict(frozen=True)

    precision: Literal["fp32", "amp"] = "fp32"
    # clip: open_clip's ClipLoss (softmax over the batch) | siglip: its SigLipLoss (pairwise
    # sigmoid with a learned bias; the model needs init_logit_bias: LOSS_INIT)
    loss: Literal["clip", "siglip"] = "clip"
    batch_size: int = Field(64, ge=1)  # per device and micro-batch
    accum_steps: int = Field(1, ge=1)  # micro-batches per optimizer step
    epochs: int = Field(8, ge=1)
    max_steps: int | None = Field(None, ge=1)  # optimizer steps; wins over epochs
    lr: float = Field(5.0e-4, ge=0)
    warmup_steps: int = Field(30, ge=0)
    weight_decay: float = Field(0.2, ge=0)
    decay_embeddings: bool = True  # open_clip's rule: token/positional tables are decayed
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = Field(1.0e-6, gt=0)
    grad_clip_norm: float | None = Field(1.0, ge=0)  # None or 0: no clipping
    loss_scale: float = Field(2.0**16, gt=0)  # amp: initial dynamic loss scale
    loss_scale_window: int = Field(1000, ge=1)  # amp: finite steps before doubling the scale
    seed: int = 0  # initial weights, data order, captions, augmentation
    augment: bool = False
    # Hard-negative batches: label fields whose values the grouped batches share (None: off).
    group_by: tuple[str, ...] | None = None
    group_fraction: float = Field(0.5, ge=0, le=1)  # of each epoch's global batches, grouped
    decode: Literal["pil", "cpu", "ascend"] = "pil"  # where training images decode
    lock_image: bool = False
    lock_text: bool = False
    init_from: str | None = None
    workers: Literal["auto"] | Annotated[int, Field(ge=0)] = cadence("auto")
    checkpoint_every: int = cadence(100, ge=1)
    keep_checkpoints: int = cadence(2, ge=1)
    log_every: int = cadence(10, ge=1)
    # Alarms (they stop a run, never change its weights): amp steps skipped (gradients or loss
    # not finite) in more than this share of the run's steps; this many consecutive amp steps
    # with a loss that is not finite (an fp32 one stops at the first: its update is not skipped).
    max_skipped_share: float = cadence(0.25, ge=0, le=1)
    max_nonfinite_steps: int = cadence(3, ge=1)


    @field_validator("group_by", mode="before")
    @classmethod
    def _fields(cls, value: Any) -> Any:
        """One field may be given as a string (`-S train.group_by=colour`); [] means off."""
        if isinstance(value, str):
            return (value,)
        return value or None

    def loader(self, rank: int = 0, world_size: int = 1, workers: int = 0) -> LoaderSettings:
        """The training loader's settings for one rank of `world_size`, with `workers` decode
        workers (`train.workers` resolved in that rank's process)."""
        from clipms.data.loading import LoaderSettings

        return LoaderSettings(seed=self.seed, rank=rank, world_size=world_size, workers=workers,
                              augment=self.augment, decode=self.decode, group_by=self.group_by,
                              group_fraction=self.group_fraction)


class TrainConfig(TrainSettings):
    """What the trainer runs: the settings, the resolved model and runtime, and the data."""

    model: CLIPConfig
    runtime: RuntimeConfig = RuntimeConfig()
    data_fingerprint: str = ""  # the data, tokenizer and training code the batches come from
    # "auto" is resolved in each rank's own process: clipms.train.feed.rank_loader_workers
    workers: Literal["auto"] | Annotated[int, Field(ge=0)] = cadence(2)

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, value: Any) -> Any:
        return CLIPConfig.from_dict(value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _loss_fits_model(self) -> TrainConfig:
        check_loss_fits(self.loss, self.model)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return cls.model_validate(data)

    def fingerprint(self) -> str:
        """Hash of every setting that changes the trained weights (not the `cadence` ones)."""
        text = json.dumps(weights_view(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
