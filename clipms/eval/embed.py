"""Embed a shard split once for evaluation: every image and every caption, batched.

`ValEmbeddings` keeps the raw (not normalised) features with the bookkeeping every metric needs:
which image each caption describes, the sample keys (to show the images again) and the labels.

The model is seen through `Towers`: the two encoders on model-ready inputs. A trained CLIP Cell
with its tokenizer is one (`CellTowers`, what the `evaluate` stage scores); an export bundle's
MindIR graphs are another (`clipms.deploy.infer.Encoder` has the same two methods), so a registered
model can be scored on a new evaluation set by the very same code.
"""

# tested by: tests/clipms/eval/test_scoring.py

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from clipms.data.dataset import eval_sample_count, iter_eval_batches
from clipms.data.preprocess import PreprocessConfig
from clipms.text.clip_tokenizer import Tokenizer

if TYPE_CHECKING:
    from clipms.model.clip import CLIP


class EvaluationError(ValueError):
    """An evaluation set or setting that cannot be evaluated (no classes, unknown field, ...)."""


@dataclass
class ValEmbeddings:
    """Raw features of a split: image i has the captions j where text_to_image[j] == i."""

    image_features: np.ndarray
    text_features: np.ndarray
    text_to_image: np.ndarray
    keys: list[str]
    labels: list[dict[str, Any] | None]
    captions: list[str]  # caption j, described by image text_to_image[j]
    skipped: list[str] = field(default_factory=list)  # keys of images the decoder refused


class Towers(Protocol):
    """A CLIP model's two encoders, as evaluation uses them (features need not be normalised)."""

    def encode_preprocessed(self, images: np.ndarray) -> np.ndarray:
        """(N, E) features of (N, 3, S, S) float32 images from `preprocess_image`."""
        ...

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        """(M, E) features of captions or prompts."""
        ...


@dataclass(frozen=True)
class CellTowers:
    """A CLIP Cell and its tokenizer as `Towers`, texts encoded `batch_size` at a time."""

    net: CLIP
    tokenizer: Tokenizer
    batch_size: int

    def encode_preprocessed(self, images: np.ndarray) -> np.ndarray:
        return encode_images(self.net, images)

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        return encode_texts(self.net, self.tokenizer, texts, self.batch_size)


def encode_images(net: CLIP, images: np.ndarray) -> np.ndarray:
    import mindspore as ms

    return net.encode_image(ms.Tensor(images)).asnumpy()


def encode_texts(net: CLIP, tokenizer: Tokenizer, texts: Sequence[str],
                 batch_size: int) -> np.ndarray:
    import mindspore as ms

    chunks = [net.encode_text(ms.Tensor(tokenizer.encode(list(texts[i:i + batch_size]))))
              .asnumpy() for i in range(0, len(texts), batch_size)]
    return np.concatenate(chunks) if chunks else np.zeros((0, net.config.embed_dim), np.float32)


def _progress(total: int, unit: str, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, mininterval=2.0)


def embed_split(towers: Towers, preprocess: PreprocessConfig, shards_dir: Path | str,
                batch_size: int, split: str) -> ValEmbeddings:
    """Every image and every caption of `split`, embedded once in batches (with a progress bar)."""
    images, keys, labels, captions, owners, skipped = [], [], [], [], [], []
    with _progress(eval_sample_count(shards_dir, split), "img", f"embed {split} images") as bar:
        for batch in iter_eval_batches(shards_dir, preprocess, batch_size, split=split,
                                       skipped=skipped):
            for key, caption_list in zip(batch.keys, batch.captions, strict=True):
                owners.extend([len(keys)] * len(caption_list))  # this image's row
                captions.extend(caption_list)
                keys.append(key)
            labels.extend(batch.labels)
            images.append(towers.encode_preprocessed(batch.images))
            bar.update(len(batch.keys))
    if not images:
        raise EvaluationError(f"{shards_dir}: split {split!r} has no decodable samples "
                              f"({len(skipped)} bad)")
    if skipped:
        print(f"embed {split}: {len(skipped)} undecodable image(s) skipped as bad samples: "
              f"{skipped[:5]}", file=sys.stderr)
    texts = []
    with _progress(len(captions), "caption", f"embed {split} captions") as bar:
        for start in range(0, len(captions), batch_size):
            texts.append(towers.encode_texts(captions[start:start + batch_size]))
            bar.update(len(texts[-1]))
    return ValEmbeddings(image_features=np.concatenate(images), text_features=np.concatenate(texts),
                         text_to_image=np.asarray(owners, dtype=np.int64), keys=keys,
                         labels=labels, captions=captions, skipped=skipped)
