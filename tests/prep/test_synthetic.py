"""The synthetic MSCOCO look-alike: deterministic, learnable (captions state what is drawn), and
carrying the duplicate/near-duplicate captions that the dedupe stage must remove."""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prep import synthetic

N_IMAGES = 40


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    folder = tmp_path_factory.mktemp("synthetic")
    return folder, synthetic.generate(folder, N_IMAGES, 64, seed=0)


def test_same_seed_gives_identical_files_and_records(generated, tmp_path):
    folder, records = generated
    again = synthetic.generate(tmp_path, N_IMAGES, 64, seed=0)
    assert again == records
    assert _digests(tmp_path) == _digests(folder)
    assert len(_digests(folder)) == N_IMAGES


def test_other_seed_gives_other_data(generated, tmp_path):
    _, records = generated
    other = synthetic.generate(tmp_path, N_IMAGES, 64, seed=1)
    assert [r.captions for r in other] != [r.captions for r in records]


def test_image_depends_only_on_seed_and_index(generated, tmp_path):
    folder, records = generated
    fewer = synthetic.generate(tmp_path, 5, 64, seed=0)
    assert fewer == records[:5]
    assert _digests(tmp_path) == {k: v for k, v in _digests(folder).items() if k in
                                  {r.file_name for r in fewer}}


def test_images_are_rgb_pngs_of_the_requested_size(generated):
    folder, records = generated
    for record in records[:10]:
        with Image.open(folder / record.file_name) as image:
            assert (image.format, image.mode, image.size) == ("PNG", "RGB", (64, 64))


def test_every_caption_names_the_colour_and_the_shape(generated):
    _, records = generated
    for record in records:
        assert len(record.captions) == synthetic.CAPTIONS_PER_IMAGE
        for caption in record.captions:
            text = caption.lower()
            assert record.scene.colour in text and record.scene.shape in text, (caption, record)
            # no other colour or shape, even inside a word ("scattered" holds "red")
            assert not [c for c in synthetic.COLOURS if c != record.scene.colour and c in text]
            assert not [s for s in synthetic.SHAPES if s != record.scene.shape and s in text]


def test_count_and_background_words_match_the_labels(generated):
    _, records = generated
    words = {1: ("a ", "an "), 2: ("two ",), 3: ("three ",)}
    for record in records:
        scene = record.scene
        for caption in record.captions:
            assert any(w in caption.lower() for w in words[scene.count]), caption
        mentioned = {b for c in record.captions for b in synthetic.BACKGROUNDS if b in c.lower()}
        assert mentioned <= {scene.background}, record


def test_labels_json_holds_every_attribute(generated):
    _, records = generated
    assert records[0].labels_json.startswith('{"shape": ')
    for record in records:
        labels = record.scene.labels()
        assert labels["shape"] in synthetic.SHAPES and labels["colour"] in synthetic.COLOURS
        assert labels["background"] in synthetic.BACKGROUNDS and labels["size"] in synthetic.SIZES
        assert labels["count"] in (1, 2, 3)
        assert (labels["position"] == "scattered") == (labels["count"] > 1)
        assert labels["count"] == 1 or labels["size"] == "small"


def test_attributes_vary_across_the_dataset():
    scenes = [synthetic.sample_scene(synthetic.image_rng(0, i)) for i in range(600)]
    assert {s.shape for s in scenes} == set(synthetic.SHAPES)
    assert {s.colour for s in scenes} == set(synthetic.COLOURS)
    assert {s.background for s in scenes} == set(synthetic.BACKGROUNDS)
    assert {s.count for s in scenes} == {1, 2, 3}
    assert {s.position for s in scenes} == {*synthetic.POSITIONS, "scattered"}


def _key(caption: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", "", caption.lower())).strip()


def test_exact_and_near_duplicates_are_present_in_realistic_amounts():
    exact = near = 0
    n = 400
    for i in range(n):
        rng = synthetic.image_rng(0, i)
        captions = synthetic.write_captions(synthetic.sample_scene(rng), rng)
        exact += len(captions) - len(set(captions))
        near += len(set(captions)) - len({_key(c) for c in captions})
    # EXACT_DUPLICATE_RATE 0.15 and NEAR_DUPLICATE_RATE 0.25 of 400 images: ~60 and >= ~100
    assert 0.08 * n < exact < 0.25 * n
    assert 0.15 * n < near < 0.45 * n


@pytest.mark.parametrize("caption", ["A red circle on white.", "Two blue stars, at the top"])
def test_near_duplicate_differs_only_in_case_spacing_or_punctuation(caption):
    for i in range(20):
        variant = synthetic.near_duplicate(caption, synthetic.image_rng(0, i))
        assert variant != caption and _key(variant) == _key(caption)


def test_drawn_colour_is_the_labelled_colour(generated):
    """The most common non-background pixel colour is nearest to the labelled colour."""
    folder, records = generated
    palette = np.array(list(synthetic.COLOURS.values()), dtype=float)
    names = list(synthetic.COLOURS)
    for record in records:
        pixels = np.asarray(Image.open(folder / record.file_name), dtype=float).reshape(-1, 3)
        background = np.array(synthetic.BACKGROUNDS[record.scene.background], dtype=float)
        foreground = pixels[np.abs(pixels - background).sum(axis=1) > 90]
        assert len(foreground) > 20, record
        nearest = np.argmin(((foreground[:, None, :] - palette[None]) ** 2).sum(-1), axis=1)
        assert names[np.bincount(nearest).argmax()] == record.scene.colour, record


def test_scattered_objects_never_overlap_even_in_the_fallback_layout():
    class Stuck(random.Random):  # every draw lands on the same spot: rejection always fails
        def uniform(self, a: float, b: float) -> float:
            return a

    side = 256
    radius = side * synthetic._MAX_SCATTERED_RADIUS
    for rng in (synthetic.image_rng(0, 7), Stuck()):
        centres = synthetic._scattered_centres(3, radius, side, rng)
        assert len(centres) == 3
        assert all(math.dist(a, b) > 2 * radius for a, b in itertools.combinations(centres, 2))
        assert all(radius <= c <= side - radius for xy in centres for c in xy)


# --- the MSCOCO caption style (benchmarks/rehearsal.py's world) --------------------------------


@pytest.fixture(scope="module")
def mscoco_style(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    folder = tmp_path_factory.mktemp("synthetic-mscoco")
    return folder, synthetic.generate(folder, N_IMAGES, 64, seed=0, caption_style="mscoco")


def test_mscoco_style_draws_the_default_worlds_images_and_scenes(generated, mscoco_style):
    (default_dir, default), (mscoco_dir, mscoco) = generated, mscoco_style
    assert _digests(mscoco_dir) == _digests(default_dir)
    assert [r.scene for r in mscoco] == [r.scene for r in default]
    assert [r.captions for r in mscoco] != [r.captions for r in default]


def test_mscoco_style_captions_name_the_colour_and_shape_and_nothing_else(mscoco_style):
    _, records = mscoco_style
    for record in records:
        for caption in record.captions:
            text, scene = caption.lower(), record.scene
            assert scene.colour in text and scene.shape in text, (caption, record)
            assert not [c for c in synthetic.COLOURS if c != scene.colour and c in text], caption
            assert not [s for s in synthetic.SHAPES if s != scene.shape and s in text], caption
            assert {b for b in synthetic.BACKGROUNDS if b in text} <= {scene.background}, caption


def test_padding_clauses_name_no_attribute():
    words = [*synthetic.COLOURS, *synthetic.SHAPES, *synthetic.BACKGROUNDS, "two", "three"]
    assert not [(c, w) for c in synthetic._PADDING for w in words if w in c]


@pytest.mark.parametrize("words", [5, 6, 8, 10, 15, 23, 50])
def test_an_mscoco_caption_has_exactly_the_words_asked_for(words):
    for i in range(60):
        rng = synthetic.image_rng(0, i)
        caption = synthetic.mscoco_caption(synthetic.sample_scene(rng), words, rng)
        assert len(caption.split()) == words, caption


def test_mscoco_caption_lengths_and_counts_follow_the_tables():
    lengths, counts, n = [], [], 4000
    for i in range(n):
        scene = synthetic.sample_scene(synthetic.image_rng(1, i))
        captions = synthetic.mscoco_captions(scene, synthetic.caption_rng(1, i))
        counts.append(len(captions))
        lengths.extend(len(c.split()) for c in captions)
    lengths_ = np.asarray(lengths)
    weights = synthetic.MSCOCO_CAPTION_WORDS
    table_mean = sum(k * w for k, w in weights.items()) / sum(weights.values())
    assert abs(lengths_.mean() - table_mean) < 0.15 and 10.3 < table_mean < 10.7
    assert 0.92 < np.mean((lengths_ >= 8) & (lengths_ <= 15)) < 0.97
    assert lengths_.min() >= 5 and lengths_.max() <= 50
    assert min(counts) >= 5 and max(counts) <= 7 and 5.0 < np.mean(counts) < 5.02


def test_mscoco_style_keeps_the_default_duplicate_rates():
    exact = near = 0
    n = 400
    for i in range(n):
        scene = synthetic.sample_scene(synthetic.image_rng(0, i))
        captions = synthetic.mscoco_captions(scene, synthetic.caption_rng(0, i))
        exact += len(captions) - len(set(captions))
        near += len(set(captions)) - len({_key(c) for c in captions})
    assert 0.08 * n < exact < 0.25 * n
    assert 0.15 * n < near < 0.45 * n


def test_unknown_caption_style_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="caption style 'long' is not one of"):
        synthetic.generate(tmp_path, 1, 32, seed=0, caption_style="long")
