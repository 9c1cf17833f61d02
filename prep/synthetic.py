"""A deterministic, generated MSCOCO look-alike: images of simple shapes with 5 captions each.

Every image shows 1-3 copies of one shape in one colour, of a given size, at a given position, on a
plain background. Its five captions are written from varied templates and always name the colour and
the shape (so a tiny CLIP can learn them in minutes on a CPU); some are exact or near duplicates of
another caption of the same image (case, spacing, punctuation), as in real caption data, so that the
dedupe stage has real work. The attribute space is small on purpose (6 shapes x 6 colours) so
that retrieval and zero-shot classification on shape/colour are clearly above chance after short
training.

Image `i` depends only on (seed, i): growing `num_images` keeps the earlier images identical.

Caption style `mscoco` (a rehearsal at MSCOCO's size, `benchmarks/rehearsal.py`) keeps the same
images and the same duplicate rates but writes each caption at a length drawn from MSCOCO's
caption-length distribution (`MSCOCO_CAPTION_WORDS`), and gives a few images a sixth or seventh
caption as MSCOCO has; its captions come from a separate random stream, so the pixels are the
default style's.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 225),
    "yellow": (240, 215, 40),
    "purple": (145, 60, 185),
    "orange": (245, 140, 30),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "grey": (128, 128, 128),
    "black": (20, 20, 20),
}
SIZES = ("small", "medium", "large")
POSITIONS = ("centre", "left", "right", "top", "bottom")
# Half-extent of one object as a fraction of the image side, per size class (jittered within).
_SIZE_RADIUS = {"small": (0.16, 0.19), "medium": (0.21, 0.25), "large": (0.28, 0.33)}
_MAX_SCATTERED_RADIUS = 0.19
# Nuisance attributes (small objects, several objects, off-centre) slow down how fast a tiny ViT
# learns shape (docs/data-sources.md, "Measurements behind the defaults"): keep them mild.
_POSITION_WEIGHTS = (0.4, 0.15, 0.15, 0.15, 0.15)
_COUNT_WEIGHTS = {1: 0.8, 2: 0.15, 3: 0.05}
_COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
_SUPERSAMPLE = 2  # draw at 2x and downsample: smooth (anti-aliased) edges as in a photo
CAPTIONS_PER_IMAGE = 5
EXACT_DUPLICATE_RATE = 0.15  # share of images whose last caption repeats the first verbatim
NEAR_DUPLICATE_RATE = 0.25  # share of images with a case/spacing/punctuation variant of a caption
CAPTION_STYLES = ("templates", "mscoco")

# Words per caption (weights, /10,045) shaped to MSCOCO's published caption statistics, not
# fitted to its files (none were at hand): mean ~10.5 words, annotators asked for at least 8
# (Chen et al. 2015, "Microsoft COCO Captions"; a few shorter ones slipped through), most between
# 8 and 15, a long thin tail to ~50. This table: mean 10.51, 94.3 % within 8-15, 1.5 % under 8,
# longest 50 (docs/data-sources.md).
MSCOCO_CAPTION_WORDS: dict[int, int] = {
    5: 5, 6: 25, 7: 120, 8: 1650, 9: 2400, 10: 2000, 11: 1400, 12: 900, 13: 560, 14: 350,
    15: 215, 16: 130, 17: 85, 18: 55, 19: 38, 20: 27,
    **dict.fromkeys(range(21, 26), 10), **dict.fromkeys(range(26, 36), 2),
    **dict.fromkeys(range(36, 51), 1),
}
# Captions per image in MSCOCO 2017: 591,753 for 118,287 train images (5.003 each): almost
# always 5, now and then 6 or 7.
MSCOCO_CAPTIONS_PER_IMAGE: dict[int, float] = {5: 0.9975, 6: 0.00225, 7: 0.00025}


@dataclass(frozen=True)
class Scene:
    """The attributes of one generated image: also its LABELS and the facts its captions state."""

    shape: str
    colour: str
    count: int
    size: str
    position: str  # one of POSITIONS for a single object; "scattered" for 2-3 objects
    background: str

    def labels(self) -> dict[str, str | int]:
        return {"shape": self.shape, "colour": self.colour, "count": self.count, "size": self.size,
                "position": self.position, "background": self.background}


@dataclass(frozen=True)
class SyntheticImage:
    """One generated image: its file name (relative to the image folder), scene and captions."""

    file_name: str
    scene: Scene
    captions: tuple[str, ...]

    @property
    def labels_json(self) -> str:
        return json.dumps(self.scene.labels())


def image_rng(seed: int, index: int) -> random.Random:
    """The random stream of image `index`. String seeds are hashed with SHA-512 by `random`, so the
    stream is the same on every machine and Python run (no PYTHONHASHSEED dependence)."""
    return random.Random(f"clipms-synthetic:{seed}:{index}")


def sample_scene(rng: random.Random) -> Scene:
    count = rng.choices(list(_COUNT_WEIGHTS), weights=list(_COUNT_WEIGHTS.values()))[0]
    # Several large objects do not fit side by side: multiples are small.
    size = rng.choice(SIZES) if count == 1 else "small"
    position = rng.choices(POSITIONS, weights=_POSITION_WEIGHTS)[0] if count == 1 else "scattered"
    return Scene(shape=rng.choice(SHAPES), colour=rng.choice(list(COLOURS)), count=count,
                 size=size, position=position, background=rng.choice(list(BACKGROUNDS)))


# ---------------------------------------------------------------------------------------------
# Drawing


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, int, int]:
    r, g, b = (min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)
    return r, g, b


def _regular_polygon(cx: float, cy: float, radius: float, sides: int, angle: float,
                     inner: float | None = None) -> list[tuple[float, float]]:
    """Vertices of a regular polygon, or of a star when `inner` (inner radius ratio) is given."""
    points = []
    steps = sides * 2 if inner else sides
    for k in range(steps):
        r = radius * (inner if inner and k % 2 else 1.0)
        theta = angle + 2 * math.pi * k / steps - math.pi / 2
        points.append((cx + r * math.cos(theta), cy + r * math.sin(theta)))
    return points


def _cross(cx: float, cy: float, radius: float, angle: float) -> list[tuple[float, float]]:
    """A plus sign whose arms are a third of its width, rotated by `angle`."""
    a, t = radius, radius / 3
    outline = [(-t, -a), (t, -a), (t, -t), (a, -t), (a, t), (t, t), (t, a), (-t, a), (-t, t),
               (-a, t), (-a, -t), (-t, -t)]
    cos, sin = math.cos(angle), math.sin(angle)
    return [(cx + x * cos - y * sin, cy + x * sin + y * cos) for x, y in outline]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, radius: float,
                fill: tuple[int, int, int], rng: random.Random) -> None:
    # Small rotations only: a square turned by 45 degrees would be a diamond.
    tilt = math.radians(rng.uniform(-12, 12))
    if shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=fill)
    elif shape == "square":
        draw.polygon(_regular_polygon(cx, cy, radius * 1.3, 4, math.pi / 4 + tilt), fill=fill)
    elif shape == "diamond":  # a rhombus, taller than wide
        h, w = radius, radius * 0.7
        draw.polygon([(cx, cy - h), (cx + w, cy), (cx, cy + h), (cx - w, cy)], fill=fill)
    elif shape == "triangle":
        draw.polygon(_regular_polygon(cx, cy + radius * 0.15, radius * 1.1, 3, tilt), fill=fill)
    elif shape == "star":
        draw.polygon(_regular_polygon(cx, cy, radius * 1.1, 5, tilt, inner=0.45), fill=fill)
    elif shape == "cross":
        draw.polygon(_cross(cx, cy, radius, tilt), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")


def _single_centre(position: str, radius: float, side: int,
                   rng: random.Random) -> tuple[float, float]:
    """Centre of a lone object: the named region, with some jitter so no two images are alike."""
    margin = radius + side * 0.04
    near, far, mid = margin, side - margin, side / 2
    wobble = side * 0.06
    x, y = {"centre": (mid, mid), "left": (near, mid), "right": (far, mid),
            "top": (mid, near), "bottom": (mid, far)}[position]
    # Jitter along the free axis more than along the named one, and never across the midline.
    jx = rng.uniform(-wobble, wobble) if position in ("centre", "top", "bottom") else 0.0
    jy = rng.uniform(-wobble, wobble) if position in ("centre", "left", "right") else 0.0
    return x + jx, y + jy


def _scattered_centres(count: int, radius: float, side: int,
                       rng: random.Random) -> list[tuple[float, float]]:
    """Non-overlapping centres by bounded rejection sampling; the diagonal is the fallback (apart
    for up to 3 objects of at most _MAX_SCATTERED_RADIUS)."""
    lo, hi = radius * 1.05, side - radius * 1.05
    for _attempt in range(200):
        centres: list[tuple[float, float]] = []
        for _ in range(count):
            x, y = rng.uniform(lo, hi), rng.uniform(lo, hi)
            if all(math.dist((x, y), c) > 2.2 * radius for c in centres):
                centres.append((x, y))
        if len(centres) == count:
            return centres
    step = (hi - lo) / (count - 1)
    return [(lo + k * step, lo + k * step) for k in range(count)]


def render(scene: Scene, image_size: int, rng: random.Random) -> Image.Image:
    """Draw a scene as an RGB image of `image_size` x `image_size` pixels."""
    side = image_size * _SUPERSAMPLE
    image = Image.new("RGB", (side, side), _jitter(BACKGROUNDS[scene.background], rng, 10))
    draw = ImageDraw.Draw(image)
    radius = side * rng.uniform(*_SIZE_RADIUS[scene.size])
    if scene.count == 1:
        centres = [_single_centre(scene.position, radius, side, rng)]
    else:  # capped so that three objects always find room apart
        radius = min(radius, side * _MAX_SCATTERED_RADIUS)
        centres = _scattered_centres(scene.count, radius, side, rng)
    fill = _jitter(COLOURS[scene.colour], rng, 15)
    for cx, cy in centres:
        _draw_shape(draw, scene.shape, cx, cy, radius, fill, rng)
    return image.resize((image_size, image_size), Image.Resampling.LANCZOS)


# ---------------------------------------------------------------------------------------------
# Captions


def _plural(shape: str) -> str:
    return shape + ("es" if shape.endswith("s") else "s")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _object_phrase(scene: Scene, rng: random.Random) -> str:
    """'a large red circle', 'two small blue stars', ... (size is mentioned about half the time)."""
    adjectives = f"{scene.size} {scene.colour}" if rng.random() < 0.5 else scene.colour
    if scene.count == 1:
        return f"{_article(adjectives)} {adjectives} {scene.shape}"
    return f"{_COUNT_WORDS[scene.count]} {adjectives} {_plural(scene.shape)}"


def _where_phrase(scene: Scene, rng: random.Random) -> str:
    options = {
        "centre": ["in the centre", "in the middle", "in the middle of the frame"],
        "left": ["on the left", "on the left side", "near the left edge"],
        "right": ["on the right", "on the right side", "near the right edge"],
        "top": ["at the top", "near the top", "in the upper part of the picture"],
        "bottom": ["at the bottom", "near the bottom", "in the lower part of the picture"],
        # no "scattered" or "across": they contain "red" and "cross"
        "scattered": ["dotted around", "spread over the image", "at different spots"],
    }[scene.position]
    return rng.choice(options)


def _background_phrase(scene: Scene, rng: random.Random) -> str:
    return rng.choice([f"on a {scene.background} background", f"against a plain {scene.background}"
                       " backdrop", f"on {scene.background}"])


_Template = Callable[[str, str, str], str]
# (object, where, background) -> sentence. Every template names the object (colour + shape).
TEMPLATES: tuple[_Template, ...] = (
    lambda o, w, b: f"{o} {w} {b}.",
    lambda o, w, b: f"There {'is' if o.startswith('a') else 'are'} {o} {w}.",
    lambda o, w, b: f"A picture of {o} {b}.",
    lambda o, w, b: f"A simple drawing showing {o} {w}.",
    lambda o, w, b: f"{o}, {w}, {b}",
    lambda o, w, b: f"An image with {o} {b}.",
    lambda o, w, b: f"You can see {o} {w} {b}.",
    lambda o, w, b: f"{o} drawn {w}.",
)


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def near_duplicate(caption: str, rng: random.Random) -> str:
    """A variant that differs only in case, spacing or punctuation (what dedupe must catch)."""
    kind = rng.choice(("lower", "upper", "spacing", "punctuation"))
    if kind == "lower":
        return caption.lower()
    if kind == "upper":
        return caption.upper()
    if kind == "spacing":
        words = caption.split(" ")
        k = rng.randrange(len(words))
        return " ".join(words[:k]) + "  " + " ".join(words[k:]) + " "
    stripped = caption.rstrip(".!")
    return stripped + "!" if stripped != caption else caption + "."


def write_captions(scene: Scene, rng: random.Random) -> tuple[str, ...]:
    """Five captions from distinct templates; sometimes an exact and/or a near duplicate."""
    templates = rng.sample(TEMPLATES, CAPTIONS_PER_IMAGE)
    captions = [_capitalise(t(_object_phrase(scene, rng), _where_phrase(scene, rng),
                              _background_phrase(scene, rng))) for t in templates]
    if rng.random() < NEAR_DUPLICATE_RATE:
        captions[3] = near_duplicate(captions[rng.randrange(3)], rng)
    if rng.random() < EXACT_DUPLICATE_RATE:
        captions[4] = captions[0]
    return tuple(captions)


# ---------------------------------------------------------------------------------------------
# MSCOCO-length captions

# Lead-ins by object count (1: singular verb), and clauses that pad a caption to its length. None
# names a colour, shape, background or count, even inside a word ("centred" holds "red").
_LEADS = {1: ("There is", "A picture of", "A simple drawing showing", "An image with",
              "You can see"),
          2: ("There are", "A picture of", "A simple drawing showing", "An image with",
              "You can see")}
_PADDING = (
    "here", "clearly", "again", "alone", "neatly",
    "in focus", "at rest", "drawn flat", "with care", "shown plainly",
    "with smooth edges", "seen from above", "and nothing else", "in flat colour",
    "with nothing else around", "under even flat light", "as a clean graphic",
    "in a simple picture", "with a lot of empty space", "and no other objects at all",
    "with plenty of room around it", "in the manner of a clip art icon",
)


def caption_rng(seed: int, index: int) -> random.Random:
    """The random stream of image `index`'s MSCOCO-style captions (apart from its pixels')."""
    return random.Random(f"clipms-synthetic-captions:{seed}:{index}")


def mscoco_caption(scene: Scene, words: int, rng: random.Random) -> str:
    """A caption of exactly `words` words (at least 5) naming the scene's colour and shape: the
    object, then a lead-in, its place and its background when they fit, then padding clauses."""
    if words < 5:
        raise ValueError(f"a caption needs at least 5 words, not {words}")
    head = _object_phrase(scene, rng)
    left = words - len(head.split())
    lead = rng.choice(_LEADS[min(scene.count, 2)])
    parts = [lead] if len(lead.split()) <= left - 2 else []  # keep room for a place
    left -= sum(len(p.split()) for p in parts)
    parts.append(head)
    optional = [_where_phrase(scene, rng), _background_phrase(scene, rng)]
    rng.shuffle(optional)
    for phrase in optional:
        if len(phrase.split()) <= left:
            parts.append(phrase)
            left -= len(phrase.split())
    while left > 0:
        clause = rng.choice([c for c in _PADDING if len(c.split()) <= left])
        parts.append(clause)
        left -= len(clause.split())
    return _capitalise(" ".join(parts)) + "."


def mscoco_captions(scene: Scene, rng: random.Random) -> tuple[str, ...]:
    """5 captions (now and then 6 or 7) of MSCOCO's lengths, with the default style's duplicate
    rates: a near duplicate of one of the first three, an exact repeat of the first."""
    count = rng.choices(list(MSCOCO_CAPTIONS_PER_IMAGE),
                        weights=list(MSCOCO_CAPTIONS_PER_IMAGE.values()))[0]
    lengths = rng.choices(list(MSCOCO_CAPTION_WORDS), weights=list(MSCOCO_CAPTION_WORDS.values()),
                          k=count)
    captions = [mscoco_caption(scene, words, rng) for words in lengths]
    if rng.random() < NEAR_DUPLICATE_RATE:
        captions[3] = near_duplicate(captions[rng.randrange(3)], rng)
    if rng.random() < EXACT_DUPLICATE_RATE:
        captions[4] = captions[0]
    return tuple(captions)


# ---------------------------------------------------------------------------------------------
# The dataset


def make_image(seed: int, index: int, image_size: int,
               caption_style: str = "templates") -> tuple[SyntheticImage, Image.Image]:
    """Image `index` of the dataset of `seed`: its record and its pixels."""
    if caption_style not in CAPTION_STYLES:
        raise ValueError(f"caption style {caption_style!r} is not one of {CAPTION_STYLES}")
    rng = image_rng(seed, index)
    scene = sample_scene(rng)
    captions = write_captions(scene, rng)  # drawn in every style: the pixels' stream goes on
    if caption_style == "mscoco":
        captions = mscoco_captions(scene, caption_rng(seed, index))
    pixels = render(scene, image_size, rng)
    return SyntheticImage(f"{index:06d}.png", scene, captions), pixels


def generate(out_dir: Path | str, num_images: int, image_size: int, seed: int,
             caption_style: str = "templates") -> list[SyntheticImage]:
    """Write images 1..num_images as PNGs into `out_dir` (which must exist); return their records.

    PNG is lossless, so the pixels are exactly what was drawn; img2dataset re-encodes them anyway.
    """
    out_dir = Path(out_dir)
    records = []
    for index in range(1, num_images + 1):
        record, pixels = make_image(seed, index, image_size, caption_style)
        # optimize=False and no metadata chunks: the bytes depend on the pixels only.
        pixels.save(out_dir / record.file_name, format="PNG", optimize=False)
        records.append(record)
    return records
