"""After a run, `dvc metrics show metrics/quality` is a table a person reads in a terminal: the
evaluation's figures as one row per task (i2t, t2i, zero-shot overall and per attribute) with the
same short columns, chance beside, where metrics/eval.json as a DVC metric is one row of 61 long
columns. metrics/eval.json itself is unchanged: the registry's gate and the summaries read it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from clipms.eval.outputs import quality_rows, write_quality_rows
from clipms.utils.jsonio import write_json

ROOT = Path(__file__).resolve().parents[3]
EVAL = json.loads((ROOT / "metrics" / "eval.json").read_text())  # the default run's
QUALITY = ("_R@", "mAP@", "_top1", "_top5", "_mean_per_class_recall")


def test_every_task_is_a_row_and_every_figure_is_the_flat_one():
    rows = quality_rows(EVAL)
    assert list(rows)[:3] == ["i2t", "t2i", "zeroshot"]
    attributes = {"zeroshot_colour", "zeroshot_shape", "zeroshot_size", "zeroshot_background"}
    assert attributes <= set(rows)
    assert rows["i2t"]["R@5"] == EVAL["i2t_R@5"] and rows["i2t"]["mAP@10"] == EVAL["mAP@10"]
    assert rows["t2i"]["R@5_chance"] == EVAL["chance_t2i_R@5"]
    assert rows["zeroshot_shape"]["top1"] == EVAL["zeroshot_shape_top1"]
    assert rows["zeroshot_shape"]["top1_chance"] == EVAL["chance_zeroshot_shape_top1"]
    assert rows["zeroshot"]["class_recall"] == EVAL["zeroshot_mean_per_class_recall"]
    shown = {value for row in rows.values() for value in row.values()}
    scores = {k for k in EVAL if any(q in k for q in QUALITY) and not k.startswith("chance_")
              and not k.endswith(("R@1", "R@10"))}
    assert {k for k in scores if EVAL[k] not in shown} == set()
    assert len({column for row in rows.values() for column in row}) <= 9


def test_a_task_this_run_did_not_score_leaves_the_table(tmp_path):
    folder = tmp_path / "quality"
    write_quality_rows(folder, EVAL)
    assert (folder / "zeroshot_shape.json").is_file()
    unlabelled = {k: v for k, v in EVAL.items() if "_shape_" not in k}
    write_quality_rows(folder, unlabelled)
    assert not (folder / "zeroshot_shape.json").exists()
    assert json.loads((folder / "i2t.json").read_text()) == quality_rows(EVAL)["i2t"]


def widest_line(project: Path, *targets: str) -> int:
    shown = subprocess.run(["dvc", "metrics", "show", *targets], cwd=project, check=True,
                           capture_output=True, text=True).stdout
    assert shown.strip(), "dvc printed no table"
    return max(len(line) for line in shown.splitlines())


def test_dvc_prints_the_table_a_terminal_can_show(tmp_path):
    project = tmp_path / "project"
    (project / "metrics").mkdir(parents=True)
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=project, check=True)
    write_json(project / "metrics" / "eval.json", EVAL)
    write_quality_rows(project / "metrics" / "quality", EVAL)
    table = widest_line(project, "metrics/quality", "--precision", "3")
    flat = widest_line(project, "metrics/eval.json", "--precision", "3")
    assert table <= 140 < 5 * table < flat
