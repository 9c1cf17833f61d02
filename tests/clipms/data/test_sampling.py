"""Hard-negative batches (clipms.data.sampling, train.group_by): the grouped global batches really
share the label, as many as asked, the order is a function of (seed, epoch) only (so a resumed
run sees the same batches), the ranks' shares are disjoint, and a missing label is a clear error.
The order is computed without decoding; one test reads real shards through the loader."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from clipms.data.dataset import DataError, TrainSamples, index_shards
from clipms.data.loading import LoaderSettings
from clipms.data.sampling import (
    BatchOrder,
    SamplingError,
    epoch_order,
    group_ids,
    grouped_batches,
)
from clipms.text.clip_tokenizer import Tokenizer
from harness.numbered_shards import PRE, ids_of, run_loader, write_shards

COLOURS = ["red", "green", "blue", "cyan"]


@dataclass
class Layout:
    """A split of `n` samples in shards of `per_shard` (what BatchOrder reads of a ShardIndex)."""

    n: int
    per_shard: int
    shards: list[str] = field(default_factory=list)
    shard_starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shard_starts = list(range(0, self.n, self.per_shard))
        self.shards = [f"s{i}" for i in range(len(self.shard_starts))]

    def __len__(self) -> int:
        return self.n


def colour_groups(n: int) -> np.ndarray:
    labels = [{"colour": COLOURS[i % 4], "shape": "circle"} for i in range(n)]
    return group_ids(labels, [f"{i:09d}" for i in range(n)], ["colour"])


def one_group(batch: np.ndarray, groups: np.ndarray) -> bool:
    return len(set(groups[batch].tolist())) == 1


@pytest.mark.parametrize(("fraction", "asked"), [(0.25, 13), (0.5, 25), (0.9, 45)])
def test_grouped_batches_share_the_label_as_many_as_asked(fraction, asked):
    groups = colour_groups(800)  # 200 a colour: 12 one-colour batches of 16 each, 48 in all
    order = BatchOrder(Layout(800, 100), 16, LoaderSettings(seed=3, group_fraction=fraction),
                       groups)
    assert order.steps_per_epoch == 50
    for epoch in (0, 1):
        batches = [order.sample_ids(epoch * 50 + s) for s in range(50)]
        slots = order.grouped_steps(epoch)
        assert len(slots) == grouped_batches(50, fraction) == asked  # 12.5 -> 13: half up
        assert all(one_group(batches[s], groups) for s in slots)
        # the mixed rest is a fresh draw: one colour only by chance (p ~ 0.6**16 at 0.9)
        assert sum(one_group(b, groups) for b in batches) == asked
        seen = np.concatenate(batches)
        assert len(set(seen.tolist())) == 800  # every sample once: nothing repeated or lost
    assert [order.sample_ids(s).tolist() for s in range(50)] != [
        order.sample_ids(50 + s).tolist() for s in range(50)]  # reshuffled every epoch


def test_without_grouping_the_order_is_the_epoch_order():
    layout, groups = Layout(100, 30), colour_groups(100)
    for grouped, fraction in ((None, 0.0), (groups, 0.0), (None, 0.5)):
        order = BatchOrder(layout, 8, LoaderSettings(seed=5, group_fraction=fraction), grouped)
        expected = epoch_order(layout, 5, 1)
        assert np.array_equal(np.concatenate([order.sample_ids(12 + s) for s in range(12)]),
                              expected[:96])


def test_order_is_deterministic_and_a_fresh_process_resumes_it():
    layout, groups = Layout(300, 64), colour_groups(300)
    loader = LoaderSettings(seed=7, group_fraction=0.5)
    run = BatchOrder(layout, 10, loader, groups)
    uninterrupted = [run.sample_ids(s).tolist() for s in range(90)]
    resumed = BatchOrder(layout, 10, loader, groups)
    assert [resumed.sample_ids(s).tolist() for s in range(47, 90)] == uninterrupted[47:]
    other = BatchOrder(layout, 10, LoaderSettings(seed=8, group_fraction=0.5), groups)
    assert [other.sample_ids(s).tolist() for s in range(30)] != uninterrupted[:30]


def test_ranks_take_disjoint_shares_of_the_same_grouped_global_batches():
    layout, groups = Layout(480, 100), colour_groups(480)
    single = BatchOrder(layout, 12, LoaderSettings(seed=2, group_fraction=0.5), groups)
    ranks = [BatchOrder(layout, 4, LoaderSettings(seed=2, rank=r, world_size=3,
                                                  group_fraction=0.5), groups) for r in range(3)]
    assert single.steps_per_epoch == ranks[0].steps_per_epoch == 40
    for step in range(80):
        shares = [set(r.sample_ids(step).tolist()) for r in ranks]
        assert all(len(s) == 4 for s in shares)
        assert not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])
        assert np.array_equal(np.concatenate([r.sample_ids(step) for r in ranks]),
                              single.sample_ids(step))
    grouped = single.grouped_steps(0) + [40 + s for s in single.grouped_steps(1)]
    assert len(grouped) == 40 and all(one_group(single.sample_ids(s), groups) for s in grouped)
    assert all(len({groups[r.sample_ids(s)][0] for r in ranks}) == 1 for s in grouped)


def test_a_fraction_the_groups_cannot_fill_is_refused_with_the_maximum():
    groups = colour_groups(800)  # 12 full batches of 16 per colour -> at most 48 of 50
    with pytest.raises(SamplingError, match=r"50 of the epoch's 50 .* fill only 48 .* 0\.960"):
        BatchOrder(Layout(800, 100), 16, LoaderSettings(group_fraction=1.0), groups)
    with pytest.raises(SamplingError, match="expected 0 to 1"):
        BatchOrder(Layout(800, 100), 16, LoaderSettings(group_fraction=1.5), groups)


def test_a_missing_label_names_the_field_and_the_fields_there_are():
    keys = ["000000001", "000000002"]
    labels = [{"colour": "red", "shape": "circle"}, {"colour": "blue", "size": "small"}]
    with pytest.raises(SamplingError, match=r"\['shape'\]: sample '000000002' has no label "
                       r"'shape'; the split's samples have label fields \['colour', 'shape', "
                       r"'size'\]"):
        group_ids(labels, keys, ["shape"])
    with pytest.raises(SamplingError, match="no labels \\(real data such as mscoco has none\\)"):
        group_ids([None, None], keys, ["colour"])
    pairs = group_ids(labels, keys, ["colour"])
    assert pairs.tolist() == [1, 0]  # values sorted: blue, red


# ---- the loader on real shards (labels read from each sample's json) -------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    # tests.clipms.data.test_dataset's samples: labels {"shape": circle (even) | square (odd)}
    return write_shards(tmp_path_factory.mktemp("shards"), {"train": [20, 20]})


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.openai(context_length=16)


def test_the_loader_groups_by_the_shards_labels_and_resumes(shards: Path, tok: Tokenizer) -> None:
    kw = {"epochs": 2, "seed": 1, "workers": 1, "group_by": ["shape"], "group_fraction": 1.0}
    batches = ids_of(run_loader(shards, tok, 4, **kw), tok)  # decoded images and captions
    assert len(batches) == 20
    assert all(len({sample % 2 for sample, _ in batch}) == 1 for batch in batches)
    assert ids_of(run_loader(shards, tok, 4, start_step=13, **kw), tok) == batches[13:]


def test_the_loader_names_a_field_the_shards_lack(shards: Path, tok: Tokenizer) -> None:
    with pytest.raises(DataError, match=r"no label 'colour'; the split's samples have label "
                       r"fields \['shape'\]"):
        TrainSamples(index_shards(shards, "train"), tok, PRE, 4,
                     LoaderSettings(group_by=("colour",)), epochs=1)


# ---- the param ------------------------------------------------------------------------------


def test_the_train_param_takes_one_field_or_a_list_and_checks_the_fraction():
    from pydantic import ValidationError

    from clipms.train.recipe import TrainSettings

    assert TrainSettings(group_by="colour").group_by == ("colour",)
    assert TrainSettings(group_by=["colour", "background"]).group_by == ("colour", "background")
    assert TrainSettings(group_by=[]).group_by is None and TrainSettings().group_by is None
    with pytest.raises(ValidationError, match="group_fraction"):
        TrainSettings(group_fraction=1.5)


def test_the_stage_refuses_a_field_the_shards_lack_before_anything_compiles(
        shards: Path, tok: Tokenizer, tmp_path: Path, monkeypatch) -> None:
    from clipms.runtime import RuntimeConfig
    from pipeline.params import validate_section
    from stages.train import TrainParams, build_job

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shards").symlink_to(shards)
    (tmp_path / "models").mkdir()
    tok.save(tmp_path / "models" / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    params = validate_section("train", TrainParams, {"batch_size": 4, "group_by": "colour"})
    with pytest.raises(DataError, match=r"\['colour'\]: sample '\d+' has no label 'colour'; "
                       r"the split's samples have label fields \['shape'\]"):
        build_job(params, RuntimeConfig())
    params = validate_section("train", TrainParams, {"batch_size": 8, "group_by": "shape",
                                                     "group_fraction": 1.0})
    with pytest.raises(DataError, match=r"5 of the epoch's 5 global batches of 8 would be "
                       r"grouped, but the 2 groups fill only 4 \(a fraction of at most 0\.800\)"):
        build_job(params, RuntimeConfig())
