"""The month-of-nights benchmark's own parts that need no pipeline: its plan of planted nights and
its storage count (the nights themselves run in tests/e2e/test_nights.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.nights import (
    DEFAULT_PLAN,
    FAILURES,
    Schedule,
    asked_pictures,
    grown,
    parse_plan,
    size_of,
    tmpfs_bytes,
)


def test_a_plan_names_nights_and_known_kinds_only() -> None:
    assert parse_plan("3:broken_source, 4:diverging") == {3: "broken_source", 4: "diverging"}
    assert set(DEFAULT_PLAN.values()) == set(FAILURES)  # the default plants every failure once
    assert parse_plan("5:poisoned") == {5: "poisoned"}
    with pytest.raises(ValueError, match="bad plant '5:flood'.*disk_full"):
        parse_plan("5:flood")
    with pytest.raises(ValueError, match="bad plant 'x:sigkill'"):
        parse_plan("x:sigkill")


def test_storage_counts_a_hard_linked_file_once(tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "a").mkdir(parents=True)
    (store / "a" / "blob").write_bytes(b"x" * 1000)
    os.link(store / "a" / "blob", store / "blob-again")  # DVC links cache files into workspaces
    (store / "small").write_bytes(b"y" * 10)
    assert size_of(store) == 1010
    assert size_of(store / "small") == 10 and size_of(tmp_path / "absent") == 0


def test_a_full_disk_is_sized_in_whole_pages_per_file(tmp_path: Path) -> None:
    """A DVC cache is many small files; a tmpfs sized to their byte count cannot hold them."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "small").write_bytes(b"x" * 10)
    (tmp_path / "big").write_bytes(b"y" * 5000)
    (tmp_path / "empty").write_bytes(b"")
    assert tmpfs_bytes(tmp_path) == 4096 + 2 * 4096  # an empty file takes no page


def test_a_world_grows_by_its_share_and_a_poisoned_night_doubles_it() -> None:
    assert [grown(0, 48, 0.05), grown(48, 48, 0.05), grown(10, 48, 0.01)] == [48, 3, 1]
    assert grown(72, 48, 0.5, poisoned=True) == 72
    plan = {3: "broken_source", 5: "poisoned", 6: "no_new_rows"}
    # 48, +24, +36 (a broken night lists them too), +54, +162, +0
    assert Schedule(6, plan, growth=0.5).capacity() == 324


def test_the_pictures_asked_for_are_counted_once_and_the_old_ones_named() -> None:
    requests = ["/img/3.jpg", "/img/50.jpg", "/img/50.jpg", "/img/51.jpg", "/healthz"]
    assert asked_pictures(requests, listed_before=48) == {"pictures": 3, "listed_before": 1}
    assert asked_pictures([], listed_before=48) == {"pictures": 0, "listed_before": 0}
