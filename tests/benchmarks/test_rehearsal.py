"""The MSCOCO rehearsal command (benchmarks/rehearsal.py) and its meter (benchmarks/stage_clock.py):
the meter's figures against a child that spends known amounts, the clone's wrapped dvc.yaml, and
the whole command at a few hundred images so that it cannot rot (the full-size run is a
benchmark: docs/scaling.md)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from benchmarks import rehearsal
from benchmarks.stage_clock import measure
from harness import processes
from harness.dvc_workspace import PROJECT_ROOT, TINY_PARAMS, tool_env

# Ten stages, five of which compile MindSpore graphs: on a shared 2-core machine under load this
# takes tens of minutes.
COMMAND_TIMEOUT_S = 2400

# A child that holds ~100 MB, writes 8 MB to disk and spins for ~0.2 CPU-s, in a grandchild
# (the meter must see through the shell, as through `dvc repro` to a stage).
SPENDER = ("import os, time\n"
           "block = bytearray(100 * 2**20)\n"
           "for i in range(0, len(block), 4096): block[i] = 1\n"
           "with open({path!r}, 'wb') as f: f.write(bytes(8 * 2**20))\n"
           "end = time.process_time() + 0.2\n"
           "while time.process_time() < end: pass\n"
           "time.sleep(0.4)\n")


def test_the_meter_sees_cpu_memory_and_writes_of_grandchildren(tmp_path):
    """Through the clock's own command line, as the rehearsal runs it: Linux starts a forked
    child's peak RSS at its parent's, so measured from inside a big test process the peak would
    be that process's (a pytest worker that has run training holds over a GB)."""
    code = SPENDER.format(path=str(tmp_path / "written.bin"))
    out = tmp_path / "cost.json"
    subprocess.run([sys.executable, str(PROJECT_ROOT / "benchmarks/stage_clock.py"), "--out",
                    str(out), "--sample-s", "0.1", "--", "bash", "-c",
                    f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}; true"],
                   check=True, timeout=60)
    cost = SimpleNamespace(**json.loads(out.read_text()))
    assert cost.exit_code == 0
    assert 0.2 <= cost.cpu_s < 4
    assert cost.wall_s > 0.6  # the spin and the sleep
    assert 100 <= cost.peak_rss_mb < 250
    assert 100 <= cost.peak_tree_rss_mb < 400 and cost.processes >= 2
    assert 8 <= cost.written_mb < 12


def test_the_meter_reports_a_failing_command():
    cost = measure([sys.executable, "-c", "raise SystemExit(3)"], sample_s=None)
    assert cost.exit_code == 3 and cost.peak_tree_rss_mb == 0.0


def test_every_stage_command_is_wrapped_in_the_clock_in_dvc_yaml_order(tmp_path):
    dvc_yaml = tmp_path / "dvc.yaml"
    dvc_yaml.write_text((PROJECT_ROOT / "dvc.yaml").read_text())
    stages = rehearsal.wrap_stage_commands(dvc_yaml, tmp_path / "clock")
    original = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    assert stages == list(original)
    wrapped = yaml.safe_load(dvc_yaml.read_text())["stages"]
    for name in stages:
        clock = (f"python benchmarks/stage_clock.py --out {tmp_path / 'clock' / name}.json -- "
                 f"{original[name]['cmd']}")
        assert wrapped[name]["cmd"] == clock
        assert {k: v for k, v in wrapped[name].items() if k != "cmd"} == {
            k: v for k, v in original[name].items() if k != "cmd"}


def test_the_val_split_is_mscocos_share_and_overrides_apply_in_order(tmp_path):
    assert rehearsal.default_val_images(123_287) == 5_000
    assert rehearsal.default_val_images(2_000) == 81 and rehearsal.default_val_images(10) == 1
    args = rehearsal.parse_args(["--images", "500", "--set", "train.max_steps=7",
                                 "--set", "download.image_size=128", "--workdir", str(tmp_path)])
    found = rehearsal.overrides(args, 8123)
    assert found["metadata.num_images"] == 500 and found["metadata.synthetic_val_images"] == 20
    assert found["metadata.synthetic_url"] == "http://127.0.0.1:8123/"
    assert found["train.max_steps"] == 7 and found["download.image_size"] == 128  # --set wins
    assert found["metadata.synthetic_captions"] == "mscoco"  # from the profile


def test_the_recorded_command_names_the_scratch_folder_by_its_role_not_its_path():
    shown = rehearsal.shown_argv(["--images", "500", "--workdir", "/scratch/w", "--keep",
                                  "--workdir=/scratch/v"])
    assert shown == ["benchmarks/rehearsal.py", "--images", "500", "--workdir", "WORKDIR",
                     "--keep", "--workdir=WORKDIR"]


def test_a_result_recorded_per_size_is_rendered_by_its_benchmarks_renderer():
    sys.path.insert(0, str(PROJECT_ROOT / "benchmarks"))
    import render_results

    assert render_results.renderer("rehearsal-123287") is render_results.rehearsal
    assert render_results.renderer("rehearsal-240") is render_results.rehearsal
    assert render_results.renderer("retrieval") is render_results.retrieval
    assert render_results.renderer("rehearsal-x") is render_results.plain


def test_a_resumed_rehearsals_table_names_each_earlier_part():
    sys.path.insert(0, str(PROJECT_ROOT / "benchmarks"))
    import render_results

    meta = {"command": "python benchmarks/rehearsal.py --images 240", "commit": "abc1234",
            "dirty": False, "started_utc": "2026-01-01T01:00:00Z",
            "finished_utc": "2026-01-01T02:00:00Z",
            "machine": {"cpu": "CPU", "cores": 2, "memory_gb": 8.0},
            "load_avg": {"start": [1.0, 1.0, 1.0], "end": [2.0, 2.0, 2.0]}}
    stage = {"stage": "register", "command": {"wall_s": 1.0, "cpu_s": 1.0, "peak_rss_mb": 9.0},
             "dvc_repro": {"wall_s": 2.0, "peak_tree_rss_mb": 9.0, "written_mb": 1.0,
                           "exit_code": 0}, "outputs_mb": 0.0}
    record = {"meta": {**meta, "command": meta["command"] + " --resume", "commit": "def5678"},
              "results": {"stages": [stage], "earlier_parts": [
                  {**meta, "wall_s": 10.0, "stages": ["metadata", "dedupe"]}]}}
    text = render_results.rehearsal(record)
    assert "Earlier part: _`python benchmarks/rehearsal.py --images 240` at abc1234" in text
    assert "Its stages: metadata, dedupe." in text and "| `register` |" in text


def test_the_profile_and_the_sizes_are_valid_params_of_every_section_they_set(tmp_path):
    from clipms.runtime import RuntimeConfig
    from ops.preflight import apply_overrides
    from pipeline.params import read_params, validate_section
    from stages.download import DownloadParams
    from stages.metadata import MetadataParams
    from stages.tokenizer import TokenizerParams
    from stages.train import TrainParams

    schemas = {"metadata": MetadataParams, "download": DownloadParams, "runtime": RuntimeConfig,
               "tokenizer": TokenizerParams, "train": TrainParams}
    found = rehearsal.overrides(rehearsal.parse_args(["--workdir", str(tmp_path)]), 8123)
    params = apply_overrides(read_params(PROJECT_ROOT / "params.yaml"), found)
    for section in {key.split(".")[0] for key in found}:
        validate_section(section, schemas[section], params[section])  # raises on a bad value
    assert params["metadata"]["num_images"] - params["metadata"]["synthetic_val_images"] == 118_287


@pytest.mark.slow
@pytest.mark.timeout(COMMAND_TIMEOUT_S + 120)
def test_the_rehearsal_command_runs_every_stage_at_a_few_hundred_images(tmp_path):
    small_model = {k: v for k, v in TINY_PARAMS.items() if k.split(".")[0] in (
        "train", "tokenizer", "evaluate", "export", "runtime") and k != "tokenizer.context_length"}
    sets = [f"--set={k}={json.dumps(v)}" for k, v in small_model.items()]
    out, log = tmp_path / "rehearsal.json", tmp_path / "rehearsal.log"
    proc = processes.spawn([sys.executable, "benchmarks/rehearsal.py", "--images", "240",
                            "--train-steps", "3", "--workdir", str(tmp_path / "work"), "--out",
                            str(out), *sets], log, cwd=PROJECT_ROOT, env=tool_env())
    try:
        code = proc.wait(timeout=COMMAND_TIMEOUT_S)
    finally:
        processes.stop(proc, timeout=60)  # SIGTERM: it stops its stage and image server
    assert code == 0, processes.tail(log, 6000)
    recorded = json.loads(out.read_text())  # benchmarks/record.py's envelope
    assert recorded["benchmark"] == "rehearsal-240" and recorded["meta"]["load_avg"]["end"]
    assert "WORKDIR" in recorded["meta"]["command"] and str(tmp_path) not in recorded["meta"][
        "command"]
    result = recorded["results"]
    dvc_stages = list(yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"])
    assert [s["stage"] for s in result["stages"]] == dvc_stages and "failed" not in result
    for stage in result["stages"]:
        own, whole = stage["command"], stage["dvc_repro"]
        assert own["exit_code"] == whole["exit_code"] == 0, stage
        assert 0 < own["wall_s"] <= whole["wall_s"] and 0 < own["cpu_s"] <= whole["cpu_s"]
        assert own["peak_rss_mb"] > 50, stage
    by_stage = {s["stage"]: s for s in result["stages"]}
    val = result["val_images"]
    assert val == rehearsal.default_val_images(240) == 10
    assert result["world"]["val_images"] == val and result["world"]["train_images"] == 230
    assert by_stage["download"]["items"] == by_stage["index"]["items"] == 240  # over HTTP
    assert by_stage["download"]["image_server_cpu_s"] > 0
    assert by_stage["evaluate"]["items"] == val and by_stage["evaluate"]["captions"] >= 4 * val
    assert 9.5 < result["world"]["caption_words"]["mean"] < 11.5
    assert by_stage["train"]["steps"] == 3
    assert not (tmp_path / "work" / "clone").exists()  # deleted without --keep


def _stage(name: str, exit_code: int = 0) -> dict:
    return {"stage": name, "dvc_repro": {"exit_code": exit_code}}


def test_a_resumed_run_skips_only_the_leading_stages_recorded_and_up_to_date():
    stages = ["metadata", "dedupe", "download", "shard", "train"]
    recorded = [_stage("metadata"), _stage("dedupe"), _stage("download", 1), _stage("train")]
    assert rehearsal.stages_to_skip(stages, recorded, set()) == {"metadata", "dedupe"}
    # dedupe's dvc.lock entry is out of date: it and everything after it run again
    assert rehearsal.stages_to_skip(stages, recorded, {"dedupe"}) == {"metadata"}
    # a stage that finished but whose figures were never written (the run stopped in between)
    assert rehearsal.stages_to_skip(stages, [_stage("dedupe")], set()) == set()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stopped_rehearsal_is_finished_by_resume_in_its_kept_clone(tmp_path):
    """The first stages, then `--resume` after a change that makes `dedupe` out of date:
    `metadata` is not run again and keeps its figures, `dedupe` and `download` run and are
    merged into the same record, and the clone stays."""
    work, out = tmp_path / "work", tmp_path / "rehearsal.json"
    base = [sys.executable, "benchmarks/rehearsal.py", "--images", "240", "--workdir", str(work),
            "--out", str(out)]

    def run(*extra: str) -> dict:
        log = tmp_path / "rehearsal.log"
        proc = processes.spawn([*base, *extra], log, cwd=PROJECT_ROOT, env=tool_env())
        try:
            assert proc.wait(timeout=400) == 0, processes.tail(log, 6000)
        finally:
            processes.stop(proc, timeout=60)
        return json.loads(out.read_text())

    first = run("--until", "dedupe", "--keep")
    assert [s["stage"] for s in first["results"]["stages"]] == ["metadata", "dedupe"]
    clone = work / "clone"
    metadata_clock = (work / "clock" / "metadata.json").stat().st_mtime_ns
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["dedupe"]["min_caption_chars"] += 1
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    second = run("--resume", "--until", "download")
    stages = second["results"]["stages"]
    assert [s["stage"] for s in stages] == ["metadata", "dedupe", "download"]
    assert stages[0] == first["results"]["stages"][0]  # kept as recorded, not run again
    assert (work / "clock" / "metadata.json").stat().st_mtime_ns == metadata_clock
    assert stages[1] != first["results"]["stages"][1] and stages[1]["dvc_repro"][
        "exit_code"] == 0
    assert stages[2]["items"] == 240 and stages[2]["image_server_cpu_s"] > 0  # same port
    part = second["results"]["earlier_parts"]
    assert [p["stages"] for p in part] == [["metadata", "dedupe"]]
    assert part[0]["started_utc"] == first["meta"]["started_utc"]
    assert "--resume" in second["meta"]["command"] and clone.is_dir()
    assert second["results"]["wall_s"] > first["results"]["wall_s"]


@pytest.mark.slow  # exports a tiny bundle
def test_the_search_benchmark_measures_recall_against_an_exact_copy_of_an_hnsw_index(tmp_path):
    """At MSCOCO size `index.search: auto` makes the rehearsal's index HNSW: compared with
    itself as "exact", HNSW's recall would read 1.0 whatever it finds."""
    pytest.importorskip("faiss")
    from benchmarks import rehearsal_search
    from clipms.deploy.infer import Encoder
    from clipms.deploy.search import SearchOptions
    from clipms.deploy.searchindex import ImageIndex, Item, build_index, bundle_digest
    from harness.tiny_model import export_tiny_bundle, jpeg_bytes, random_images

    bundle = export_tiny_bundle(tmp_path / "bundle")
    items = [Item(f"k{i:03d}", jpeg_bytes(image), f"caption {i}", "val")
             for i, image in enumerate(random_images(80, seed=3, size=(48, 40)))]
    build_index(Encoder(bundle, batch_size=16, kernel_fusion=False), items, tmp_path / "index",
                bundle_digest(bundle), SearchOptions(kind="hnsw"))
    folders, builds = rehearsal_search.build_variants(tmp_path / "index", tmp_path / "work")
    assert folders["exact"] != tmp_path / "index" and set(builds) == {"exact", "hnsw", "ivf"}
    assert {kind: ImageIndex.load(folder).meta["search"]["kind"]
            for kind, folder in folders.items()} == {"exact": "exact", "hnsw": "hnsw",
                                                     "ivf": "ivf"}
    assert builds["exact"]["faiss_index_mb"] == 0.0 and builds["exact"]["exit_code"] == 0


def test_the_scaling_docs_tables_are_the_recorded_rehearsals():
    """docs/scaling.md's measured tables have one owner: the result files, through
    `rehearsal.py table` (a rerun that changes a figure fails here until the docs are redone)."""
    doc = (PROJECT_ROOT / "docs" / "scaling.md").read_text()
    found = re.search(r"<!-- rehearsal.py table: (?P<names>[\w .-]+) -->\n(?P<body>.*?)\n"
                      r"<!-- /rehearsal.py table -->", doc, re.DOTALL)
    assert found, "docs/scaling.md: the rehearsal's tables between their markers"
    results = PROJECT_ROOT / "benchmarks" / "results"
    paths = [results / f"{name}.json" for name in found["names"].split()]
    assert len(paths) >= 2 and all(p.is_file() for p in paths), paths
    assert found["body"].strip() == rehearsal.table(paths).strip(), (
        "python benchmarks/rehearsal.py table " + " ".join(map(str, paths)))
