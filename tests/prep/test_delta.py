"""The data-change report (prep.delta): what it counts against the last accepted run, how
the snapshots rotate (a rerun of a night reports the same; a failed check keeps the baseline), and
each threshold stopping the run with a message naming the problem and the param. The inputs are
the files the stages write, made here: metadata.parquet (with the source's columns, as the
metadata stage records them), images.parquet and the download catalog."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clipms.text.clip_tokenizer import Tokenizer
from prep.catalog import file_sha256, read_catalog, write_catalog
from prep.delta import ChangesError, Thresholds, run
from prep.sources import SCHEMA
from prep.sourceschema import with_source_columns

SOURCE = pa.schema([("URL", pa.string()), ("TEXT", pa.string())])
LIMITS = Thresholds(min_new=2)


def quiet(_message: str) -> None:
    pass


def captions(i: int) -> list[str]:
    return [f"a red circle number {i}", f"picture {i} of a red circle"]


@dataclass
class Night:
    """One night's files: images (index -> captions), download statuses of some, extra rows."""

    images: dict[int, list[str]]
    failed: set[int] = field(default_factory=set)
    empty_rows: int = 0  # extra metadata rows with an empty caption, for new images
    source: pa.Schema = SOURCE
    labels: dict[str, str] | None = None
    sizes: tuple[int, int] = (120, 90)

    def write(self, folder: Path) -> Path:
        (folder / "data/download").mkdir(parents=True, exist_ok=True)
        urls = {i: f"http://site/{i}.jpg" for i in self.images}
        texts = [(urls[i], t) for i, caps in self.images.items() for t in caps]
        texts += [(f"http://site/empty{n}.jpg", "") for n in range(self.empty_rows)]
        labels = json.dumps(self.labels) if self.labels else None
        table = pa.table({"URL": [u for u, _ in texts], "TEXT": [t for _, t in texts],
                          "LABELS": [labels] * len(texts), "ID": [None] * len(texts),
                          "SPLIT": [None] * len(texts)}, schema=SCHEMA)
        pq.write_table(with_source_columns(table, self.source), folder / "data/metadata.parquet")
        keys = {i: f"{i:016x}" for i in self.images}
        pd.DataFrame({"url": list(urls.values()), "key": list(keys.values()), "caption": "c",
                      "captions": list(self.images.values()), "split": "train",
                      "labels": labels}).to_parquet(folder / "data/images.parquet", index=False)
        failed = [i in self.failed for i in self.images]
        catalog = pd.DataFrame({
            "key": list(keys.values()), "url": list(urls.values()),
            "status": ["failed" if f else "reused" for f in failed],
            "reason": ["HTTP Error 404: Not Found" if f else None for f in failed],
            "part": 0, "tar": [None if f else "s/parts/00000/00000.tar" for f in failed],
            "original_width": [None if f else self.sizes[0] for f in failed],
            "original_height": [None if f else self.sizes[1] for f in failed]})
        write_catalog(folder / "data/download", catalog,
                      file_sha256(folder / "data/images.parquet"), "s-test")
        return folder


def report_of(folder: Path, tokenizer: Tokenizer | None = None,
              limits: Thresholds = LIMITS) -> dict:
    return run(folder / "data/metadata.parquet", folder / "data/images.parquet",
               read_catalog(folder / "data/download"), tokenizer, folder / "data/changes",
               folder / "metrics/changes.json", limits, print_fn=quiet)


def first(folder: Path, n: int = 8) -> Night:
    night = Night({i: captions(i) for i in range(n)})
    night.write(folder)
    report_of(folder)
    return night


def snapshot_digest(folder: Path, generation: str = "current") -> str:
    return json.loads((folder / f"data/changes/{generation}/snapshot.json").read_text())["digest"]


def test_the_first_night_is_all_new_and_becomes_the_baseline(tmp_path):
    first(tmp_path)
    result = json.loads((tmp_path / "metrics/changes.json").read_text())
    assert result["baseline"]["first_run"] is True and result["ok"] is True
    assert result["images"] == {"total": 8, "new": 8, "removed": 0, "kept": 0,
                                "captions_changed": 0}
    assert result["rows"]["new"] == 16 and result["download"]["new_held"] == 8
    assert result["image_size"]["new_short_side_p50"] == 90.0
    assert (tmp_path / "data/changes/current/snapshot.json").is_file()
    assert not (tmp_path / "data/changes/previous").exists()


def test_a_night_counts_what_is_new_removed_and_recaptioned_and_a_rerun_says_the_same(tmp_path):
    first(tmp_path)
    night_1 = snapshot_digest(tmp_path)
    images = {i: captions(i) for i in range(1, 11)}  # 0 removed, 8-10 new
    images[3] = ["a red circle, captioned again"]
    Night(images, sizes=(60, 40)).write(tmp_path)
    result = report_of(tmp_path)
    assert result["baseline"] == {"first_run": False, "images": 8, "rows": 16}
    assert result["images"] == {"total": 10, "new": 3, "removed": 1, "kept": 7,
                                "captions_changed": 1}
    # caption rows: 3 new images x 2 + image 3's new caption; image 0's 2 and image 3's 2 removed
    assert (result["rows"]["new"], result["rows"]["removed"]) == (7, 4)
    assert result["image_size"]["new_short_side_p50"] == 40.0
    assert snapshot_digest(tmp_path, "previous") == night_1  # rotated
    night_2 = snapshot_digest(tmp_path)

    again = report_of(tmp_path)  # `dvc repro -f`: compared with the night before, not itself
    assert again == result
    assert snapshot_digest(tmp_path) == night_2 and snapshot_digest(tmp_path,
                                                                    "previous") == night_1


def broken(tmp_path: Path, **night: object) -> tuple[str, dict]:
    """A night after `first` that fails its checks: the message, the report on disk."""
    first(tmp_path)
    baseline = snapshot_digest(tmp_path)
    images = {i: captions(i) for i in range(12)}
    Night(**{"images": images, **night}).write(tmp_path)
    with pytest.raises(ChangesError) as err:
        report_of(tmp_path)
    assert snapshot_digest(tmp_path) == baseline  # not accepted: tomorrow compares with night 1
    result = json.loads((tmp_path / "metrics/changes.json").read_text())
    assert result["ok"] is False and result["failures"]
    return str(err.value), result


def test_most_new_images_failing_to_download_stops_the_run(tmp_path):
    message, result = broken(tmp_path, failed={8, 9, 10})
    assert "the new data looks broken, so the run stops before training" in message
    assert ("3 of 4 new images did not arrive (failed or refused); top reasons: 3 x failed: "
            "HTTP Error 404: Not Found (0.750 > changes.max_new_failure_rate 0.5)") in message
    assert result["download"]["new_failed"] == 3


def test_empty_new_captions_stop_the_run(tmp_path):
    message, _ = broken(tmp_path, empty_rows=4)
    assert "4 of 12 new caption rows are empty (0.333 > changes.max_empty_caption_share" in message


def test_a_schema_change_of_the_source_stops_the_run_unless_warned(tmp_path):
    wider = SOURCE.append(pa.field("score", pa.float64()))
    message, result = broken(tmp_path, source=wider)
    assert ("the metadata's schema changed: the source's columns were URL (string), TEXT "
            "(string), now URL (string), TEXT (string), score (double)") in message
    assert "changes.on_schema_change: warn accepts it" in message
    Night({i: captions(i) for i in range(12)}, source=wider).write(tmp_path)
    warned = report_of(tmp_path, limits=Thresholds(min_new=2, on_schema_change="warn"))
    assert warned["ok"] is True and warned["schema"]["changed"]


def test_new_images_with_other_label_fields_are_a_schema_change(tmp_path):
    first_night = Night({i: captions(i) for i in range(8)}, labels={"shape": "circle"})
    first_night.write(tmp_path)
    report_of(tmp_path)
    Night({i: captions(i) for i in range(12)}, labels={"form": "circle"}).write(tmp_path)
    with pytest.raises(ChangesError, match=r"label fields: \['shape'\] before, \['form'\] in the "
                                           r"new images"):
        report_of(tmp_path)


def test_new_words_the_tokenizer_has_no_token_for_are_counted_and_may_stop_the_run(tmp_path):
    tokenizer = Tokenizer.train([c for i in range(8) for c in captions(i)] * 4, 600, 16)
    Night({i: captions(i) for i in range(8)}).write(tmp_path)
    report_of(tmp_path, tokenizer)
    new = {i: [f"ein rotes quadrat nummer {i}"] for i in range(8, 12)}
    Night({**{i: captions(i) for i in range(8)}, **new}).write(tmp_path)
    limits = Thresholds(min_new=2, max_unknown_word_share=0.5)
    with pytest.raises(ChangesError) as err:
        report_of(tmp_path, tokenizer, limits)
    result = json.loads((tmp_path / "metrics/changes.json").read_text())
    tokens = result["tokens"]
    assert tokens["kept_unknown_word_share"] == 0.0
    # 4 x "ein rotes quadrat nummer" (unknown) and the digits of 8, 9, 10, 11 (each digit is a
    # word of its own, and a single character always has a token): 16 of 22 words
    assert tokens["new_unknown_word_share"] == pytest.approx(16 / 22, abs=1e-4)
    assert [w for w, _ in tokens["top_new_unknown_words"]] == ["ein", "rotes", "quadrat",
                                                               "nummer"]
    assert "has no token for 72.7% of the new captions' words" in str(err.value)
    assert "changes.max_unknown_word_share 0.5" in str(err.value)
    assert report_of(tmp_path, tokenizer)["ok"] is True  # null threshold: reported only


def test_too_few_new_images_are_reported_not_checked(tmp_path):
    first(tmp_path)
    Night({i: captions(i) for i in range(9)}, failed={8}).write(tmp_path)
    result = report_of(tmp_path, limits=Thresholds(min_new=5))
    assert result["ok"] is True and result["download"]["new_failure_rate"] == 1.0
    assert result["checks"]["new_failure_rate"]["ok"] is None
    assert "fewer than changes.min_new 5" in result["checks"]["new_failure_rate"]["message"]
