"""The shard stage's input for tests: webdataset tars as img2dataset writes them (a JPEG, its first
caption and a JSON record of the row per sample), good samples numbered so each is told apart.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import webdataset as wds
from PIL import Image


def quiet(_message: str) -> None:
    """A progress callback that says nothing."""


def image_bytes(size=(64, 64), colour=(200, 40, 40), fmt="JPEG") -> bytes:
    """A flat picture encoded as `fmt`."""
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


def meta(i: int, split: str | None = "train", captions=None, **extra) -> dict:
    """The JSON record img2dataset writes for row `i`, with `extra` fields."""
    return {"url": f"http://x/{i}.jpg", "image_key": f"{i:016x}", "split": split,
            "captions": [f"caption {i}", f"second caption {i}"] if captions is None else captions,
            "labels": json.dumps({"shape": "circle"}), "key": f"{i:09d}", "status": "success",
            **extra}


def write_tar(path: Path, samples: list[dict]) -> None:
    """An img2dataset-like webdataset tar."""
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)


def good(i: int, split: str = "train") -> dict:
    """Sample `i` as a tar holds it: a valid JPEG of its own colour, caption and record."""
    data = meta(i, split)
    return {"__key__": f"{i:09d}", "jpg": image_bytes(colour=(i * 20 % 255, 80, 80)),
            "txt": data["captions"][0], "json": json.dumps(data)}
