"""benchmarks/time_to_quality.py at a tiny size: the tiny pipeline's data stages, then two
candidates on one seed (the old default to its end, a lever run stopped at the target) with checks
every 2 steps, the JSON and the tables. The order of runs over several seeds is `schedule`'s, tested
below without training. What the benchmark measures is in benchmarks/RESULTS.md; this keeps the
command from rotting."""

from __future__ import annotations

import json
import sys

import pytest

from harness.dvc_workspace import PROJECT_ROOT, make_workspace, run, tool_env

SCRIPT = PROJECT_ROOT / "benchmarks/time_to_quality.py"


@pytest.mark.slow
def test_the_benchmark_runs_alternates_checks_and_stops_lever_runs_at_the_target(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT), "CLIPMS_KERNEL_FUSION": "0"}
    run(["dvc", "repro", "tokenizer"], cwd=ws, timeout=900, env=env)
    out = tmp_path / "time_to_quality.json"
    run([sys.executable, str(SCRIPT), "run", "--work", str(ws), "--candidates", "old-default",
         "siglip-pd50", "--seeds", "0", "--max-steps", "4", "--eval-every", "2",
         "--target", "0.0", "--out", str(out)],
        cwd=PROJECT_ROOT, timeout=2400, env=env)
    record = json.loads(out.read_text())
    assert record["benchmark"] == out.stem  # benchmarks/record.py's envelope: results/<name>.json
    assert {"command", "commit", "load_avg", "machine"} <= record["meta"].keys()
    assert " --work WORK " in record["meta"]["command"]  # the reader's checkout, not this one
    record = record["results"]
    # the old default first (its time bounds the lever runs), then the lever
    assert [(r["candidate"], r["seed"]) for r in record["runs"]] == [
        ("old-default", 0), ("siglip-pd50", 0)]
    for row in record["runs"]:
        assert row["load_1m_start"] >= 0 and row["train_s"] > 0
        checks = [c["step"] for c in row["curve"]]
        if row["candidate"] == "old-default":  # to the end, checked every 2 steps
            assert checks == [2, 4] and row["stopped"] is None and row["steps"] == 4
        else:  # a lever run: stopped at the first check at the target
            assert checks == [2] and row["stopped"] == "target" and row["steps"] == 2
            assert row["overrides"]["loss"] == "siglip"
        assert 0 <= row["final"]["zeroshot_top1"] <= 1 and 0 <= row["final"]["i2t_R@5"] <= 1
    seed0 = record["summary"]["siglip-pd50"]["0"]
    assert seed0["steps_to_target"] == 2 and seed0["stopped"] == "target"
    assert seed0["to_target_over_old_default_train_s"] is not None
    assert record["summary"]["siglip-pd50"]["meets"] is False  # stopped runs are not defaults
    assert record["summary"]["old-default"]["0"]["to_target_over_old_default_to_target"] == 1.0
    tables = run([sys.executable, str(SCRIPT), "table", str(out)], cwd=PROJECT_ROOT,
                 env=env).stdout
    assert "| siglip-pd50 | 0 | 2 (stopped: target) |" in tables
    assert "| siglip-pd50 | loss=siglip, model.vision.patch_dropout=0.5 | no |" in tables


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("time_to_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_all_at_once_gives_every_run_a_lane_of_its_own_and_lanes_keep_a_seed_s_order():
    ttq = _script()
    plan = ttq.schedule(["clip-45ep", "old-default", "pd50"], [0, 1])
    assert plan == {0: ["old-default", "clip-45ep", "pd50"],
                    1: ["old-default", "pd50", "clip-45ep"]}
    assert ttq.lanes_of(plan, all_at_once=False) == list(plan.items())
    assert ttq.lanes_of(plan, all_at_once=True) == [
        (0, ["old-default"]), (0, ["clip-45ep"]), (0, ["pd50"]),
        (1, ["old-default"]), (1, ["pd50"]), (1, ["clip-45ep"])]


def test_results_md_renders_the_result_file_with_the_benchmarks_own_tables(tmp_path):
    sys.path.insert(0, str(PROJECT_ROOT / "benchmarks"))
    import record
    import render_results

    ttq = _script()
    curve = [{"step": 2, "train_s": 1.0, "zeroshot_top1": 0.9, "i2t_R@5": 0.96, "t2i_R@5": 0.97,
              "i2t_R@1": 0.5, "t2i_R@1": 0.5}]
    runs = [{"candidate": name, "seed": 0, "steps": 2, "train_s": s, "samples_per_s": 10.0,
             "stopped": None, "final": curve[-1], "curve": curve, "load_1m_start": 1.0,
             "load_1m_end": 2.0} for name, s in (("old-default", 4.0), ("clip-45ep", 2.0))]
    result = {"target": {"zeroshot_top1": 0.85, "eval_every": 2},
              "candidates": {n: ttq.CANDIDATES[n] for n in ("old-default", "clip-45ep")},
              "runs": runs, "summary": ttq.summarise(runs, 0.85)}
    record.Recording("time_to_quality", "python benchmarks/time_to_quality.py run").write(
        result, tmp_path / "time_to_quality.json")
    block = render_results.render_block("time_to_quality", tmp_path)
    assert "| clip-45ep | 0 | 2 | 2 | 10 | 2 | 1 | 0.25 | 0.900 | 0.960 | 0.970 |" in block
    assert "| clip-45ep | epochs=45 | yes |" in block
