"""LoaderSettings: one object from the run's settings to the loader's sampling and decoding. A
setting the recipe leaves out, or a layer that drops or rebuilds it, fails here."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from clipms.data.dataset import DataError, build_train_dataset
from clipms.data.loading import DEFAULT_LOADER, LoaderSettings
from clipms.model.architecture import get_preset
from clipms.text.clip_tokenizer import Tokenizer
from clipms.train.recipe import TrainConfig, TrainSettings
from harness.numbered_shards import PRE, write_shards

# Given to each rank by the process that runs it, not read from the train section.
PER_RANK = {"rank", "world_size", "workers"}
# The loader's own knob, not a train param (benchmarks and tests set it).
LOADER_ONLY = {"shuffle_window_shards"}


def unusual() -> LoaderSettings:
    """Every field off its default, so a field replaced by its default shows."""
    return LoaderSettings(seed=7, rank=1, world_size=2, workers=1, augment=True, decode="pil",
                          shuffle_window_shards=1, group_by=("shape",), group_fraction=0.6)


def test_every_field_is_off_its_default_in_the_probe():
    probe = unusual()
    same = [f.name for f in fields(LoaderSettings)
            if getattr(probe, f.name) == getattr(DEFAULT_LOADER, f.name) and f.name != "decode"]
    assert not same  # decode: "pil" is the only one that augments


def test_a_bad_combination_is_refused_when_the_settings_are_made():
    with pytest.raises(DataError, match="rank 2 out of range for world size 2"):
        LoaderSettings(rank=2, world_size=2)
    with pytest.raises(DataError, match="rank 0 out of range for world size 0"):
        LoaderSettings(world_size=0)
    with pytest.raises(DataError, match="must be >= 0"):
        LoaderSettings(workers=-1)
    with pytest.raises(DataError, match="expected one of"):
        LoaderSettings(decode="gpu")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="does not augment"):
        LoaderSettings(decode="cpu", augment=True)
    assert LoaderSettings(group_by=["colour"]).group_by == ("colour",)  # type: ignore[arg-type]


def test_the_recipe_fills_every_field_it_owns():
    cfg = TrainConfig(model=get_preset("tiny"), seed=7, augment=True, decode="pil",
                      group_by=("shape",), group_fraction=1.0, workers=5)
    loader = cfg.loader(rank=1, world_size=2, workers=2)
    assert loader == LoaderSettings(seed=7, rank=1, world_size=2, workers=2, augment=True,
                                    group_by=("shape",), group_fraction=1.0)
    owned = {f.name for f in fields(LoaderSettings)} - PER_RANK - LOADER_ONLY
    assert owned <= set(TrainSettings.model_fields)  # a loader field the recipe has no key for
    for name in owned:  # ... or one it forgets to pass: the default would come through
        assert getattr(loader, name) == getattr(cfg, name), name


def test_the_settings_reach_the_sampling_and_the_decode_workers(tmp_path: Path):
    shards = write_shards(tmp_path, {"train": [20, 20]})  # labels: shape circle | square
    loader = unusual()
    dataset = build_train_dataset(shards, Tokenizer.openai(context_length=16), PRE, 4, loader,
                                  epochs=1)
    generator = dataset.children[0]
    # one worker: decoded in this process (the default's two would fork)
    assert generator.num_parallel_workers == 1 and not generator.python_multiprocessing
    samples = generator.source
    assert samples.loader is loader and samples.order.index is samples.index
    order = samples.order
    assert (order.seed, order.rank, order.world_size, order.window) == (7, 1, 2, 1)
    assert order.steps_per_epoch == 5 and len(order.grouped_steps(0)) == 3  # 0.6 of 5
    whole = LoaderSettings(seed=7, world_size=1, shuffle_window_shards=1, group_by=("shape",),
                           group_fraction=0.6)
    single = build_train_dataset(shards, Tokenizer.openai(context_length=16), PRE, 8, whole,
                                 epochs=1).children[0].source
    for step in range(5):  # rank 1 of 2 holds the second half of the global batch
        assert samples.sample_ids(step).tolist() == single.sample_ids(step)[4:].tolist()
