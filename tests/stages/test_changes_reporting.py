"""Where the data-change report is seen besides metrics/changes.json: the Prefect summary artifact,
the pipeline's MLflow run (train logs it when it opens the run: its numbers as `data.*` metrics,
the file as an artifact), and the source's columns the metadata stage records for its schema
check."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from flows import summary
from pipeline import paths
from prep.sources import read_captions, write_table
from prep.sourceschema import source_columns
from tracking import run as tracking_run
from tracking.files import FILES
from tracking.journal import LogArtifact, LogMetrics
from tracking.settings import TrackingFiles

REPORT = {
    "baseline": {"first_run": False, "images": 2000, "rows": 10000},
    "images": {"total": 2200, "new": 220, "removed": 20, "kept": 1980, "captions_changed": 3},
    "rows": {"total": 11000, "new": 1100, "removed": 100, "new_empty": 0, "new_empty_share": 0.0},
    "download": {"new": 220, "new_held": 40, "new_failed": 170, "new_refused": 10,
                 "new_failure_rate": 0.8182, "top_reasons": [["failed: timed out", 170]]},
    "tokens": {"tokenizer": "bpe, 4096 ids", "new_unknown_word_share": 0.02,
               "kept_unknown_word_share": 0.01, "top_new_unknown_words": [["hexagon", 9]]},
    "image_size": {"new_short_side_p50": 128.0, "kept_short_side_p50": 128.0},
    "captions": {"new_words_mean": 7.5},
    "schema": {"changed": []},
    "checks": {},
    "failures": ["180 of 220 new images did not arrive (0.818 > changes.max_new_failure_rate "
                 "0.5)"],
    "ok": False,
}


def test_the_summary_artifact_shows_what_changed_and_which_check_failed(tmp_path: Path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / summary.DATA_CHANGES).write_text(json.dumps(REPORT))
    stages = [{"stage": "changes", "outcome": "FAILED", "seconds": 1.0}]
    text = summary.render(summary.RunReport("failed at stage 'changes'", stages), tmp_path)
    assert "## Data changes" in text
    assert "| images new / removed / total | 220 / 20 / 2200 |" in text
    assert "| new images failed / refused | 170 / 10 of 220 |" in text
    assert "| compared with | the last accepted run (2000 images) |" in text
    assert ("| checks | 180 of 220 new images did not arrive (0.818 > "
            "changes.max_new_failure_rate 0.5) |") in text
    assert text.index("## Data changes") < text.index("## Evaluation metrics")

    (tmp_path / summary.DATA_CHANGES).write_text(json.dumps({"ok": True, "failures": []}))
    partial = summary.render(summary.RunReport("x", stages), tmp_path)
    assert "| images new / removed / total | ? / ? / ? |" in partial  # an older report's keys
    assert "| checks | passed |" in partial
    (tmp_path / summary.DATA_CHANGES).unlink()
    assert "_`metrics/changes.json` not produced_" in summary.render(
        summary.RunReport("x", stages), tmp_path)


def test_the_report_s_path_has_one_owner():
    assert summary.DATA_CHANGES == paths.CHANGES_METRICS == FILES.data_changes


def test_train_logs_the_report_into_the_run_it_opens(tmp_path: Path, monkeypatch):
    """Queued records only: the run is held (a checkpoint record exists), so nothing is sent."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("register:\n  experiment: test\n")
    report = tmp_path / "metrics/changes.json"
    report.parent.mkdir()
    report.write_text(json.dumps(REPORT))
    held = tmp_path / "checkpoints-run.json"
    held.write_text("{}")
    files = TrackingFiles(params=Path("params.yaml"), run_file=Path("run.json"),
                          journal_dir=Path("journal"), lock=Path("dvc.lock"),
                          manifest=Path("manifest.json"), data_changes=report)
    run = tracking_run.PipelineRun.open("train", {"lr": 1e-3}, files, resume_record=held)
    metrics = {row.key: row.value for record in run.pending if isinstance(record, LogMetrics)
               for row in record.metrics}
    assert metrics["data.images.new"] == 220 and metrics["data.download.new_failure_rate"] == \
        0.8182 and metrics["data.tokens.new_unknown_word_share"] == 0.02
    assert not any(key.startswith(("data.baseline", "data.failures", "data.ok")) for key in metrics)
    # lists (reasons, words) stay in the file
    assert not any("hexagon" in key or "reasons" in key for key in metrics)
    artifacts = [(r.path, r.artifact_path) for r in run.pending if isinstance(r, LogArtifact)]
    assert artifacts == [(str(report), "data")]
    run.stop_sending()


def test_the_metadata_file_records_the_source_s_columns(tmp_path: Path):
    source = tmp_path / "export.parquet"
    pd.DataFrame({"image": ["http://a/1.jpg"], "text": ["a caption"], "score": [0.5]}).to_parquet(
        source, index=False)
    table = read_captions(source, "image", "text")
    assert source_columns(table.schema) == [["image", "string"], ["text", "string"],
                                            ["score", "double"]]
    write_table(table, tmp_path / "metadata.parquet")
    assert source_columns(pq.read_schema(tmp_path / "metadata.parquet")) == [
        ["image", "string"], ["text", "string"], ["score", "double"]]
