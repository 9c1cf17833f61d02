"""The retention policy's decisions, without a registry: which versions stay whole and why, which
DVC cache objects a lock names, and the params' errors. (The store side, against a real MLflow
server and real DVC: tests/integration/test_retention_store.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.params import ParamsError
from registry.retention import RetentionParams, VersionState, choose, objects, retention_params


def versions(*specs: tuple[int, tuple[str, ...], dict[str, str]]) -> list[VersionState]:
    return [VersionState(n, aliases, tags) for n, aliases, tags in specs]


def test_the_champion_and_challenger_stay_however_old() -> None:
    found = choose(versions((1, ("champion",), {}), (2, ("challenger",), {}), (3, (), {}),
                            (4, (), {}), (5, (), {}), (6, (), {})),
                   RetentionParams(keep_last=2))
    assert sorted(found.keep) == [1, 2, 5, 6] and sorted(found.remove) == [3, 4]
    assert found.keep[1] == "alias champion" and found.keep[2] == "alias challenger"
    assert found.keep[6] == "one of the newest 2"
    assert "older than the newest 2" in found.remove[3]


def test_a_failed_gate_leaves_newer_versions_without_alias_and_the_champion_still_stays() -> None:
    """A gate that failed closed registers the version but moves no alias: the champion is then
    older than every version of the window, and stays."""
    found = choose(versions((1, ("champion",), {}), (2, (), {}), (3, (), {}), (4, (), {})),
                   RetentionParams(keep_last=1))
    assert sorted(found.keep) == [1, 4] and sorted(found.remove) == [2, 3]


def test_a_version_tagged_to_keep_stays_unless_the_tag_says_false() -> None:
    found = choose(versions((1, (), {"pin": "true"}), (2, (), {"pin": ""}), (3, (), {"pin": "no"}),
                            (4, (), {"pin": "False"}), (5, (), {"keep": "true"}), (6, (), {})),
                   RetentionParams(keep_last=1, keep_tag="pin"))
    assert sorted(found.keep) == [1, 2, 6] and found.keep[1] == "tagged pin"
    assert sorted(found.remove) == [3, 4, 5]  # `keep` is not the tag in use here


def test_keep_last_zero_keeps_only_aliases_and_tags_and_reasons_add_up() -> None:
    found = choose(versions((1, ("champion", "challenger"), {"keep": "1"}), (2, (), {})),
                   RetentionParams(keep_last=0))
    assert found.keep == {1: "alias champion, alias challenger, tagged keep"}
    assert list(found.remove) == [2]


def test_no_versions_plan_nothing() -> None:
    found = choose([], RetentionParams())
    assert found.keep == {} and found.remove == {}


@pytest.mark.parametrize(("text", "named"), [
    ("keep_last: -1", "retention.keep_last = -1: Input should be greater than or equal to 0"),
    ("keep_last: three", "retention.keep_last = 'three'"),
    ("keep_tag: 'not a tag'", "retention.keep_tag = 'not a tag': String should match pattern"),
    ("enabled: maybe", "retention.enabled = 'maybe'"),
    ("keep: 3", "retention.keep: unknown key (allowed keys here: dry_run, enabled, keep_last, "
                "keep_tag, prune_remote)"),
    ("prune_remote: maybe", "retention.prune_remote = 'maybe': Input should be a valid boolean"),
    ("prune_remote: 1", "retention.prune_remote = 1: Input should be a valid boolean"),
    ("prune_remote: 'true'", "retention.prune_remote = 'true': Input should be a valid boolean"),
])
def test_bad_params_name_the_key_the_value_and_what_is_allowed(tmp_path: Path, text: str,
                                                               named: str) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(f"retention:\n  {text}\n")
    with pytest.raises(ParamsError) as err:
        retention_params(path)
    assert named in str(err.value)


def test_the_project_params_are_valid_and_keep_a_small_window() -> None:
    params = retention_params(Path(__file__).resolve().parents[2] / "params.yaml")
    assert params.enabled and not params.dry_run and 1 <= params.keep_last <= 5
    assert params.prune_remote is False  # opt-in: the remote keeps every version unless told


def test_prune_remote_is_off_unless_set_to_exactly_true(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text("retention:\n  keep_last: 2\n")
    assert retention_params(path).prune_remote is False
    path.write_text("retention:\n  prune_remote: true\n")
    assert retention_params(path).prune_remote is True


def lock(*outs: dict) -> str:
    return yaml.safe_dump({"schema": "2.0", "stages": {"s": {"cmd": "x", "outs": list(outs)}}})


def test_a_lock_names_its_files_and_each_folders_files() -> None:
    listings = {"d" * 32 + ".dir": [("a.tar", "a" * 32), ("b/c.tar", "c" * 32)]}
    text = lock({"path": "models/clip.ckpt", "md5": "1" * 32, "hash": "md5"},
                {"path": "data/shards", "md5": "d" * 32 + ".dir", "hash": "md5"},
                {"path": "metrics/x.json", "md5": "9" * 32, "hash": "md5", "cache": False})
    found, unreadable = objects(text, lambda md5, legacy: listings.get(md5))
    assert found == {("1" * 32, False): "models/clip.ckpt",
                     ("d" * 32 + ".dir", False): "data/shards",
                     ("a" * 32, False): "data/shards/a.tar",
                     ("c" * 32, False): "data/shards/b/c.tar"}
    assert unreadable == []


def test_a_folder_whose_listing_is_missing_is_named_and_dvc2_hashes_are_legacy() -> None:
    text = lock({"path": "data/download", "md5": "e" * 32 + ".dir"})  # no `hash: md5`: DVC 2
    found, unreadable = objects(text, lambda md5, legacy: None)
    assert found == {("e" * 32 + ".dir", True): "data/download"} and unreadable == ["data/download"]


def test_a_dvc_file_names_its_outs() -> None:
    text = yaml.safe_dump({"outs": [{"path": "val", "md5": "f" * 32, "hash": "md5"}]})
    found, _ = objects(text, lambda md5, legacy: None)
    assert found == {("f" * 32, False): "val"}


def test_the_dry_run_text_says_what_goes_and_why() -> None:
    from registry.retention import Action, Plan, render

    plan = Plan("clip", RetentionParams(keep_last=1).model_dump(), {2: "one of the newest 1"},
                {1: "older than the newest 1"},
                [Action("mlflow", "file:///a", "checkpoint/m-1", [1], 2_000_000, "older"),
                 Action("dvc-cache", "a" * 32, "models/clip.ckpt", [1], 500_000, "unused")])
    text = render(plan, dry_run=True)
    assert "v1: remove heavy files (older than the newest 1)" in text
    assert "v2: keep (one of the newest 1)" in text
    assert "would remove 2 item(s), 2.5 MB:" in text
    assert f"DVC cache {'a' * 32} (models/clip.ckpt), 0.50 MB, of v1: unused" in text
    assert text.endswith("dry run: nothing was removed")
    assert "dry run" not in render(plan, dry_run=False)


def test_outs_dvc_does_not_cache_are_no_objects_nor_unknown_folders() -> None:
    """dvc.lock records a hash for a `cache: false` out (training checkpoints, metrics) without
    saying it is not cached: read from dvc.yaml, such a folder is not one whose files are
    unknown (which would stop every removal from the cache)."""
    from registry.retention import uncached_outs

    pipeline = (Path(__file__).resolve().parents[2] / "dvc.yaml").read_text()
    skip = uncached_outs(pipeline)
    assert {"models/checkpoints", "data/shard-checks", "metrics/eval.json",
            "metrics/retain.json", "plots/train.csv"} <= skip
    assert not skip & {"models/clip.ckpt", "data/shards/train", "models/index", "data/download"}
    text = lock({"path": "models/checkpoints", "md5": "c" * 32 + ".dir", "hash": "md5"},
                {"path": "models/clip.ckpt", "md5": "1" * 32, "hash": "md5"})
    found, unreadable = objects(text, lambda md5, legacy: None, skip)
    assert found == {("1" * 32, False): "models/clip.ckpt"} and unreadable == []


def test_index_chunks_go_only_unreferenced_now_and_marked_by_an_earlier_run() -> None:
    """A chunk leaves the index store when no remaining reference names it and an earlier run
    already marked it (named by none then): one a kept version names stays, and so does one
    uploaded after that mark (a `register` whose reference is not logged yet)."""
    from registry.index_store import collectable

    held = {"kept": 10, "removed-only": 20, "uploaded-since": 30, "orphan": 40}
    found = collectable(held, referenced={"kept"},
                        marked={"kept", "removed-only", "orphan", "gone-already"})
    assert found == {"orphan": 40, "removed-only": 20}


def test_an_index_mark_is_used_only_when_old_enough() -> None:
    from registry.retention import LISTING_MIN_AGE_S, earlier_listing

    listings = {"run": {"listed_at": 1_000_000.0, "unreferenced": ["a", "b"]}}
    old = earlier_listing(listings, "run", 1_000_000.0 + LISTING_MIN_AGE_S)
    assert old.chunks == {"a", "b"} and not old.young
    assert old.about == "unreferenced at the retention run of 1970-01-12 13:46 UTC too"
    young = earlier_listing(listings, "run", 1_000_000.0 + LISTING_MIN_AGE_S - 1)
    assert young.chunks is None and young.young  # kept as the marks the next run reads
    assert "under 6 h old" in young.about and "a later run removes them" in young.about
    for state in ({}, {"run": {"unreferenced": ["a"]}}, {"run": "garbage"},
                  {"run": {"listed_at": "x", "unreferenced": ["a"]}}):
        none = earlier_listing(state, "run", 2e9)
        assert none.chunks is None and not none.young  # replaced by this run's marks
        assert "go from the next run on" in none.about


def test_a_chunk_named_at_the_earlier_run_is_not_removed_while_a_register_re_uses_it() -> None:
    """The re-use window: a chunk in the store for long, named by an old version at the earlier
    run. Now that version is removed and a `register` re-using the chunk (in the store, so not
    uploaded again) has not logged its reference yet: named by no reference now, old, yet it
    stays. Named by none at two runs LISTING_MIN_AGE_S apart, it goes."""
    from registry.retention import LISTING_MIN_AGE_S, sweep_chunks

    held = {"re-used": 10, "orphan": 20}
    t0 = 1_000_000.0
    first = sweep_chunks(held, {"re-used"}, {}, "run", t0)  # the old version names it
    assert first.removable == {} and not first.swept
    assert first.record == {"listed_at": t0, "unreferenced": ["orphan"]}

    t1 = t0 + LISTING_MIN_AGE_S
    second = sweep_chunks(held, set(), {"run": first.record}, "run", t1)  # the window
    assert second.removable == {"orphan": 20} and second.swept  # "re-used" stays
    assert second.record == {"listed_at": t1, "unreferenced": ["orphan", "re-used"]}

    third = sweep_chunks(held, set(), {"run": second.record}, "run", t1 + LISTING_MIN_AGE_S)
    assert third.removable == {"orphan": 20, "re-used": 10}  # named by none at both runs
    logged = sweep_chunks(held, {"re-used"}, {"run": second.record}, "run", t1 + 7 * 3600)
    assert logged.removable == {"orphan": 20}  # the register logged its reference meanwhile


def test_marks_too_young_remove_nothing_and_stay_for_the_next_run() -> None:
    from registry.retention import LISTING_MIN_AGE_S, sweep_chunks

    record = {"listed_at": 1_000_000.0, "unreferenced": ["orphan"]}
    sooner = sweep_chunks({"orphan": 20}, set(), {"run": record}, "run",
                          1_000_000.0 + LISTING_MIN_AGE_S - 60)
    assert sooner.removable == {} and sooner.record is None and not sooner.swept


def test_a_listing_recorded_before_marks_removes_nothing_and_is_replaced_by_marks() -> None:
    """A record of the earlier format, the store's listing ({"listed_at", "chunks"}), says
    nothing of what was named then: no chunk goes this run, and its marks are recorded."""
    from registry.retention import sweep_chunks

    old = {"run": {"listed_at": 1_000_000.0, "chunks": ["named", "orphan"]}}
    held = {"named": 10, "orphan": 20}
    found = sweep_chunks(held, set(), old, "run", 2e9)
    assert found.removable == {} and not found.swept
    assert "recorded the store's listing without marks" in found.about
    assert found.record == {"listed_at": 2e9, "unreferenced": ["named", "orphan"]}


def test_the_dry_run_names_each_index_chunk_its_bytes_and_reason() -> None:
    from registry.retention import Action, Plan, render

    chunk = "c" * 64
    plan = Plan("clip", RetentionParams(keep_last=1).model_dump(), {3: "one of the newest 1"},
                {1: "older", 2: "older"},
                [Action("index-chunk", "mlflow-artifacts:/1/s/artifacts", f"chunks/{chunk}",
                        [1, 2], 4_000_000, "named by no remaining index reference"),
                 Action("index-chunk", "mlflow-artifacts:/1/s/artifacts", "chunks/" + "d" * 64,
                        [], 1_000, "named by no remaining index reference")])
    text = render(plan, dry_run=True)
    assert (f"index store chunks/{chunk}, 4.00 MB, of v1, v2: named by no remaining index "
            "reference") in text
    assert f"index store chunks/{'d' * 64}, 0.00 MB, of no remaining version:" in text
    assert Action("index-chunk", "x", "chunks/a", [], 1, "").key != \
        Action("index-chunk", "x", "chunks/b", [], 1, "").key  # each recorded done on its own
