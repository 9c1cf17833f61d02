"""MindIR export of the two CLIP towers, and the parity check of the exported files.

The bundle (`models/export/`) is everything inference needs and nothing from training:

    image_encoder.mindir   images (N, 3, S, S) float32, CLIP-normalised -> (N, E) float32
    text_encoder.mindir    tokens (N, context_length) int32               -> (N, E) float32
    tokenizer.json         the clipms tokenizer the model was trained with
    preprocess.json        resize shorter side + centre crop, interpolation, mean, std
    bundle.json            the above as data: files, input/output names, shapes, dtypes

The batch dimension is dynamic (exported with a `None` batch), so one file serves any batch size.
Outputs are the raw projections (not L2-normalised), as open_clip's `encode_image/encode_text`;
`clipms.infer.Encoder` normalises. The parity check runs both MindIR graphs (`ms.load` +
`nn.GraphCell`) and the checkpoint's model on the same inputs at several batch sizes and compares
the outputs element by element (max absolute error; fp32 bar 1e-5).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from clipms.config import CLIPConfig
from clipms.jsonio import write_json
from clipms.model import CLIP
from clipms.preprocess import PreprocessConfig

BUNDLE_FORMAT = "clipms-mindir-bundle"
BUNDLE_VERSION = 1
IMAGE_ENCODER = "image_encoder.mindir"
TEXT_ENCODER = "text_encoder.mindir"
TOKENIZER = "tokenizer.json"
PREPROCESS = "preprocess.json"
BUNDLE = "bundle.json"


class ParityError(RuntimeError):
    """An exported graph's outputs differ from the checkpoint's by more than the tolerance."""


class ImageEncoder(nn.Cell):
    """The image tower alone: (N, 3, S, S) float32 -> (N, E)."""

    def __init__(self, clip: CLIP):
        super().__init__()
        self.clip = clip

    def construct(self, images: ms.Tensor) -> ms.Tensor:
        return self.clip.encode_image(images)


class TextEncoder(nn.Cell):
    """The text tower alone: (N, ctx) int32 -> (N, E)."""

    def __init__(self, clip: CLIP):
        super().__init__()
        self.clip = clip

    def construct(self, tokens: ms.Tensor) -> ms.Tensor:
        return self.clip.encode_text(tokens)


def describe_bundle(model: CLIPConfig, preprocess: PreprocessConfig,
                    logit_scale: float) -> dict[str, Any]:
    """bundle.json: what each file is and how to feed it (None = the dynamic batch dimension)."""
    size, ctx, dim = preprocess.image_size, model.text.context_length, model.embed_dim
    features = {"shape": [None, dim], "dtype": "float32", "l2_normalized": False}
    return {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "embed_dim": dim,
        "image_encoder": {
            "file": IMAGE_ENCODER,
            "input": {"name": "images", "shape": [None, 3, size, size], "dtype": "float32",
                      "layout": "NCHW", "preprocess": PREPROCESS},
            "output": {"name": "image_features", **features},
        },
        "text_encoder": {
            "file": TEXT_ENCODER,
            "input": {"name": "tokens", "shape": [None, ctx], "dtype": "int32",
                      "tokenizer": TOKENIZER, "padding": "0 after EOT; EOT is the highest id"},
            "output": {"name": "text_features", **features},
        },
        "preprocess": preprocess.to_dict(),
        "logit_scale": logit_scale,  # exp(learned log scale): multiplies cosines into logits
        "model": model.to_dict(),
        "mindspore_version": ms.__version__,
    }


def export_bundle(net: CLIP, preprocess: PreprocessConfig, tokenizer_path: Path | str,
                  out_dir: Path | str) -> dict[str, Any]:
    """Write the bundle to `out_dir` (replacing any previous one) and return bundle.json's data."""
    cfg: CLIPConfig = net.config
    if preprocess.image_size != cfg.vision.image_size:
        raise ValueError(f"preprocess.image_size {preprocess.image_size} != model image size "
                         f"{cfg.vision.image_size}")
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)  # a stale file of an older bundle must not survive
    out.mkdir(parents=True)
    net.set_train(False)
    size, ctx = cfg.vision.image_size, cfg.text.context_length
    _export_graph(ImageEncoder(net), ms.Tensor(shape=[None, 3, size, size], dtype=ms.float32),
                  out / IMAGE_ENCODER)
    _export_graph(TextEncoder(net), ms.Tensor(shape=[None, ctx], dtype=ms.int32),
                  out / TEXT_ENCODER)
    shutil.copyfile(tokenizer_path, out / TOKENIZER)
    write_json(out / PREPROCESS, preprocess.to_dict())
    logit_scale = float(np.exp(net.logit_scale.asnumpy()))
    bundle = describe_bundle(cfg, preprocess, logit_scale)
    write_json(out / BUNDLE, bundle)
    for path in out.iterdir():
        path.chmod(0o644)  # a bundle is shipped and served by other users: readable by all
    return bundle


def _export_graph(cell: nn.Cell, example: ms.Tensor, path: Path) -> None:
    ms.export(cell, example, file_name=str(path.with_suffix("")), file_format="MINDIR")
    if not path.is_file():
        raise RuntimeError(f"ms.export did not write {path}")


def load_graph(path: Path | str) -> nn.GraphCell:
    """An exported MindIR file as a callable cell."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: MindIR file not found")
    return nn.GraphCell(ms.load(str(path)))


def _cycle_rows(x: np.ndarray, n: int) -> np.ndarray:
    """The first n rows of x repeated as often as needed (few val samples, large batch sizes)."""
    return x[np.arange(n) % x.shape[0]]


def parity_report(net: CLIP, bundle_dir: Path | str, images: np.ndarray, tokens: np.ndarray,
                  batch_sizes: Sequence[int], tolerance: float) -> dict[str, Any]:
    """Max abs error of each MindIR graph against `net` per batch size; `passed` if all <= tol."""
    if images.shape[0] == 0 or tokens.shape[0] == 0:
        raise ValueError("parity check needs at least one image and one caption")
    bundle_dir = Path(bundle_dir)
    towers = {
        "image": (load_graph(bundle_dir / IMAGE_ENCODER), net.encode_image, images),
        "text": (load_graph(bundle_dir / TEXT_ENCODER), net.encode_text, tokens),
    }
    report: dict[str, Any] = {"tolerance": float(tolerance), "batch_sizes": list(batch_sizes)}
    for name, (graph, reference, inputs) in towers.items():
        errors = []
        for batch in batch_sizes:
            x = ms.Tensor(_cycle_rows(inputs, batch))
            got, want = graph(x).asnumpy(), reference(x).asnumpy()
            if got.shape != want.shape:
                raise ParityError(f"{name} encoder: MindIR output shape {got.shape} != "
                                  f"checkpoint output shape {want.shape} at batch size {batch}")
            errors.append(float(np.max(np.abs(got.astype(np.float64) - want))))
            report[f"{name}_max_abs_error_b{batch}"] = errors[-1]
        report[f"{name}_max_abs_error"] = max(errors)
    report["passed"] = all(report[f"{n}_max_abs_error"] <= tolerance for n in towers)
    return report


def assert_parity(report: dict[str, Any]) -> None:
    """Raise ParityError naming every tower and batch size over the tolerance."""
    tolerance = report["tolerance"]
    failures = [f"{key} = {value:.3g}" for key, value in report.items()
                if "_max_abs_error_b" in key and value > tolerance]
    if failures:
        raise ParityError(
            f"exported MindIR differs from the checkpoint beyond tolerance {tolerance:g}: "
            + ", ".join(failures)
        )
