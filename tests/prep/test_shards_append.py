"""Append-only shards: a night with new images adds shards and leaves the earlier ones byte for
byte; removed, moved or changed samples are excluded in the manifest (their tar kept), changed
ones written again; a shard mostly excluded, or other shard params, rewrite; the loader, search's
reader and the training order see exactly today's samples, in a seeded, resumable order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clipms.data import webds
from clipms.data.dataset import TrainSamples, index_shards, steps_per_epoch
from clipms.data.loading import LoaderSettings
from clipms.text.clip_tokenizer import Tokenizer
from harness.input_tars import good, meta, quiet, write_tar
from harness.numbered_shards import PRE
from prep.shards import ShardSettings, build_shards

SETTINGS = ShardSettings(samples_per_shard=4, workers=1)


def split_of(i: int) -> str:
    return "val" if i % 4 == 0 else "train"


def key(i: int) -> str:
    return f"{i:016x}"


def tars(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.glob("*/*.tar"))}


def keys_in(folder: Path, name: str) -> list[str]:
    return [s.key for s in webds.read_tar(folder / name)]


def live(folder: Path, split: str) -> dict[str, dict]:
    return {s.key: s.meta for s in webds.iter_split(folder, split)}


def night_one(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    src, out = tmp_path / "download", tmp_path / "shards"
    src.mkdir()
    write_tar(src / "00000.tar", [good(i, split_of(i)) for i in range(24)])
    build_shards(src, out, SETTINGS, quiet)
    return src, out, tars(out)


def test_new_images_add_shards_and_leave_the_earlier_ones_byte_for_byte(tmp_path):
    src, out, before = night_one(tmp_path)
    assert sorted(before) == [*(f"train/00000{i}.tar" for i in range(5)),
                              "val/000000.tar", "val/000001.tar"]
    write_tar(src / "00001.tar", [good(i, split_of(i)) for i in range(24, 30)])  # 6 new images
    metrics = build_shards(src, out, SETTINGS, quiet)

    after = tars(out)
    assert {name: after[name] for name in before} == before  # every earlier tar, byte for byte
    added = sorted(set(after) - set(before))
    assert added == ["train/000005.tar", "val/000002.tar"]
    assert sorted(k for name in added for k in keys_in(out, name)) == sorted(
        key(i) for i in range(24, 30))  # the new shards hold the new images alone
    assert metrics["rewrite"] is None
    assert (metrics["train"]["shards_kept"], metrics["train"]["shards_new"],
            metrics["train"]["samples_new"]) == (5, 1, 4)
    assert set(live(out, "train")) == {key(i) for i in range(30) if split_of(i) == "train"}
    manifest = webds.read_manifest(out)
    assert manifest["plan"] == {"version": 1, "seed": 0, "samples_per_shard": 4}
    assert manifest["splits"]["train"]["samples"] == 22
    build_shards(src, out, SETTINGS, quiet)  # a night with nothing new changes nothing
    assert tars(out) == after and webds.read_manifest(out) == manifest


def test_removed_moved_and_recaptioned_images_are_excluded_not_rewritten(tmp_path):
    src, out, before = night_one(tmp_path)
    recaptioned = {**meta(2), "captions": ["a new caption for two"]}
    samples = [good(i, split_of(i)) for i in range(24) if i != 1]  # 1 removed
    samples[1] = {**samples[1], "json": json.dumps(recaptioned)}  # 2 recaptioned
    samples[2] = good(3, "val")  # 3 moved to val
    (src / "00000.tar").unlink()
    write_tar(src / "00001.tar", samples)
    lines: list[str] = []
    metrics = build_shards(src, out, SETTINGS, lines.append)

    after = tars(out)
    assert {name: after[name] for name in before} == before  # no earlier tar rewritten
    manifest = webds.read_manifest(out)
    excluded = {k for split in ("train", "val")
                for shard in manifest["splits"][split]["shards"] for k in shard["excluded"]}
    assert excluded == {key(1), key(2), key(3)}
    train, val = live(out, "train"), live(out, "val")
    assert set(train) == {key(i) for i in range(24) if split_of(i) == "train"} - {key(1), key(3)}
    assert set(val) == {key(i) for i in range(24) if split_of(i) == "val"} | {key(3)}
    assert train[key(2)]["captions"] == ["a new caption for two"]  # written again, new shard
    assert manifest["splits"]["train"]["samples"] == len(train) == 16
    assert steps_per_epoch(out, 5) == 3
    # the loader's index and evaluation read the same samples, never an excluded one
    assert sorted(index_shards(out, "train").keys) == sorted(train)
    assert sorted(index_shards(out, "val").keys) == sorted(val)
    assert metrics["train"]["excluded"] == 3 and metrics["val"]["excluded"] == 0
    assert lines[-1].endswith("train: 5 shard(s) kept as they were, 1 new, 3 sample(s) "
                              "excluded; val: 2 shard(s) kept as they were, 1 new, 0 sample(s) "
                              "excluded.")


def test_a_shard_mostly_excluded_is_compacted_and_a_lost_tar_rebuilt(tmp_path):
    src, out, before = night_one(tmp_path)
    first = keys_in(out, "train/000000.tar")
    gone = set(first[:3])  # three of the shard's four samples removed: it is dropped
    (src / "00000.tar").unlink()
    write_tar(src / "00001.tar", [good(i, split_of(i)) for i in range(24) if key(i) not in gone])
    (out / "train/000001.tar").write_bytes(b"damaged")  # and a kept tar lost its bytes
    metrics = build_shards(src, out, SETTINGS, quiet)

    after = tars(out)
    assert "train/000000.tar" not in after  # dropped, its file removed
    assert {n: after[n] for n in before if n != "train/000000.tar"} == {
        n: b for n, b in before.items() if n != "train/000000.tar"}  # rebuilt byte for byte
    assert metrics["train"]["shards_dropped"] == 1
    (moved,) = (k for name in after if name.endswith("000005.tar")
                for k in keys_in(out, name))
    assert moved == first[3]  # the dropped shard's live sample, in a new shard
    assert set(live(out, "train")) == {key(i) for i in range(24)
                                       if split_of(i) == "train"} - gone


@pytest.mark.parametrize("change", [{"samples_per_shard": 8}, {"seed": 1}])
def test_other_shard_params_write_every_shard_and_say_why(tmp_path, change):
    src, out, _before = night_one(tmp_path)
    (out / "train/000009.tar").write_bytes(b"an unlisted tar")
    lines: list[str] = []
    settings = ShardSettings(**{"samples_per_shard": 4, "workers": 1, **change})
    metrics = build_shards(src, out, settings, lines.append)
    (name, value), = change.items()
    assert metrics["rewrite"] == f"shard.{name} {4 if name == 'samples_per_shard' else 0} " \
                                 f"-> {value}"
    assert any(line.startswith("shard: writing every shard (shard.") for line in lines)
    assert "train/000009.tar" not in tars(out)
    manifest = webds.read_manifest(out)
    assert all(not s["excluded"] for e in manifest["splits"].values() for s in e["shards"])
    fresh = tmp_path / "fresh"  # the same bytes as a first run with these settings
    build_shards(src, fresh, settings, quiet)
    assert tars(out) == tars(fresh)


def test_training_order_on_grown_shards_is_seeded_and_resumes(tmp_path):
    src, out, _before = night_one(tmp_path)
    write_tar(src / "00001.tar", [good(i, split_of(i)) for i in range(24, 40) if i != 5])
    (src / "00000.tar").unlink()
    write_tar(src / "00000.tar", [good(i, split_of(i)) for i in range(24) if i != 5])
    build_shards(src, out, SETTINGS, quiet)
    tok = Tokenizer.openai(context_length=16)

    def keys_by_step(seed: int, steps: int = 12) -> list[list[str]]:
        samples = TrainSamples(index_shards(out, "train"), tok, PRE, 4, LoaderSettings(seed=seed),
                               epochs=2)
        return [[samples.index.keys[i] for i in samples.sample_ids(s)] for s in range(steps)]

    order = keys_by_step(0)
    assert order == keys_by_step(0)  # a fresh index, the same seed: the same batches
    assert order != keys_by_step(1)
    wanted = {key(i) for i in range(40) if split_of(i) == "train" and i != 5}
    epoch = [k for batch in order[:7] for k in batch]
    assert len(epoch) == len(set(epoch)) == 28 and set(epoch) <= wanted  # 29 live, B=4
    # resumed at step 5, the batches decode to what an uninterrupted run's step 5 held
    whole = TrainSamples(index_shards(out, "train"), tok, PRE, 4, epochs=2)
    resumed = TrainSamples(index_shards(out, "train"), tok, PRE, 4, epochs=2, start_step=5)
    for i in range(4):
        for a, b in zip(whole[5 * 4 + i], resumed[i], strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_dvc_repro_on_a_grown_source_keeps_the_earlier_shards_byte_for_byte(tmp_path):
    """Real DVC in a fresh git repo: the shard outputs are persisted, so `dvc repro` on a source
    grown by a sixth keeps every tar of the first run and caches only the new ones."""
    from harness.dvc_workspace import make_workspace, run
    from harness.project_copy import set_params

    ws = make_workspace(tmp_path / "ws", {"metadata.num_images": 48})
    run(["dvc", "repro", "shard"], ws)
    shards = ws / "data/shards"
    before = tars(shards)
    cached = {p for p in (ws / ".dvc/cache").rglob("*") if p.is_file()}

    set_params(ws / "params.yaml", {"metadata.num_images": 56})
    run(["dvc", "repro", "shard"], ws)
    after = tars(shards)
    metrics = json.loads((ws / "metrics/shard.json").read_text())
    new_cache = {p for p in (ws / ".dvc/cache").rglob("*") if p.is_file()} - cached

    assert {name: after[name] for name in before} == before
    added = set(after) - set(before)
    assert added and metrics["rewrite"] is None
    assert sum(metrics[s]["samples_new"] for s in ("train", "val")) == \
        metrics["samples_out"] - sum(len(keys_in(shards, n)) for n in before)
    cached_tars = {p.read_bytes() for p in new_cache if p.read_bytes() in set(after.values())}
    assert cached_tars == {after[name] for name in added}  # only the new tars entered the cache
    assert "up to date" in run(["dvc", "status", "shard"], ws).stdout


def test_a_val_image_removed_changes_the_evaluation_sets_digest(tmp_path):
    """The gate compares versions on one evaluation set, named by a digest of the val split:
    a sample excluded from a tar that stays as it was is another set."""
    from tracking.lineage import val_digest

    src, out, before = night_one(tmp_path)
    digest = val_digest(out / "manifest.json")
    (src / "00000.tar").unlink()
    write_tar(src / "00001.tar", [good(i, split_of(i)) for i in range(24) if i != 4])
    build_shards(src, out, SETTINGS, quiet)
    assert tars(out) == before and key(4) not in live(out, "val")
    assert val_digest(out / "manifest.json") != digest
