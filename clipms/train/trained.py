"""Load what the train stage wrote: `models/clip.ckpt` + `models/clip.json` (+ the tokenizer).

`clip.json` = {"model": CLIPConfig.to_dict(), "tokenizer": "models/tokenizer.json",
"preprocess": PreprocessConfig.to_dict()}. Evaluation and export both start here, so the model
they measure and the model they ship are built the same way.
"""

# tested by: tests/clipms/deploy/test_infer.py

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipms.data.preprocess import PreprocessConfig
from clipms.model.architecture import CLIPConfig
from clipms.utils.jsonio import read_json

if TYPE_CHECKING:
    from clipms.model.clip import CLIP


class TrainedModelError(ValueError):
    """A checkpoint or run config that does not describe a loadable CLIP model."""


@dataclass(frozen=True)
class RunConfig:
    """The parts of `models/clip.json` that inference needs."""

    model: CLIPConfig
    preprocess: PreprocessConfig
    tokenizer: str | None  # the path recorded at training time (the stages pass theirs explicitly)

    @classmethod
    def read(cls, path: Path | str) -> RunConfig:
        path = Path(path)
        try:
            data: dict[str, Any] = read_json(path)
        except FileNotFoundError as err:
            raise TrainedModelError(f"{path}: not found (run the train stage first)") from err
        missing = [key for key in ("model", "preprocess") if key not in data]
        if missing:
            raise TrainedModelError(f"{path}: missing keys {missing}")
        try:
            model = CLIPConfig.from_dict(data["model"])
            preprocess = PreprocessConfig.from_dict(data["preprocess"])
        except (TypeError, ValueError) as err:
            raise TrainedModelError(f"{path}: {err}") from err
        return cls(model=model, preprocess=preprocess, tokenizer=data.get("tokenizer"))


def load_clip(checkpoint: Path | str, model_config: CLIPConfig) -> CLIP:
    """A CLIP Cell in inference mode with every parameter taken from `checkpoint`.

    Entries of the checkpoint that are not model parameters (optimizer state, metadata) are
    ignored; a model parameter that is missing or has another shape is an error naming it.
    """
    import mindspore as ms

    from clipms.model.clip import CLIP

    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise TrainedModelError(f"{checkpoint}: checkpoint not found (run the train stage first)")
    net = CLIP(model_config)
    wanted = {p.name: p for p in net.get_parameters()}
    saved = ms.load_checkpoint(str(checkpoint), choice_func=lambda name: name in wanted)
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise TrainedModelError(
            f"{checkpoint}: {len(missing)} model parameters missing, e.g. {missing[:3]} "
            "(a checkpoint of another architecture?)"
        )
    wrong = [name for name, p in wanted.items() if tuple(saved[name].shape) != tuple(p.shape)]
    if wrong:
        name = wrong[0]
        raise TrainedModelError(
            f"{checkpoint}: parameter {name} has shape {tuple(saved[name].shape)}, the config "
            f"expects {tuple(wanted[name].shape)} ({len(wrong)} mismatches)"
        )
    ms.load_param_into_net(net, saved, strict_load=True)
    net.set_train(False)
    return net
