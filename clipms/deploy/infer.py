"""Inference on an exported bundle (`models/export/`): no checkpoint, no model or training code.

    from clipms.deploy.infer import Encoder
    enc = Encoder("models/export")
    image_vectors = enc.encode_images(["cat.jpg", pil_image, jpeg_bytes])  # (N, E), unit length
    text_vectors = enc.encode_texts(["a red circle", "a blue square"])    # (M, E), unit length
    scores = image_vectors @ text_vectors.T                                # cosine similarities

An Encoder may be called from several threads (a web server's thread pool): its MindIR calls take
turns through one process-wide lock, because MindSpore graphs run from two threads at once crash the
process (SIGSEGV; e.g. MLflow's scoring server runs each request's predict in a thread of its own).
Tokenizing and image decoding stay outside the lock.

Every image goes through the bundle's own decoder limits (preprocess.json: JPEG/PNG/WEBP, at most
`max_pixels`); a bad one raises PreprocessError naming it. Paths are for local, trusted callers:
the served model (registry/pyfunc_model.py, serving/) accepts images only as base64
(clipms.deploy.inputs) and never names a file to this class.

CLI: `python -m clipms.deploy.infer search --bundle models/export --shards data/shards/val "a red
circle"` prints the images of the shards that best match the query.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from clipms.data.preprocess import PreprocessConfig, PreprocessError, preprocess_image
from clipms.data.webds import Sample, iter_samples
from clipms.text.clip_tokenizer import Tokenizer

if TYPE_CHECKING:
    from clipms.runtime import RuntimeConfig

# as clipms.deploy.mindir writes it (no MindSpore import here)
BUNDLE_FORMAT = "clipms-mindir-bundle"
SUPPORTED_VERSIONS = (1, 2)  # 2: the bundle has a logit_bias (SigLIP)

ImageInput = str | Path | bytes | Image.Image
# One MindIR call at a time per process, whichever Encoder makes it: concurrent graph runs (and a
# graph loaded or compiled while another runs) crash or hang MindSpore. Uncontended, it costs ~1 us.
_MINDSPORE = threading.Lock()


class BundleError(ValueError):
    """A folder that is not a complete, supported export bundle."""


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (a zero row stays zero, as torch's F.normalize)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32)


def read_bundle(bundle_dir: Path | str) -> dict[str, Any]:
    """bundle.json, checked for format, version and the files it names."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / "bundle.json"
    if not path.is_file():
        raise BundleError(f"{bundle_dir}: no bundle.json (run the export stage first)")
    bundle = json.loads(path.read_text())
    if bundle.get("format") != BUNDLE_FORMAT or bundle.get("version") not in SUPPORTED_VERSIONS:
        raise BundleError(f"{path}: format {bundle.get('format')!r} version "
                          f"{bundle.get('version')!r} is not a supported {BUNDLE_FORMAT} "
                          f"{SUPPORTED_VERSIONS}")
    files = [bundle["image_encoder"]["file"], bundle["text_encoder"]["file"],
             bundle["text_encoder"]["input"]["tokenizer"]]
    missing = [name for name in files if not (bundle_dir / name).is_file()]
    if missing:
        raise BundleError(f"{bundle_dir}: bundle files missing: {missing}")
    return bundle


def match_probabilities(cosines: np.ndarray, logit_scale: float,
                        logit_bias: float | None = None) -> np.ndarray:
    """`Encoder.match_probabilities` for a given scale and bias (float64)."""
    logits = logit_scale * np.asarray(cosines, np.float64)
    if logit_bias is not None:  # SigLIP: every pair is its own binary decision
        return 1.0 / (1.0 + np.exp(-(logits + logit_bias)))
    weights = np.exp(logits - logits.max())
    return weights / weights.sum()


class Encoder:
    """L2-normalised CLIP embeddings from the two MindIR graphs of an export bundle."""

    def __init__(self, bundle_dir: Path | str, batch_size: int = 64,
                 kernel_fusion: bool = True, device: str | RuntimeConfig = "CPU") -> None:
        """`device` ("CPU", "GPU", "Ascend" or a whole `clipms.runtime.RuntimeConfig`) configures
        MindSpore for the process through `clipms.runtime.configure`; `kernel_fusion` is its CPU
        graph-kernel fusion (each new batch size compiles once, cached on disk)."""
        from clipms.runtime import RuntimeConfig, configure

        if not isinstance(device, RuntimeConfig):
            device = RuntimeConfig(device_target=device, kernel_fusion=kernel_fusion)
        configure(device)  # before MindSpore is imported where possible (import-time settings)
        import mindspore as ms
        from mindspore import nn

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.bundle_dir = Path(bundle_dir)
        self.bundle = read_bundle(self.bundle_dir)
        self.batch_size = batch_size
        self.preprocess = PreprocessConfig.from_dict(self.bundle["preprocess"])
        self.tokenizer = Tokenizer.load(self.bundle_dir / self.bundle["text_encoder"]["input"]
                                        ["tokenizer"])
        expected_ctx = self.bundle["text_encoder"]["input"]["shape"][1]
        if self.tokenizer.context_length != expected_ctx:
            raise BundleError(f"{self.bundle_dir}: tokenizer context length "
                              f"{self.tokenizer.context_length} != text encoder's {expected_ctx}")
        self._ms = ms
        with _MINDSPORE:
            self._image_graph = nn.GraphCell(ms.load(str(self.bundle_dir /
                                                         self.bundle["image_encoder"]["file"])))
            self._text_graph = nn.GraphCell(ms.load(str(self.bundle_dir /
                                                        self.bundle["text_encoder"]["file"])))

    @property
    def embed_dim(self) -> int:
        return int(self.bundle["embed_dim"])

    @property
    def logit_scale(self) -> float:
        """exp(learned log scale): `logit_scale * cosine (+ logit_bias)` are the model's logits."""
        return float(self.bundle["logit_scale"])

    @property
    def logit_bias(self) -> float | None:
        """SigLIP's learned bias added to every logit; None for a CLIP (softmax-trained) model."""
        bias = self.bundle.get("logit_bias")
        return None if bias is None else float(bias)

    def match_probabilities(self, cosines: np.ndarray) -> np.ndarray:
        """Probabilities of candidate matches from their cosines, as the model was trained to
        give them: CLIP's softmax over the candidates (they sum to 1), or SigLIP's sigmoid of each
        pair's logit on its own (each in [0, 1], no sum)."""
        return match_probabilities(cosines, self.logit_scale, self.logit_bias)

    def preprocess_images(self, images: Sequence[ImageInput]) -> np.ndarray:
        """(N, 3, S, S) float32 model input from paths, PIL images or encoded bytes."""
        arrays = [preprocess_image(_load_image(item, i), self.preprocess, name=_describe(item, i))
                  for i, item in enumerate(images)]
        size = self.preprocess.image_size
        return np.stack(arrays) if arrays else np.zeros((0, 3, size, size), np.float32)

    def encode_images(self, images: Sequence[ImageInput]) -> np.ndarray:
        """(N, E) unit-length float32 embeddings; a bad image raises PreprocessError naming it."""
        if isinstance(images, str | Path | bytes | Image.Image):
            images = [images]
        return self.encode_preprocessed(self.preprocess_images(images))

    def encode_preprocessed(self, images: np.ndarray) -> np.ndarray:
        """(N, E) unit-length embeddings of model-ready (N, 3, S, S) float32 arrays."""
        return self._run(self._image_graph, images)

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        """(M, E) unit-length float32 embeddings of captions or queries."""
        if isinstance(texts, str):
            texts = [texts]
        return self._run(self._text_graph, self.tokenizer.encode(list(texts)))

    def _run(self, graph: Any, inputs: np.ndarray) -> np.ndarray:
        outputs = []
        for i in range(0, inputs.shape[0], self.batch_size):
            with _MINDSPORE:
                outputs.append(graph(self._ms.Tensor(inputs[i:i + self.batch_size])).asnumpy())
        if not outputs:
            return np.zeros((0, self.embed_dim), np.float32)
        return l2_normalize(np.concatenate(outputs))


def _load_image(item: ImageInput, index: int) -> Image.Image | bytes:
    if isinstance(item, str | Path):
        path = Path(item)
        if not path.is_file():
            raise PreprocessError(f"images[{index}]: file not found: {path}")
        return path.read_bytes()
    return item


def _describe(item: ImageInput, index: int) -> str:
    return f"images[{index}] ({item})" if isinstance(item, str | Path) else f"images[{index}]"


# ---------------------------------------------------------------------------------------- CLI
def search(encoder: Encoder, shards: Path | str, query: str, top: int) -> list[dict[str, Any]]:
    """The `top` shard images closest to `query`, best first; undecodable images are skipped and
    counted (reported by the CLI), never fatal."""
    kept: list[Sample] = []
    vectors: list[np.ndarray] = []
    skipped: list[str] = []
    batch: list[Sample] = []
    for sample in iter_samples(shards):
        if sample.image is None:  # another member group (e.g. a stray file), not an image
            continue
        batch.append(sample)
        if len(batch) == encoder.batch_size:
            _encode_batch(encoder, batch, kept, vectors, skipped)
            batch = []
    _encode_batch(encoder, batch, kept, vectors, skipped)
    if not kept:
        raise ValueError(f"{shards}: no decodable images ({len(skipped)} skipped)")
    scores = np.concatenate(vectors) @ encoder.encode_texts([query])[0]
    order = np.argsort(-scores, kind="stable")[:top]
    return [{"rank": r + 1, "score": float(scores[i]), "key": kept[i].key,
             "caption": kept[i].caption or (kept[i].meta.get("captions") or [""])[0],
             "url": kept[i].meta.get("url"), "skipped": len(skipped), "searched": len(kept)}
            for r, i in enumerate(order)]


def _encode_batch(encoder: Encoder, batch: list[Sample], kept: list[Sample],
                  vectors: list[np.ndarray], skipped: list[str]) -> None:
    good, arrays = [], []
    for sample in batch:
        try:
            arrays.append(preprocess_image(sample.image, encoder.preprocess, name=sample.key))
            good.append(sample)
        except PreprocessError:
            skipped.append(sample.key)
    if good:
        vectors.append(encoder.encode_preprocessed(np.stack(arrays)))
        kept.extend(good)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clipms.deploy.infer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    find = commands.add_parser("search", help="print the shard images that best match a query")
    find.add_argument("query", help="the text to search for")
    find.add_argument("--bundle", required=True, type=Path, help="export bundle folder")
    find.add_argument("--shards", required=True, type=Path, help="a .tar shard or a folder of them")
    find.add_argument("--top", type=int, default=5, help="how many images to print (default 5)")
    find.add_argument("--batch-size", type=int, default=64)
    find.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    try:
        hits = search(Encoder(args.bundle, args.batch_size), args.shards, args.query, args.top)
    except (BundleError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    _print_hits(args.query, hits, as_json=args.json)
    return 0


def _print_hits(query: str, hits: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for hit in hits:
            print(json.dumps(hit))
        return
    print(f"query: {query!r} - best {len(hits)} of {hits[0]['searched']} images"
          + (f" ({hits[0]['skipped']} undecodable, skipped)" if hits[0]["skipped"] else ""))
    for hit in hits:
        print(f"{hit['rank']:>3}  {hit['score']:+.4f}  {hit['key']}  {hit['caption']}")


if __name__ == "__main__":
    sys.exit(main())
