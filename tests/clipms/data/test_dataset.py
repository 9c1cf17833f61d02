"""Loader: tiny shards in the contract format (harness.numbered_shards), read through real
MindSpore."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clipms.data.dataset import (
    DataError,
    TrainSamples,
    build_train_dataset,
    eval_sample_count,
    index_shards,
    iter_captions,
    iter_eval_batches,
    normalize_pixels,
    steps_per_epoch,
    webds,
)
from clipms.data.loading import LoaderSettings
from clipms.data.preprocess import PreprocessConfig, preprocess_image
from clipms.text.clip_tokenizer import Tokenizer
from harness.numbered_shards import (
    CAPTIONS,
    PRE,
    decode_colour,
    ids_of,
    jpeg,
    run_loader,
    sample_files,
    write_shards,
)

CTX = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"), {"train": [13, 12], "val": [5, 2]})


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.openai(context_length=CTX)


def test_counts_shapes_and_drop_remainder(shards: Path, tok: Tokenizer) -> None:
    assert steps_per_epoch(shards, 4) == 6 and steps_per_epoch(shards, 4, world_size=2) == 3
    ds = build_train_dataset(shards, tok, PRE, 4, LoaderSettings(workers=1), epochs=2)
    assert ds.get_dataset_size() == 12
    batches = run_loader(shards, tok, 4, epochs=2, workers=1)
    assert len(batches) == 12  # 25 samples, batch 4: 6 full batches an epoch, 1 sample dropped
    for images, texts in batches:
        assert images.shape == (4, 3, 16, 16) and images.dtype == np.uint8  # normalised later
        assert texts.shape == (4, CTX) and texts.dtype == np.int32
    epochs = ids_of(batches, tok)
    first_sample = epochs[0][0][0]  # the pixels are exactly the shared preprocessing's
    assert np.array_equal(normalize_pixels(batches[0][0][0], PRE),
                          preprocess_image(jpeg(first_sample), PRE))
    for epoch in (epochs[:6], epochs[6:]):
        samples = [s for batch in epoch for s, _ in batch]
        assert len(set(samples)) == 24 and set(samples) <= set(range(25))  # no duplicates
    first = [s for b in epochs[:6] for s, _ in b]
    second = [s for b in epochs[6:] for s, _ in b]
    assert first != second  # reshuffled every epoch


def test_seeded_determinism_and_parallel_workers(shards: Path, tok: Tokenizer) -> None:
    one = run_loader(shards, tok, 5, epochs=1, seed=3, workers=1)
    again = run_loader(shards, tok, 5, epochs=1, seed=3, workers=2)  # worker processes
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(one, again, strict=True))
    other = run_loader(shards, tok, 5, epochs=1, seed=4, workers=1)
    assert ids_of(one, tok) != ids_of(other, tok)


def test_ranks_disjoint_covering_and_equal_to_the_global_batch(shards: Path,
                                                               tok: Tokenizer) -> None:
    single = ids_of(run_loader(shards, tok, 8, epochs=1, seed=1, workers=1), tok)
    ranks = [ids_of(run_loader(shards, tok, 4, epochs=1, seed=1, rank=r, world_size=2,
                               workers=1), tok) for r in (0, 1)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 3
    flat = [{s for b in r for s, _ in b} for r in ranks]
    assert not flat[0] & flat[1] and len(flat[0] | flat[1]) == 24
    for step, batch in enumerate(single):  # rank blocks concatenated = the single-process batch
        assert ranks[0][step] + ranks[1][step] == batch


def test_a_new_caption_each_epoch_and_resume(shards: Path, tok: Tokenizer) -> None:
    batches = ids_of(run_loader(shards, tok, 4, epochs=3, seed=0, workers=1), tok)
    drawn: dict[int, set[int]] = {}
    for batch in batches:
        for sample, caption in batch:
            assert 0 <= caption < CAPTIONS
            drawn.setdefault(sample, set()).add(caption)
    assert any(len(c) > 1 for c in drawn.values())  # some image got another caption later
    resumed = ids_of(run_loader(shards, tok, 4, epochs=3, seed=0, start_step=7, workers=1), tok)
    assert resumed == batches[7:]


def test_augmentation_keeps_pairs_and_shapes(shards: Path, tok: Tokenizer) -> None:
    batches = run_loader(shards, tok, 4, epochs=1, workers=1, augment=True)
    assert len(ids_of(batches, tok)) == 6  # flat colours: the crop keeps the sample identifiable


def test_sample_ids_without_decoding(shards: Path, tok: Tokenizer) -> None:
    source = TrainSamples(index_shards(shards, "train"), tok, PRE, 4,
                          LoaderSettings(rank=1, world_size=2), epochs=1)
    assert len(source) == 12 and len(source.sample_ids(0)) == 4
    with pytest.raises(DataError, match="epochs must be >= 1, got 4, 0"):
        TrainSamples(index_shards(shards, "train"), tok, PRE, 4, epochs=0)
    with pytest.raises(DataError, match="cannot fill one global batch"):
        TrainSamples(index_shards(shards, "train"), tok, PRE, 26, epochs=1)


def test_eval_reader_every_sample_once_in_order_with_all_captions(shards: Path) -> None:
    assert eval_sample_count(shards) == 7
    batches = list(iter_eval_batches(shards, PRE, batch_size=3))
    assert [len(b.keys) for b in batches] == [3, 3, 1]
    keys = [k for b in batches for k in b.keys]
    assert keys == [f"{n:09d}" for n in range(25, 32)]  # manifest order, then shard order
    first = batches[0]
    assert first.captions[0] == [f"sample 25 caption {c}" for c in range(CAPTIONS)]
    assert first.labels[0] == {"shape": "square"} and first.labels[1] == {"shape": "circle"}
    assert np.array_equal(first.images[1], preprocess_image(jpeg(26), PRE))
    assert [decode_colour(im) for b in batches for im in b.images] == list(range(25, 32))


def test_iter_captions_reads_every_train_caption(shards: Path) -> None:
    captions = list(iter_captions(shards, "train"))
    assert captions == [f"sample {n} caption {c}" for n in range(25) for c in range(CAPTIONS)]


def test_bad_shards_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="manifest not found"):
        steps_per_epoch(tmp_path, 4)
    root = write_shards(tmp_path / "s", {"train": [4], "val": [2]})
    with pytest.raises(DataError, match="no split 'test'"):
        index_shards(root, "test")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["samples"] = 5
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="4 samples, but the manifest says 5"):
        index_shards(root, "train")
    shard = root / "val/000000.tar"
    shard.write_bytes(shard.read_bytes()[:700])
    with pytest.raises(DataError, match="000000.tar: (unreadable or truncated|.*short read)"):
        list(iter_eval_batches(root, PRE, batch_size=2))


@pytest.mark.slow
def test_loader_benchmark_command_runs_on_generated_shards(capsys) -> None:
    from benchmarks.throughput import main

    assert main(["loader", "--samples", "40", "--source-size", "48", "--image-size", "32",
                 "--batch-size", "8", "--warmup", "1", "--batches", "4", "--workers", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "loader" and result["batches"] == 4 and result["samples_per_s"] > 0
    assert result["cpu_ms_per_sample"] > 0 and result["image_size"] == 32


def test_eval_reader_counts_bombs_and_broken_images_as_bad_samples(tmp_path: Path) -> None:
    """Evaluate and zero-shot on labels read the val split through this reader; an
    image the decoder refuses is left out and named, never a crash."""
    from harness.hostile_images import png_bomb

    broken = jpeg(3)
    broken = broken[:len(broken) * 2 // 3]  # cut inside the image data, not the header
    files = [sample_files(n, "val") for n in range(6)]
    files[1] = (files[1][0], {**{k: v for k, v in files[1][1].items() if k != "jpg"},
                              "png": png_bomb()})  # 64 MP: over the pixel limit
    files[3] = (files[3][0], {**files[3][1], "jpg": broken})
    root = tmp_path / "s"
    webds.write_manifest(root, 6, {"val": webds.write_split(root, "val", files, 6)})
    skipped: list[str] = []
    batches = list(iter_eval_batches(root, PRE, batch_size=2, skipped=skipped))
    assert skipped == ["000000001", "000000003"]
    assert [b.keys for b in batches] == [["000000000"], ["000000002"], ["000000004", "000000005"]]
    assert [decode_colour(im) for b in batches for im in b.images] == [0, 2, 4, 5]
    assert batches[2].captions[1] == [f"sample 5 caption {c}" for c in range(CAPTIONS)]
