"""A retrieval gallery: what the model finds, as one PNG a person can read at a glance.

Top rows (text -> image): for a fixed set of query captions, the K best images of the split, each
framed green when it is a hit and red when not, with its first caption under it. Bottom rows
(image -> text): for a few images (framed blue), their K best captions, each marked as hit or
miss. The queries are fixed by the split alone (evenly spaced images and their first captions), so
two runs on the same split show the same queries.

A hit is the query's own image (or caption), or, when the images carry a class (the zero-shot
label fields, e.g. "red circle"), any image of the same class: on data where many images share a
description, an image of the right class is a right answer.
"""

# tested by: tests/clipms/eval/test_scoring_run.py

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from clipms.eval.embed import ValEmbeddings
from clipms.eval.metrics import l2_normalize
from clipms.utils.atomic import atomic_write

HIT_RGB = (0, 200, 0)  # frames baked into the tiles' pixels, in colours no image here uses
MISS_RGB = (230, 0, 0)
QUERY_RGB = (0, 90, 255)
TILE_PIXELS = 96
FRAME_PIXELS = 6


@dataclass(frozen=True)
class Retrieved:
    index: int  # an image row (text -> image) or a caption index (image -> text)
    score: float
    hit: bool


@dataclass(frozen=True)
class Query:
    index: int  # the query caption (text -> image) or image row (image -> text)
    results: tuple[Retrieved, ...]


@dataclass(frozen=True)
class Gallery:
    text_queries: tuple[Query, ...]
    image_queries: tuple[Query, ...]
    top_k: int

    @property
    def tiles(self) -> int:
        """Framed image tiles: K results per text query, plus one per image query."""
        return len(self.text_queries) * self.top_k + len(self.image_queries)


def spread(n: int, count: int, phase: float) -> list[int]:
    """`count` distinct indices spread evenly over range(n), at `phase` (0-1) of each step."""
    count = min(count, n)
    return sorted({int((i + phase) * n / count) for i in range(count)})


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best scores, the lower index first among equal scores."""
    return np.argsort(-scores, kind="stable")[:k]


def build_gallery(val: ValEmbeddings, classes: Sequence[str | None] | None, text_queries: int,
                  image_queries: int, top_k: int) -> Gallery:
    """Queries and their top-K results; `classes[i]` is image i's class (None: unknown)."""
    images = l2_normalize(val.image_features, "image_features")
    texts = l2_normalize(val.text_features, "text_features")
    owner = val.text_to_image

    def same(a: int, b: int) -> bool:
        return a == b or (classes is not None and classes[a] is not None
                          and classes[a] == classes[b])

    first_caption = {int(i): j for j, i in reversed(list(enumerate(owner.tolist())))}
    t2i = []
    for row in spread(len(val.keys), text_queries, 0.25):
        caption = first_caption[row]
        scores = images @ texts[caption]
        t2i.append(Query(caption, tuple(Retrieved(int(i), float(scores[i]), same(int(i), row))
                                        for i in _top(scores, top_k))))
    i2t = []
    for row in spread(len(val.keys), image_queries, 0.75):  # not the text queries' own images
        scores = texts @ images[row]
        i2t.append(Query(row, tuple(Retrieved(int(j), float(scores[j]), same(int(owner[j]), row))
                                    for j in _top(scores, top_k))))
    return Gallery(tuple(t2i), tuple(i2t), top_k)


def framed_tile(image: Image.Image, rgb: tuple[int, int, int]) -> np.ndarray:
    """The image as a square thumbnail inside a solid frame of colour `rgb` (uint8 HxWx3)."""
    inner = TILE_PIXELS - 2 * FRAME_PIXELS
    thumb = np.asarray(image.convert("RGB").resize((inner, inner), Image.Resampling.BICUBIC))
    tile = np.empty((TILE_PIXELS, TILE_PIXELS, 3), np.uint8)
    tile[:] = rgb
    tile[FRAME_PIXELS:-FRAME_PIXELS, FRAME_PIXELS:-FRAME_PIXELS] = thumb
    return tile


def _wrap(text: str, width: int, lines: int) -> str:
    wrapped = textwrap.wrap(text, width) or [""]
    if len(wrapped) > lines:
        wrapped = [*wrapped[:lines - 1], wrapped[lines - 1][:width - 3] + "..."]
    return "\n".join(wrapped)


def render_gallery(path: Path | str, gallery: Gallery, val: ValEmbeddings,
                   read_image: Callable[[int], Image.Image], title: str) -> None:
    """Draw `gallery` into a PNG at `path`; `read_image(row)` gives the split's image `row`."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; and never pop up a window from a pipeline stage
    import matplotlib.pyplot as plt

    k, rows = gallery.top_k, len(gallery.text_queries) + len(gallery.image_queries)
    height = 2.0 * max(rows, 1) + 0.6
    fig = plt.figure(figsize=(1.75 * (k + 1), height))
    grid = fig.add_gridspec(max(rows, 1), k + 1, hspace=0.6, wspace=0.08, left=0.02, right=0.98,
                            bottom=0.45 / height, top=1 - 0.55 / height)
    first_caption = {int(i): val.captions[j] for j, i in reversed(list(enumerate(
        val.text_to_image.tolist())))}

    def tile(ax, row: int, rgb: tuple[int, int, int], label: str) -> None:
        ax.imshow(framed_tile(read_image(row), rgb), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_xlabel(label, fontsize=6, linespacing=1.1)

    for r, query in enumerate(gallery.text_queries):
        head = fig.add_subplot(grid[r, 0])
        head.set_axis_off()
        head.text(0.0, 0.5, "text -> image\n\n" + _wrap(val.captions[query.index], 22, 6),
                  fontsize=7, va="center", ha="left", transform=head.transAxes)
        for c, found in enumerate(query.results):
            rgb = HIT_RGB if found.hit else MISS_RGB
            tile(fig.add_subplot(grid[r, c + 1]), found.index, rgb,
                 f"#{c + 1} {found.score:.2f}\n" + _wrap(first_caption[found.index], 30, 3))
    for r, query in enumerate(gallery.image_queries, start=len(gallery.text_queries)):
        tile(fig.add_subplot(grid[r, 0]), query.index, QUERY_RGB,
             "image -> text\n" + _wrap(first_caption[query.index], 30, 2))
        listing = fig.add_subplot(grid[r, 1:])
        listing.set_axis_off()
        for c, found in enumerate(query.results):
            mark, colour = ("hit ", "#008800") if found.hit else ("miss", "#cc0000")
            listing.text(0.0, 1.0 - (c + 0.5) / k, f"#{c + 1}  {mark}  {found.score:.2f}   "
                         + _wrap(val.captions[found.index], 90, 1), color=colour, fontsize=8,
                         va="center", ha="left", transform=listing.transAxes, family="monospace")
    fig.suptitle(title, fontsize=10, y=1 - 0.2 / height)
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
