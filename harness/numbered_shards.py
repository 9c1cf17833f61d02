"""Shards in the contract format whose every sample says its number: the picture's flat colour
and the caption ("sample N caption C") both encode it, so a test can check that a batch's images
and texts belong together and which samples a loader read.

`write_shards(root, {"train": [13, 12]})` writes the tars and the manifest; `run_loader` reads them
through the real training loader, `ids_of` turns its batches back into (sample, caption) numbers.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from clipms.data import webds
from clipms.data.dataset import build_train_dataset
from clipms.data.loading import LoaderSettings
from clipms.data.preprocess import PreprocessConfig
from clipms.text.clip_tokenizer import Tokenizer

CAPTIONS = 3  # captions per sample
PRE = PreprocessConfig(image_size=16)


def colour_of(i: int) -> tuple[int, int, int]:
    """A flat colour that encodes the sample number (coarse steps survive JPEG)."""
    return (40 * (i % 6) + 20, 40 * (i // 6 % 6) + 20, 40 * (i // 36) + 20)


def decode_colour(image: np.ndarray) -> int:
    """The generator's colour index of an image: training batches are uint8 pixels, evaluation
    batches normalised floats."""
    mean, std = np.array(PRE.mean), np.array(PRE.std)
    rgb = image[:, 8, 8].astype(float) if image.dtype == np.uint8 else (
        (image[:, 8, 8] * std + mean) * 255)
    r, g, b = (int(round((v - 20) / 40)) for v in rgb)
    return r + 6 * g + 36 * b


def jpeg(i: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (24, 20), colour_of(i)).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def write_shards(root: Path, sizes: dict[str, list[int]]) -> Path:
    """Shards `root/{split}/00000N.tar` with sizes[split][n] samples each, plus the manifest."""
    numbers = iter(range(sum(map(sum, sizes.values()))))
    splits = {}
    for split, shard_sizes in sizes.items():
        shards = []
        for n, count in enumerate(shard_sizes):
            name = webds.SHARD_NAME.format(split=split, index=n)
            samples = [sample_files(next(numbers), split) for _ in range(count)]
            shards.append({"name": name, **webds.write_tar(root / name, samples)})
        splits[split] = webds.split_summary(shards)
    webds.write_manifest(root, max(max(v) for v in sizes.values()), splits)
    return root


def sample_files(number: int, split: str) -> webds.SampleFiles:
    key = f"{number:09d}"
    captions = [f"sample {number} caption {c}" for c in range(CAPTIONS)]
    meta = {"captions": captions, "url": f"file:///{key}.jpg", "key": key, "split": split,
            "labels": {"shape": ["circle", "square"][number % 2]}}
    return key, {"jpg": jpeg(number), "txt": captions[0].encode(),
                 "json": json.dumps(meta).encode()}


def identify(text_row: np.ndarray, tok: Tokenizer) -> tuple[int, int]:
    """(sample number, caption number) from tokens of 'sample N caption C' (digits are split)."""
    words = tok.decode(text_row).split()
    i = words.index("caption")
    return int("".join(words[1:i])), int("".join(words[i + 1:]))


def run_loader(shards: Path, tok: Tokenizer, batch_size: int, **kw) -> list[tuple]:
    """The loader's batches; `kw` holds LoaderSettings fields and the per-call steps."""
    settings = {k: kw.pop(k) for k in list(kw) if k in LoaderSettings.__dataclass_fields__}
    ds = build_train_dataset(shards, tok, PRE, batch_size, LoaderSettings(**settings), **kw)
    return [(img, txt) for img, txt in ds.create_tuple_iterator(num_epochs=1, output_numpy=True)]


def ids_of(batches: list[tuple], tok: Tokenizer) -> list[list[tuple[int, int]]]:
    """Per batch, (sample, caption) of each row, checking that image and text belong together."""
    out = []
    for images, texts in batches:
        rows = [identify(t, tok) for t in texts]
        assert [decode_colour(im) for im in images] == [r[0] for r in rows]
        out.append(rows)
    return out
