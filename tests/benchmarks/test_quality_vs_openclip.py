"""benchmarks/quality_vs_openclip.py `table`: the comparison of its arms (ours from each init,
open_clip) over their seeds, checked against scipy's t-tests on a results.jsonl written here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import pytest
from scipy import stats

from harness.dvc_workspace import PROJECT_ROOT


@pytest.fixture(scope="module")
def bench():
    path = PROJECT_ROOT / "benchmarks/quality_vs_openclip.py"
    spec = importlib.util.spec_from_file_location("quality_vs_openclip", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OURS = {0: 0.070, 1: 0.081, 2: 0.064, 3: 0.090, 4: 0.077, 5: 0.085}
PEER = {0: 0.086, 1: 0.077, 2: 0.094, 3: 0.090}
FROM_PEER_INIT = {0: 0.086, 1: 0.079, 2: 0.092}


def test_welch_and_paired_match_scipy(bench):
    a, b = list(OURS.values()), list(PEER.values())
    t, df = bench.welch(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert t == pytest.approx(ref.statistic, rel=1e-9) and df == pytest.approx(ref.df, rel=1e-9)
    seeds, mean, sd, pt = bench.paired(OURS, PEER)
    ref = stats.ttest_rel([OURS[s] for s in seeds], [PEER[s] for s in seeds])
    assert seeds == [0, 1, 2, 3] and pt == pytest.approx(ref.statistic, rel=1e-9)
    diffs = [OURS[s] - PEER[s] for s in seeds]
    assert mean == pytest.approx(sum(diffs) / 4) and sd == pytest.approx(stats.tstd(diffs))
    same = bench.paired({0: 0.1, 1: 0.2}, {0: 0.1, 1: 0.2})  # identical runs: t undefined
    assert same[1:3] == (0.0, 0.0) and math.isnan(same[3])
    assert bench.paired({0: 0.5, 1: 0.75}, {0: 0.25, 1: 0.5})[3] == math.inf


def row(side: str, seed: int, value: float, init: str = "own") -> dict:
    recalls = {k: value for k in ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5",
                                  "t2i_R@10", "mAP@10")}
    recalls["t2i_R@5"] = value / 2
    return {"side": side, "seed": seed, "init": init, "preset": "mini", "wd_rule": "openclip",
            "steps": 160, "lr": 5e-4, "batch_size": 64, "load_avg_1m": 1.0,
            "final_loss": 2.5, "train_s": 60.0, **recalls}


def test_table_compares_every_arm_over_its_seeds(bench, tmp_path, capsys):
    rows = [row("ours", s, 0.5) for s in OURS]  # superseded: the last run of a seed counts
    rows += [row("ours", s, v) for s, v in OURS.items()]
    rows += [row("open_clip", s, v) for s, v in PEER.items()]
    rows += [row("ours", s, v, init="openclip") for s, v in FROM_PEER_INIT.items()]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench.table(argparse.Namespace(work=tmp_path))
    out = capsys.readouterr().out
    lines = {line.split(" | ")[0].lstrip("| ") + " / " + line.split(" | ")[1]: line
             for line in out.splitlines() if line.startswith("| ") and " - " in line}

    own = next(line for line in out.splitlines() if line.startswith("| ours, init own | 6 |"))
    assert f"{stats.tmean(list(OURS.values())):.3f} +- {stats.tstd(list(OURS.values())):.3f}" \
        in own
    for key, a, b in (("ours, init own - open_clip", OURS, PEER),
                      ("ours, init own - ours, init openclip", OURS, FROM_PEER_INIT),
                      ("ours, init openclip - open_clip", FROM_PEER_INIT, PEER)):
        for metric, scale in (("i2t_R@5", 1.0), ("t2i_R@5", 0.5)):
            x, y = [v * scale for v in a.values()], [v * scale for v in b.values()]
            cells = lines[f"{key} / {metric}"].strip("| ").split(" | ")
            welch = stats.ttest_ind(x, y, equal_var=False)
            assert cells[2] == f"{sum(x) / len(x) / (sum(y) / len(y)):.2f}"
            assert cells[3] == f"{welch.statistic:+.2f} ({welch.df:.1f})"
            common = sorted(set(a) & set(b))
            paired = stats.ttest_rel([a[s] * scale for s in common], [b[s] * scale for s in common])
            assert cells[4] == f"{common[0]}-{common[-1]}"
            assert cells[6] == f"{paired.statistic:+.2f}"
    assert not any(k.startswith("open_clip - ") for k in lines), "open_clip is the reference only"


def curve(points: list[tuple[int, float, float]]) -> list[dict]:
    """Checks (step, train_s, R@5 of both directions)."""
    return [{"step": step, "train_s": seconds, "i2t_R@5": r5, "t2i_R@5": r5}
            for step, seconds, r5 in points]


def test_time_to_equal_quality_is_each_sides_first_check_at_the_quality_both_reached(
        bench, tmp_path, capsys, monkeypatch):
    """Per seed: the lower final R@5 of the two sides is the quality; each side's time is its
    first check at or above it. Settings (loss, patch dropout) are compared apart."""
    siglip = {"loss": "siglip", "patch_dropout": 0.5, "eval_every": 20}
    rows = [
        {**row("ours", 0, 0.30), **siglip, "first_step_s": 6.0,
         "curve": curve([(20, 10.0, 0.10), (40, 20.0, 0.25), (60, 30.0, 0.30)])},
        {**row("open_clip", 0, 0.28), **siglip, "curve": curve([(20, 40.0, 0.20),
                                                               (40, 80.0, 0.26),
                                                               (60, 120.0, 0.28)])},
        {**row("ours", 1, 0.20), **siglip, "curve": curve([(20, 12.0, 0.20), (40, 24.0, 0.21)])},
        {**row("open_clip", 1, 0.40), **siglip, "curve": curve([(20, 30.0, 0.19),
                                                               (40, 60.0, 0.40)])},
        row("ours", 0, 0.5),  # the softmax loss without dropout: another setting
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "benchmarks"))  # its `import record`
    bench.table(argparse.Namespace(work=tmp_path, json_out=tmp_path / "out.json"))
    out = capsys.readouterr().out
    assert "loss siglip, patch dropout 0.5" in out and "loss clip, patch dropout 0;" in out
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["benchmark"] == "out" and "commit" in result["meta"]  # record.py's envelope
    assert "\n".join(bench.tables(result["results"]["runs"])) in out  # what RESULTS.md renders
    found = result["results"]["settings"]
    timed = next(s for s in found if "siglip" in s["setting"])["equal_quality"]
    # seed 0: quality 0.28 (open_clip's end); ours first at 0.30 (step 60, 30 s), open_clip at
    # its step 60 (120 s). Seed 1: quality 0.21 (ours); ours at step 40, open_clip at step 40.
    assert [(t["seed"], t["quality"], t["ours_step"], t["ours_train_s"], t["open_clip_step"],
             t["open_clip_train_s"]) for t in timed] == [(0, 0.28, 60, 30.0, 60, 120.0),
                                                          (1, 0.21, 40, 24.0, 40, 60.0)]
    assert [t["ours_over_open_clip_s"] for t in timed] == [0.25, 0.4]
    # seed 0's first step (compilation) left out: (30 - 6) / 120; seed 1 recorded none
    assert [t.get("ours_over_open_clip_s_after_first_step") for t in timed] == [0.2, None]
    assert "| 0 | 0.280 | 60 | 30 | 60 | 120 | 0.25 | 0.20 |" in out
    assert "| 1 | 0.210 | 40 | 24 | 40 | 60 | 0.40 | - |" in out


def test_arms_of_one_seed_each_get_no_table_of_tests(bench):
    """A t needs two seeds on each side: one seed each lists the arms and nothing else."""
    lines = bench.comparison({"ours, init own": {0: row("ours", 0, 0.1)},
                              "open_clip": {0: row("open_clip", 0, 0.2)}})
    assert any(line.startswith("| ours, init own | 1 |") for line in lines)
    assert not any("arm - reference" in line for line in lines)
