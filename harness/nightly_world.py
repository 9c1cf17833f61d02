"""A growing source for nightly runs: a loopback image site with many distinct images and a local
metadata parquet (`metadata.source: local`) that lists more of them night after night, as a
team's caption export does. The data stages run as DVC runs them (`python -m stages.<name>` in
the workspace folder); `night` runs them in order and says what each printed.
"""

from __future__ import annotations

import colorsys
import hashlib
import io
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from PIL import Image

from harness.image_site import Site, run_stage

SHAPES = ("circle", "square", "triangle", "star", "cross", "ring", "blob", "hexagon")
DATA_STAGES = ("metadata", "dedupe", "download", "shard", "tokenizer", "changes")


def picture(index: int, size: tuple[int, int] = (96, 80)) -> bytes:
    """A distinct JPEG for each index: its own colour, and a band where its index is."""
    hue = (index * 0.61803) % 1.0
    colour = tuple(int(255 * c) for c in colorsys.hsv_to_rgb(hue, 0.7, 0.9))
    image = Image.new("RGB", size, colour)
    band = (index * 7) % (size[0] - 8)
    image.paste((255 - colour[0], 255 - colour[1], 255 - colour[2]), (band, 0, band + 8, size[1]))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220),
           "yellow": (230, 220, 20)}
DRAWN = ("square", "circle", "stripe")


def drawn_class(index: int) -> tuple[str, str]:
    """(colour, shape) of `shape_picture(index)`: twelve classes, each index's neighbour differs
    in colour."""
    return list(COLOURS)[index % len(COLOURS)], DRAWN[(index // len(COLOURS)) % len(DRAWN)]


def shape_picture(index: int) -> bytes:
    """A learnable picture: a coloured square, circle or stripe on grey (what its captions say)."""
    from PIL import ImageDraw

    colour, shape = drawn_class(index)
    image = Image.new("RGB", (64, 64), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    shift = index % 5 - 2  # pictures of one class differ a little
    box = (16 + shift, 16 - shift, 48 + shift, 48 - shift)
    if shape == "stripe":
        draw.rectangle((0, 28 + shift, 64, 36 + shift), fill=COLOURS[colour])
    else:
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def shape_captions(index: int) -> list[str]:
    colour, shape = drawn_class(index)
    return [f"a {colour} {shape} number {index}", f"picture {index} shows a {shape} in {colour}"]


def derangement(indices: range, seed: int = 0) -> dict[int, int]:
    """A random permutation of `indices` that moves every one (Sattolo's algorithm: one cycle)."""
    order = list(indices)
    rng = random.Random(seed)
    for i in range(len(order) - 1, 0, -1):
        j = rng.randrange(i)
        order[i], order[j] = order[j], order[i]
    return dict(zip(indices, order, strict=True))


def poisoned_captions(new: range) -> Callable[[int], list[str]]:
    """Captions where the pictures of `new` carry each other's (none keeps its own), the rest
    their own: a poisoned batch that no count, length or vocabulary check can see."""
    swapped = derangement(new)
    return lambda index: shape_captions(swapped.get(index, index))


def captions_for(index: int) -> list[str]:
    shape = SHAPES[index % len(SHAPES)]
    return [f"a {shape} drawn as picture number {index}", f"picture {index} shows a {shape}"]


class GrowingSource:
    """`capacity` images at `/img/<i>.jpg` of a Site (started by the caller), and the metadata
    parquet `folder/source.parquet` listing the images a night's export holds."""

    def __init__(self, folder: Path, capacity: int, size: tuple[int, int] = (96, 80),
                 draw: Callable[[int], bytes] | None = None) -> None:
        self.folder = folder
        draw = draw or (lambda index: picture(index, size))
        self.files = {f"/img/{i}.jpg": draw(i) for i in range(capacity)}
        self.path = folder / "source.parquet"

    def site(self, **kwargs: Any) -> Site:
        return Site(files=self.files, **kwargs)

    def url(self, site: Site, index: int) -> str:
        return f"{site.base}/img/{index}.jpg"

    def write(self, site: Site, indices: Iterable[int],
              captions: Callable[[int], list[str]] = captions_for,
              extra: Iterable[dict[str, Any]] = ()) -> pd.DataFrame:
        """The export of one night: a row per caption of each image of `indices`, plus `extra`
        rows (URL, TEXT, ... as given)."""
        rows = [{"URL": self.url(site, i), "TEXT": text} for i in indices for text in captions(i)]
        frame = pd.DataFrame([*rows, *extra])
        self.folder.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(self.path, index=False)
        return frame


def write_params(folder: Path, source: Path, **sections: dict[str, Any]) -> None:
    """params.yaml for the data stages on a local source (each section's keys may be given)."""
    params: dict[str, dict[str, Any]] = {
        "metadata": {"source": "local", "path": str(source.resolve())},
        "dedupe": {"keep": "all", "min_caption_chars": 5, "val_fraction": 0.25},
        "download": {"image_size": 64, "resize_mode": "center_crop", "encode_quality": 90,
                     "processes": 1, "threads": 8, "timeout": 5, "retries": 0,
                     "samples_per_shard": 8, "allowed_schemes": ["http", "https"],
                     "allow_private_addresses": True, "min_success_rate": 0.0},
        "shard": {"samples_per_shard": 8, "min_image_size": 32, "seed": 0, "workers": 1},
        "tokenizer": {"kind": "bpe", "vocab_size": 600, "context_length": 16},
        "changes": {"min_new": 4},
    }
    for name, keys in sections.items():
        params.setdefault(name, {}).update(keys)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params))


def shard_content(folder: Path) -> dict[str, dict[str, str]]:
    """Per split, every sample the workspace's shard manifest lists (excluded ones left out):
    key -> sha256 of its members' bytes. Two workspaces with the same content may hold it in
    other shards: a nightly one appends, a from-scratch one writes all at once."""
    from clipms.data import webds

    content: dict[str, dict[str, str]] = {}
    for split in ("train", "val"):
        content[split] = {}
        for sample in webds.iter_split(folder / "data/shards", split):
            digest = hashlib.sha256()
            for ext, data in sorted(sample.files.items()):
                digest.update(f"{ext}\0{len(data)}\0".encode() + data)
            content[split][sample.key] = digest.hexdigest()
    return content


def night(folder: Path, stages: Iterable[str] = DATA_STAGES, check: bool = True) -> dict[str, Any]:
    """Run the stages in order in `folder` (stopping at the first that fails); {stage: process}."""
    done = {}
    for stage in stages:
        done[stage] = proc = run_stage(stage, folder, check=check)
        if proc.returncode != 0:
            break
    return done
