"""MindIR export of the two CLIP towers, and the parity check of the exported files.

The bundle (`models/export/`) is everything inference needs and nothing from training:

    image_encoder.mindir   images (N, 3, S, S) float32, CLIP-normalised -> (N, E) float32
    text_encoder.mindir    tokens (N, context_length) int32               -> (N, E) float32
    tokenizer.json         the clipms tokenizer the model was trained with
    preprocess.json        resize shorter side + centre crop, interpolation, mean, std
    bundle.json            the above as data: files, input/output names, shapes, dtypes

The batch dimension is dynamic (exported with a `None` batch), so one file serves any batch size.
Outputs are the raw projections (not L2-normalised), as open_clip's `encode_image/encode_text`;
`clipms.deploy.infer.Encoder` normalises.

`precision` is `fp32` or `fp16`. An fp16 bundle computes as amp training does (MindSpore's O2:
every Cell in fp16 except LayerNorm; softmax in fp32 inside the model) and stores the weights of
its fp16 Cells as fp16, about half the file; inputs and outputs stay float32, so the bundle's
contract does not change.

The parity check runs both MindIR graphs (`ms.load` + `nn.GraphCell`) and the checkpoint's model,
in fp32, on the same inputs at several batch sizes. It reports the max absolute error of the raw
outputs and of the L2-normalised ones (what retrieval compares). Each precision has its own bar
(`PARITY`): fp32 is gated on the raw error, fp16 -- which keeps about three significant digits --
on the normalised one, where the size of the embeddings does not matter. The bar depends on the
bundle's precision only: an amp-trained checkpoint holds fp32 master weights, so its fp32 export
meets the fp32 bar. docs/ascend.md gives the errors measured for the half-precision bar.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from clipms.data.preprocess import PreprocessConfig
from clipms.model.architecture import CLIPConfig
from clipms.model.clip import CLIP, cast, to_mixed_precision
from clipms.utils.jsonio import write_json

BUNDLE_FORMAT = "clipms-mindir-bundle"
BUNDLE_VERSION = 1
# A bundle with a `logit_bias` (a SigLIP model) is version 2: a version-1 reader would ignore the
# bias and turn its scores into softmax probabilities, so it must refuse such a bundle instead.
BIAS_BUNDLE_VERSION = 2
IMAGE_ENCODER = "image_encoder.mindir"
TEXT_ENCODER = "text_encoder.mindir"
TOKENIZER = "tokenizer.json"
PREPROCESS = "preprocess.json"
BUNDLE = "bundle.json"


PRECISIONS = ("fp32", "fp16")


@dataclass(frozen=True)
class ParityBar:
    metric: str  # the report key suffix the tolerance applies to
    tolerance: float


# fp32: the same kernels on the same weights, only rounding noise. fp16: the unit roundoff is
# 2**-11 (about 4.9e-4) and every layer rounds again; the bar leaves a margin over the errors
# measured on the test models (docs/ascend.md), and stays far below what changes a ranking.
PARITY = {
    "fp32": ParityBar(metric="max_abs_error", tolerance=1e-5),
    "fp16": ParityBar(metric="max_abs_error_normalized", tolerance=2e-3),
}


class ParityError(RuntimeError):
    """An exported graph's outputs differ from the checkpoint's by more than the tolerance."""


class ImageEncoder(nn.Cell):
    """The image tower alone: (N, 3, S, S) float32 -> (N, E) float32 (an fp16 tower's output is
    cast back, so the bundle's contract holds at either precision)."""

    def __init__(self, clip: CLIP):
        super().__init__()
        self.clip = clip

    def construct(self, images: ms.Tensor) -> ms.Tensor:
        return cast(self.clip.encode_image(images), ms.float32)


class TextEncoder(nn.Cell):
    """The text tower alone: (N, ctx) int32 -> (N, E) float32."""

    def __init__(self, clip: CLIP):
        super().__init__()
        self.clip = clip

    def construct(self, tokens: ms.Tensor) -> ms.Tensor:
        return cast(self.clip.encode_text(tokens), ms.float32)


def to_fp16(net: CLIP) -> CLIP:
    """`net` computing and storing its weights in fp16, except LayerNorm (fp32), in place: amp
    training's O2 (`clipms.model.clip.to_mixed_precision`) plus fp16 storage of what is cast
    anyway."""
    to_mixed_precision(net, ms.float16)
    for _, cell in net.cells_and_names():
        if isinstance(cell, nn.LayerNorm):
            continue
        for _, param in cell.parameters_and_names(expand=False):
            if param.dtype == ms.float32:
                param.set_dtype(ms.float16)
    return net


def describe_bundle(model: CLIPConfig, preprocess: PreprocessConfig, logit_scale: float,
                    precision: str = "fp32", logit_bias: float | None = None) -> dict[str, Any]:
    """bundle.json: what each file is and how to feed it (None = the dynamic batch dimension)."""
    size, ctx, dim = preprocess.image_size, model.text.context_length, model.embed_dim
    features = {"shape": [None, dim], "dtype": "float32", "l2_normalized": False}
    bias = {} if logit_bias is None else {"logit_bias": logit_bias}  # added to the logits
    return {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION if logit_bias is None else BIAS_BUNDLE_VERSION,
        "embed_dim": dim,
        "precision": precision,  # of the computation; inputs and outputs are float32 either way
        "parity": {"metric": PARITY[precision].metric,
                   "tolerance": PARITY[precision].tolerance},
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
        **bias,
        "model": model.to_dict(),
        "mindspore_version": ms.__version__,
    }


def export_bundle(net: CLIP, preprocess: PreprocessConfig, tokenizer_path: Path | str,
                  out_dir: Path | str, precision: str = "fp32") -> dict[str, Any]:
    """Write the bundle to `out_dir` (replacing any previous one) and return bundle.json's data.

    `precision="fp16"` converts `net` itself (`to_fp16`): check parity against a freshly loaded
    model, as the export stage does.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    cfg: CLIPConfig = net.config
    if preprocess.image_size != cfg.vision.image_size:
        raise ValueError(f"preprocess.image_size {preprocess.image_size} != model image size "
                         f"{cfg.vision.image_size}")
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)  # a stale file of an older bundle must not survive
    out.mkdir(parents=True)
    net.set_train(False)
    logit_scale = float(np.exp(net.logit_scale.asnumpy()))  # before any fp16 rounding
    logit_bias = None if net.logit_bias is None else float(net.logit_bias.asnumpy())
    image, text = ImageEncoder(net), TextEncoder(net)
    if precision == "fp16":
        to_fp16(net)
    size, ctx = cfg.vision.image_size, cfg.text.context_length
    _export_graph(image, ms.Tensor(shape=[None, 3, size, size], dtype=ms.float32),
                  out / IMAGE_ENCODER)
    _export_graph(text, ms.Tensor(shape=[None, ctx], dtype=ms.int32), out / TEXT_ENCODER)
    shutil.copyfile(tokenizer_path, out / TOKENIZER)
    write_json(out / PREPROCESS, preprocess.to_dict())
    bundle = describe_bundle(cfg, preprocess, logit_scale, precision, logit_bias)
    for tower, file in (("image_encoder", IMAGE_ENCODER), ("text_encoder", TEXT_ENCODER)):
        bundle[tower]["input"]["graph_name"] = graph_input_name(out / file)
    write_json(out / BUNDLE, bundle)
    for path in out.iterdir():
        path.chmod(0o644)  # a bundle is shipped and served by other users: readable by all
    return bundle


def _export_graph(cell: nn.Cell, example: ms.Tensor, path: Path) -> None:
    ms.export(cell, example, file_name=str(path.with_suffix("")), file_format="MINDIR")
    if not path.is_file():
        raise RuntimeError(f"ms.export did not write {path}")


def graph_input_name(path: Path | str) -> str:
    """The input's name inside a MindIR file (MindSpore prefixes the argument's name with its
    graph's): what MindSpore Lite's converter config calls `input_shape=<name>:[...]`."""
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(Path(path).read_bytes())
    (graph_input,) = model.graph.input
    return graph_input.name


# MindSpore Lite's Ascend precision_mode that keeps each bundle's parity bar meaningful: an fp16
# bundle already chose fp16 with fp32 LayerNorm (enforce_origin keeps that); an fp32 bundle stays
# fp32 where the NPU has fp32 kernels (Lite's own default, enforce_fp16, would make it fp16).
LITE_PRECISION_MODE = {"fp32": "preferred_fp32", "fp16": "enforce_origin"}


def lite_ascend_config(bundle: dict[str, Any], tower: str, batch_sizes: Sequence[int],
                       precision_mode: str | None = None) -> str:
    """A MindSpore Lite converter config (`converter_lite --configFile=`) for one tower of an
    exported bundle on Ascend: the dynamic batch as `dynamic_dims` profiles, the precision mode.
    Written from MindSpore Lite's documentation (docs/ascend.md); not runnable here."""
    precision_mode = precision_mode or LITE_PRECISION_MODE[bundle.get("precision", "fp32")]
    spec = bundle[tower]["input"]
    dims = ",".join(str(d) for d in spec["shape"][1:])
    profiles = ",".join(f"[{b}]" for b in sorted(set(batch_sizes)))
    return (f"[ascend_context]\ninput_shape={spec['graph_name']}:[-1,{dims}]\n"
            f"dynamic_dims={profiles}\nprecision_mode={precision_mode}\n")


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
                  batch_sizes: Sequence[int], precision: str = "fp32",
                  tolerance: float | None = None) -> dict[str, Any]:
    """Errors of each MindIR graph against `net` (fp32) per batch size, raw and L2-normalised;
    `passed` if every error on the precision's gate metric is <= the tolerance (default: the
    precision's bar in `PARITY`)."""
    if images.shape[0] == 0 or tokens.shape[0] == 0:
        raise ValueError("parity check needs at least one image and one caption")
    bar = PARITY[precision]
    tolerance = bar.tolerance if tolerance is None else float(tolerance)
    bundle_dir = Path(bundle_dir)
    towers = {
        "image": (load_graph(bundle_dir / IMAGE_ENCODER), net.encode_image, images),
        "text": (load_graph(bundle_dir / TEXT_ENCODER), net.encode_text, tokens),
    }
    report: dict[str, Any] = {"precision": precision, "gate_metric": bar.metric,
                              "tolerance": tolerance, "batch_sizes": list(batch_sizes)}
    for name, (graph, reference, inputs) in towers.items():
        for batch in batch_sizes:
            x = ms.Tensor(_cycle_rows(inputs, batch))
            got, want = graph(x).asnumpy(), reference(x).asnumpy()
            if got.shape != want.shape or got.dtype != np.float32:
                raise ParityError(f"{name} encoder: MindIR output {got.dtype}{got.shape} != "
                                  f"checkpoint output float32{want.shape} at batch size {batch}")
            for metric, error in _errors(got, want).items():
                report[f"{name}_{metric}_b{batch}"] = error
        for metric in ("max_abs_error", "max_abs_error_normalized"):
            report[f"{name}_{metric}"] = max(report[f"{name}_{metric}_b{b}"] for b in batch_sizes)
    report["passed"] = all(report[f"{n}_{bar.metric}"] <= tolerance for n in towers)
    return report


def _errors(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    got, want = got.astype(np.float64), want.astype(np.float64)

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)

    return {"max_abs_error": float(np.max(np.abs(got - want))),
            "max_abs_error_normalized": float(np.max(np.abs(unit(got) - unit(want))))}


def assert_parity(report: dict[str, Any]) -> None:
    """Raise ParityError naming every tower and batch size over the tolerance."""
    tolerance, metric = report["tolerance"], report["gate_metric"]
    failures = [f"{key} = {value:.3g}" for key, value in report.items()
                if re.fullmatch(rf"(image|text)_{metric}_b\d+", key) and value > tolerance]
    if failures:
        raise ParityError(
            f"exported {report['precision']} MindIR differs from the checkpoint beyond "
            f"tolerance {tolerance:g}: " + ", ".join(failures))
