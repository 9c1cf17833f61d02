"""Registry logic that needs no server: the gate's decisions, param hygiene, lineage, batching, the
compare table, the pyfunc's input decoding. Server-backed tests are in test_registry_server.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.register_workspace import write_pipeline_state
from pipeline import paths
from registry import gate
from registry.compare import VersionRow, differing_params, render
from registry.gate import CHALLENGER, CHAMPION, Candidate, decide
from tracking import journal, lineage, run, settings
from tracking.callback import TrainCallback
from tracking.files import FILES

DIGEST = "a" * 32
LOCK, MANIFEST = paths.LOCK, paths.MANIFEST  # relative: the tests chdir into a workspace


def test_first_version_becomes_champion() -> None:
    d = decide(Candidate("1", 0.5, DIGEST), None, "i2t_R@5", 0.0)
    assert (d.alias, d.compared, d.champion_value) == (CHAMPION, False, None)
    assert "first version" in d.reason


@pytest.mark.parametrize(("new", "champion", "margin", "alias"), [
    (0.40, 0.50, 0.0, CHALLENGER),   # worse
    (0.50, 0.50, 0.0, CHALLENGER),   # a tie never replaces the champion
    (0.51, 0.50, 0.0, CHAMPION),     # strictly better, no margin
    (0.52, 0.50, 0.05, CHALLENGER),  # better, but by less than the margin
    (0.55, 0.50, 0.05, CHAMPION),    # better by exactly the margin
])
def test_gate_compares_on_the_same_val_set(new: float, champion: float, margin: float,
                                           alias: str) -> None:
    d = decide(Candidate("2", new, DIGEST), Candidate("1", champion, DIGEST), "i2t_R@5", margin)
    assert d.alias == alias
    assert d.compared
    assert (d.new_value, d.champion_value, d.champion_version) == (new, champion, "1")
    assert "i2t_R@5" in d.reason


def test_a_different_val_set_is_never_compared() -> None:
    d = decide(Candidate("2", 0.99, "b" * 32), Candidate("1", 0.10, DIGEST), "i2t_R@5", 0.0)
    assert d.alias == CHALLENGER and not d.compared
    assert "different evaluation set" in d.reason and DIGEST in d.reason


@pytest.mark.parametrize(("new", "champion", "alias"), [
    (12.0, 10.0, CHALLENGER),  # a higher mean rank is worse
    (10.0, 10.0, CHALLENGER),  # a tie never replaces the champion
    (8.0, 10.0, CHAMPION),     # lower is better
])
def test_gate_respects_a_lower_is_better_metric(new: float, champion: float, alias: str) -> None:
    d = decide(Candidate("2", new, DIGEST), Candidate("1", champion, DIGEST), "i2t_mean_rank",
               0.0, direction="lower")
    assert (d.alias, d.direction, d.compared) == (alias, "lower", True)
    assert "lower is better" in d.reason


def test_two_missing_val_digests_are_not_the_same_evaluation_set() -> None:
    """A version and a champion that both lack a val digest were evaluated on sets
    nobody can tell apart: never compared, whatever the numbers."""
    d = decide(Candidate("2", 0.9, None), Candidate("1", 0.1, None), "i2t_R@5", 0.0)
    assert (d.alias, d.compared) == (CHALLENGER, False)
    assert "unknown evaluation set" in d.reason
    d = decide(Candidate("2", 0.9, DIGEST), Candidate("1", 0.1, None), "i2t_R@5", 0.0)
    assert (d.alias, d.compared) == (CHALLENGER, False)
    d = decide(Candidate("2", 0.9, ""), Candidate("1", 0.1, ""), "i2t_R@5", 0.0)
    assert (d.alias, d.compared) == (CHALLENGER, False)


@pytest.mark.parametrize(("champion", "needed"), [
    (None, False),                                   # no champion: nothing to compare with
    (Candidate("1", 0.5, DIGEST), False),            # the same set, a value: compare as is
    (Candidate("1", 0.5, "b" * 32), True),           # the data grew: another set
    (Candidate("1", 0.5, None), True),               # registered without a digest
    (Candidate("1", None, DIGEST), True),            # no value for this primary metric
])
def test_a_champion_without_a_value_on_the_new_set_needs_rescoring(
        champion: Candidate | None, needed: bool) -> None:
    assert gate.needs_rescore(Candidate("2", 0.6, DIGEST), champion) is needed
    assert gate.needs_rescore(Candidate("2", 0.6, None), champion) is False  # no set to score on


def test_a_rescored_champion_is_compared_and_the_decision_says_where_each_value_came_from(
        ) -> None:
    old_set = "b" * 32
    source = f"re-scored from models:/clip/1 (its registered MindIR bundle) on evaluation set " \
             f"{DIGEST}"
    champion = gate.rescored(Candidate("1", 0.9, old_set), 0.55, DIGEST, source)
    d = decide(Candidate("2", 0.6, DIGEST, gate.EVALUATED_IN_THIS_RUN), champion, "i2t_R@5",
               0.0, eval_set_name="split val of data/shards")
    assert (d.alias, d.compared, d.champion_value, d.eval_set) == (CHAMPION, True, 0.55, DIGEST)
    assert (d.champion_recorded_value, d.champion_recorded_set) == (0.9, old_set)
    assert (d.new_source, d.champion_source) == ("evaluate stage of this run", source)
    assert d.reason == (
        f"i2t_R@5 0.6 beats champion v1's 0.55 (higher is better) by 0.05 >= margin 0; both on "
        f"evaluation set split val of data/shards {DIGEST}, the champion's value {source} (it "
        f"had 0.9 on {old_set})")
    assert gate.describe(d).startswith("champion (i2t_R@5 0.6): i2t_R@5 0.6 beats")
    same = decide(Candidate("2", 0.5, DIGEST), Candidate("1", 0.55, DIGEST), "i2t_R@5", 0.0)
    assert same.champion_source == "recorded when v1 was registered"
    assert same.champion_recorded_value is None and same.eval_set == DIGEST


def test_a_rescored_champion_carries_the_new_sets_digest_and_the_gate_compares(
        tmp_path: Path) -> None:
    """The champion's value from the re-scoring is labelled with the set it was scored on, the
    new version's (not the champion's own old set): else every night after the data grows ends
    "not compared" and a better model is never promoted."""
    from clipms.eval.scoring import ZeroShotSpec
    from harness.tiny_model import make_val_shards
    from registry.rescore import EvaluationSet, RescoreError, rescored_on

    make_val_shards(tmp_path / "old", n_images=11)
    make_val_shards(shards := tmp_path / "grown", n_images=13)
    old_set = lineage.val_digest(tmp_path / "old" / "manifest.json")
    new_set = lineage.val_digest(shards / "manifest.json")
    assert old_set and new_set and old_set != new_set
    evaluation_set = EvaluationSet(shards, "val", new_set, "split val of data/shards",
                                   ZeroShotSpec(), 4)
    champion = Candidate("1", 0.9, old_set)
    new = Candidate("2", 0.6, new_set, gate.EVALUATED_IN_THIS_RUN)
    assert gate.needs_rescore(new, champion)

    scored = rescored_on("clip", champion, evaluation_set, "i2t_R@5",
                         {"i2t_R@5": 0.55, "num_images": 13})
    assert (scored.version, scored.value, scored.val_digest) == ("1", 0.55, new_set)
    assert scored.recorded == (0.9, old_set) and new_set in scored.source
    assert not gate.needs_rescore(new, scored)
    d = decide(new, scored, "i2t_R@5", 0.0, eval_set_name=evaluation_set.name)
    assert (d.alias, d.compared, d.eval_set, d.champion_value) == (CHAMPION, True, new_set, 0.55)
    with pytest.raises(RescoreError, match="gave no 'i2t_R@5'.*no alias was moved"):
        rescored_on("clip", champion, evaluation_set, "i2t_R@5", {"num_images": 13})


def test_metric_directions_cover_what_evaluate_writes() -> None:
    from clipms.eval.metrics import metric_direction

    written = json.loads((Path(__file__).resolve().parents[2] / "metrics/eval.json").read_text())
    directions = {k: metric_direction(k) for k in written}
    assert directions["i2t_R@5"] == directions["mAP@10"] == directions["zeroshot_top1"] \
        == directions["zeroshot_mean_per_class_recall"] == "higher"
    assert directions["i2t_mean_rank"] == directions["t2i_median_rank"] == "lower"
    assert directions["num_images"] is directions["chance_i2t_R@5"] is None
    assert directions["zeroshot_classes"] is directions["zeroshot_skipped"] is None
    # every number evaluate writes is either a ranked quality metric or a known non-metric
    unranked = {k for k, d in directions.items() if d is None}
    assert all(k.startswith(("chance_", "num_", "zeroshot_")) for k in unranked), unranked
    assert gate.primary_direction("i2t_mean_rank", written) == "lower"
    with pytest.raises(gate.GateError, match="does not rank models"):
        gate.primary_direction("num_images", written)


def test_the_gate_lock_is_beside_a_sqlite_store_and_times_out(tmp_path: Path,
                                                              monkeypatch) -> None:
    from registry import gatelock

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert gatelock.lock_kind(uri) == "file"
    assert gatelock.lock_file(uri, "clip") == tmp_path / ".mlflow.db.gate-clip.lock"
    assert gatelock.lock_kind("http://127.0.0.1:5000") == "machine"
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert gatelock.lock_kind("http://127.0.0.1:5000") == "prefect"
    assert gatelock.lock_kind(uri) == "file"  # a local database is shared through its folder
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom registry.gatelock import gate_lock\n"
        f"with gate_lock({uri!r}, 'clip', 5):\n    print('held', flush=True)\n"
        "    time.sleep(30)\n")], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2])
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(gatelock.GateLockTimeout, match="register.lock_timeout"), \
                gatelock.gate_lock(uri, "clip", 0.5):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with gatelock.gate_lock(uri, "clip", 5) as kind:  # released when its holder died
        assert kind == "file"


def test_a_missing_digest_or_value_is_not_compared() -> None:
    champion = Candidate("1", 0.1, DIGEST)
    assert decide(Candidate("2", 0.9, None), champion, "m", 0.0).compared is False
    assert decide(Candidate("2", None, DIGEST), champion, "m", 0.0).alias == CHALLENGER
    assert decide(Candidate("2", 0.9, DIGEST), Candidate("1", None, DIGEST), "m", 0.0).alias \
        == CHALLENGER


def test_negative_margin_is_an_error() -> None:
    with pytest.raises(ValueError, match="margin"):
        decide(Candidate("2", 0.9, DIGEST), None, "m", -0.1)


def test_the_description_is_the_decision_with_both_numbers_and_the_reason() -> None:
    d = decide(Candidate("2", 0.4, DIGEST), Candidate("1", 0.5, DIGEST), "i2t_R@5", 0.0)
    line = gate.describe(d)
    assert line.startswith("challenger (i2t_R@5 0.4): ") and line.endswith(d.reason)
    assert "0.5" in d.reason and "\n" not in line
    assert gate.decided_alias(line) == CHALLENGER
    first = gate.describe(decide(Candidate("1", 0.7, DIGEST), None, "i2t_R@5", 0.0))
    assert gate.decided_alias(first) == "champion" and "0.7" in first
    assert gate.decided_alias("a description a user wrote") is None


def test_params_are_flattened_and_never_leak_secrets_or_home(monkeypatch) -> None:
    flat = lineage.flatten("train", {"lr": 1e-3, "sizes": [1, 7], "distributed": {"workers": 2}})
    assert flat == {"train.lr": "0.001", "train.sizes": "[1, 7]", "train.distributed.workers": "2"}
    home = str(Path.home())
    safe = lineage.safe_params({
        "metadata.api_key": "abc", "x.password": "p", "x.hf_token": "t",
        "metadata.url": "https://user:pw@example.org/data.parquet",
        "metadata.path": f"{home}/data/meta.parquet", "tokenizer.kind": "bpe",
    })
    assert safe["metadata.api_key"] == safe["x.password"] == safe["x.hf_token"] == "<redacted>"
    assert safe["metadata.url"] == "https://<redacted>@example.org/data.parquet"
    assert safe["metadata.path"] == "~/data/meta.parquet"
    assert safe["tokenizer.kind"] == "bpe"
    presigned = ("https://bucket.s3.amazonaws.com/m.parquet?X-Amz-Credential=AKIA%2F&"
                 "X-Amz-Signature=SIGSECRET")
    assert lineage.safe_params({"metadata.path": presigned})["metadata.path"] \
        == "https://bucket.s3.amazonaws.com/m.parquet?<redacted>"


def test_lineage_reads_git_dvc_lock_and_manifest(tmp_path: Path, monkeypatch) -> None:
    write_pipeline_state(tmp_path)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "dvc.lock"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    tags = lineage.lineage(lineage.read_lock(LOCK), MANIFEST)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert tags["lineage.git_commit"] == tags["mlflow.source.git.commit"] == head
    assert tags["lineage.git_dirty"] == "false"
    assert tags["lineage.data_shards_md5"] == "1" * 32
    assert tags["lineage.tokenizer_md5"] == "3" * 32
    assert tags["lineage.metadata_source"] == "synthetic"
    assert tags["lineage.metadata_md5"] == "2" * 32
    assert len(tags["lineage.val_digest"]) == 32
    # The pipeline's own writes (dvc.lock, its outputs) and a stray note leave the commit clean
    # (they are not the code a run was made from); code and params do not.
    (tmp_path / "dvc.lock").write_text((tmp_path / "dvc.lock").read_text() + "\n# edited\n")
    (tmp_path / "notes.txt").write_text("a note\n")
    assert lineage.lineage(lineage.read_lock(LOCK), MANIFEST)["lineage.git_dirty"] == "false"
    for changed in ("params.yaml", "stages/new_stage.py"):
        (tmp_path / changed).parent.mkdir(exist_ok=True)
        (tmp_path / changed).write_text("x: 1\n")
        assert lineage.lineage(lineage.read_lock(LOCK), MANIFEST)["lineage.git_dirty"] == "true"
        (tmp_path / changed).unlink()
    porcelain = " M dvc.lock\0 M data/parts/manifest.json\0?? data/parts/val/x.tar\0 M a.py\0"
    assert lineage.changed_code_and_params(porcelain, lineage.read_lock(LOCK)) == ["a.py"]
    write_pipeline_state(tmp_path, val_sha="0" * 64)
    again = lineage.lineage(lineage.read_lock(LOCK), MANIFEST)
    assert again["lineage.val_digest"] != tags["lineage.val_digest"]
    dataset = lineage.dataset_record(tags, MANIFEST)
    assert dataset is not None and dataset["digest"] == "1" * 32
    assert json.loads(dataset["profile"]) == {"train": 30, "val": 10}
    combined = lineage.lock_hash(lineage.read_lock(LOCK), "data/parts")
    assert combined is not None and len(combined) == 32 and combined not in ("4" * 32, "5" * 32)
    assert lineage.lock_hash(lineage.read_lock(LOCK), "data/parts/val") == "4" * 32
    assert lineage.lock_hash(lineage.read_lock(LOCK), "data/part") is None
    params = lineage.lock_params(lineage.read_lock(LOCK), lineage.DATA_STAGES)
    assert params["metadata.source"] == "synthetic" and params["tokenizer.vocab_size"] == "400"


def test_metric_names_become_names_mlflow_accepts() -> None:
    assert journal.mlflow_key("i2t_R@5") == "i2t_R_at_5"
    assert journal.mlflow_key("mAP@10") == "mAP_at_10"
    assert journal.mlflow_key("system/cpu usage:1.x-y") == "system/cpu usage:1.x-y"
    assert journal.mlflow_key("a$b") == "a_b"


def test_training_metrics_are_queued_into_one_batch() -> None:
    pipeline_run = run.PipelineRun("key", None, "exp", FILES)
    callback = TrainCallback(pipeline_run, flush_every_s=3600)
    for step in range(1, 51):
        callback.on_step_end(step, {"loss": 1.0 / step, "lr": 1e-3, "bad": float("nan")})
    assert [type(r) for r in pipeline_run.pending] == [journal.LogMetrics]
    assert pipeline_run.queued_metrics() == 100  # the NaN is dropped, never sent
    steps = sorted({row.step for row in pipeline_run.pending[0].metrics})
    assert steps == list(range(1, 51))


def test_compare_shows_only_params_that_differ() -> None:
    rows = [
        VersionRow(1, ["champion"], "r1" * 16,
                   {"metric.i2t_R_at_5": "0.5", "gate.reason": "first"},
                   {"train.lr": "0.001", "train.epochs": "1"}),
        VersionRow(2, ["challenger"], "r2" * 16, {"metric.i2t_R_at_5": "0.25"},
                   {"train.lr": "0.002", "train.epochs": "1"}),
        # as versions are registered now: metrics on the logged model, the decision described
        VersionRow(3, [], "r3" * 16, {}, {"train.lr": "0.002", "train.epochs": "1"},
                   {"i2t_R_at_5": 0.125}, "challenger (i2t_R@5 0.125): does not beat v1"),
    ]
    assert differing_params(rows) == ["train.lr"]
    text = render("clip", rows, ["i2t_R@5"])
    assert "train.lr" in text and "train.epochs" not in text
    assert "0.5000" in text and "0.2500" in text and "champion" in text and "challenger" in text
    assert "v1: first" in text
    assert "0.1250" in text and "v3: challenger (i2t_R@5 0.125): does not beat v1" in text
    v3 = text.splitlines()[5]
    assert v3.startswith("v3") and v3.split()[1] == "-" and v3.split()[-1] == "challenger"


def test_tracking_uri_defaults_to_the_project_database(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert settings.tracking_uri() == "sqlite:///mlflow.db"
    # A queued/--temp `dvc exp run` executes in a temporary copy; DVC_ROOT is the user's repo.
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert settings.tracking_uri() == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert settings.tracking_uri() == "http://127.0.0.1:5000"
    monkeypatch.setenv("DVC_EXP_NAME", "lr-sweep-1")
    assert lineage.dvc_experiment_tags() == {"dvc.exp_name": "lr-sweep-1"}


def test_register_refuses_a_missing_primary_metric_before_touching_mlflow() -> None:
    from registry.registration import register_version
    from tracking.settings import RegisterParams

    pipeline_run = run.PipelineRun("key", None, "exp", FILES)
    with pytest.raises(gate.GateError, match=r"'i2t_R@5' is not in.*allowed: mAP@10 \(higher"):
        register_version(pipeline_run, "models/export", RegisterParams(), {"mAP@10": 0.5})
    assert pipeline_run.pending == []


def test_only_mindir_and_json_files_are_packaged(tmp_path: Path) -> None:
    from registry.pyfunc import BUNDLE_FILES, check_bundle

    with pytest.raises(FileNotFoundError, match="incomplete"):
        check_bundle(tmp_path)
    for name in BUNDLE_FILES:
        (tmp_path / name).write_text("{}")
    assert check_bundle(tmp_path) == tmp_path
    (tmp_path / "extra.pkl").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match=r"extra\.pkl"):
        check_bundle(tmp_path)


def test_registry_imports_nothing_from_stages_or_flows() -> None:
    from harness.packages import imported_roots

    package = Path(__file__).resolve().parents[2] / "registry"
    for module in sorted(package.glob("*.py")):
        assert not imported_roots(module.read_text()) & {"stages", "flows"}, module.name


@pytest.mark.slow  # a process, or a SQLite MLflow store
def test_the_pyfunc_model_code_runs_without_mlflow_warnings() -> None:
    """MLflow runs the model file at every register, load and serve; a warning there is noise the
    user cannot act on."""
    code = ("import warnings, mlflow.pyfunc\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import registry.pyfunc_model\n"
            "print([str(w.message) for w in seen])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow  # a process, or a SQLite MLflow store
def test_system_metrics_are_logged_without_mlflow_info_lines(tmp_path: Path) -> None:
    """Train's system-metrics monitor printed MLflow INFO lines in the middle of every run
    ("Skip logging GPU metrics", started, stopping, terminated): noise the user cannot act on.
    It still samples: system/ metrics reach the run, even one shorter than the sampling
    interval (MLflow's monitor alone would drop that last, unfinished interval), and one
    started while records wait to be sent to a run that exists."""
    code = ("import time\n"
            "from tracking import run, settings\n"
            "from tracking.files import FILES\n"
            "c = settings.client()\n"
            "run_id = c.create_run(settings.ensure_experiment(c, 'quiet')).info.run_id\n"
            "pipeline_run = run.PipelineRun('key', run_id, 'quiet', FILES)\n"
            "pipeline_run.set_tags({'lineage.note': 'queued'})\n"  # as train: tags, then start
            "pipeline_run.start_system_metrics(sampling_interval=30.0)\n"
            "time.sleep(1.0)\n"
            "pipeline_run.stop_system_metrics()\n"
            "print(sorted(k for k in c.get_run(run_id).data.metrics if k.startswith('system/')))\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120, cwd=tmp_path, env=env)
    assert "system/cpu_utilization_percentage" in out.stdout, out.stdout + out.stderr
    noise = [line for line in out.stderr.splitlines() if "mlflow.system_metrics" in line]
    assert noise == [], noise


@pytest.mark.parametrize("before", [None, "true"])
def test_quiet_log_model_leaves_the_environment_as_it_found_it(monkeypatch,
                                                               before: str | None) -> None:
    from registry import registration
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    if before is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, before)
    with registration._quiet_log_model():
        assert os.environ[name] == (before or "false")  # no bar inside, unless the user asked
    assert os.environ.get(name) == before


# ---------------------------------------------------------------- the gate's decision
# Edges `make mutation` (benchmarks/mutation.py) found untested; each docstring names the
# mutants (mutmut's names) the test kills.


def test_a_gain_of_exactly_the_margin_promotes():
    """registry.gate.x_decide__mutmut_107 (>= margin became > margin). 0.75 - 0.5 == 0.25 exactly
    in binary floating point (0.55 - 0.50, as the tests above use, is 0.05000000000000004)."""
    from registry.gate import CHAMPION, Candidate, decide

    d = decide(Candidate("2", 0.75, DIGEST), Candidate("1", 0.5, DIGEST), "i2t_R@5", 0.25)
    assert (d.alias, d.compared, d.margin, d.primary_metric) == (CHAMPION, True, 0.25, "i2t_R@5")
    assert d.reason == ("i2t_R@5 0.75 beats champion v1's 0.5 (higher is better) by 0.25 >= "
                        f"margin 0.25; both on evaluation set {DIGEST}")
    worse = decide(Candidate("2", 12.0, DIGEST), Candidate("1", 10.0, DIGEST), "i2t_mean_rank",
                   0.0, direction="lower")
    assert worse.reason == ("i2t_mean_rank 12 does not beat champion v1's 10 (lower is better) "
                            f"by more than 0 and at least margin 0 (gain -2); both on evaluation "
                            f"set {DIGEST}")


@pytest.mark.parametrize(("new", "champion", "unknown"), [
    (None, DIGEST, "this version"),
    (DIGEST, None, "champion v1"),
    (None, None, "this version and champion v1"),
])
def test_an_unknown_val_set_on_either_side_is_named_and_not_compared(new, champion, unknown):
    """x_decide__mutmut_46 (either -> both unknown: the 'different set' path), _55.._72 (which
    side the reason names), _8/_10 (the decision's fields)."""
    from registry.gate import CHALLENGER, Candidate, decide

    d = decide(Candidate("2", 0.9, new), Candidate("1", 0.1, champion), "i2t_R@5", 0.1)
    assert (d.alias, d.compared) == (CHALLENGER, False)
    assert d.reason == f"not compared: unknown evaluation set (no val digest on {unknown})"
    assert (d.primary_metric, d.margin, d.new_value, d.champion_value) == ("i2t_R@5", 0.1, 0.9,
                                                                            0.1)


def test_missing_values_are_recorded_as_not_compared_with_their_reason():
    """x_decide__mutmut_40/41/45 (no value on the new version), _84/_85/_89 (none on the
    champion), _77 (a different set), _35 (the first version's reason), _5 (direction)."""
    from registry.gate import CHALLENGER, CHAMPION, Candidate, decide

    champion = Candidate("1", 0.5, DIGEST)
    no_value = decide(Candidate("2", None, DIGEST), champion, "i2t_R@5", 0.0)
    assert (no_value.alias, no_value.compared, no_value.reason) == (
        CHALLENGER, False, "this version has no 'i2t_R@5' value")
    no_champion_value = decide(Candidate("2", 0.9, DIGEST), Candidate("1", None, DIGEST),
                               "i2t_R@5", 0.0)
    assert (no_champion_value.compared, no_champion_value.reason) == (
        False, "not compared: champion v1 has no 'i2t_R@5' value")
    other_set = decide(Candidate("2", 0.9, "b" * 32), champion, "i2t_R@5", 0.0)
    assert other_set.compared is False
    first = decide(Candidate("1", 0.9, DIGEST), None, "i2t_R@5", 0.0)
    assert (first.alias, first.reason) == (CHAMPION, "first version: there is no champion yet")
    with pytest.raises(ValueError, match="direction must be 'higher' or 'lower', got 'up'"):
        decide(Candidate("2", 0.9, DIGEST), champion, "i2t_R@5", 0.0, direction="up")


def test_the_recorded_description_names_alias_metric_value_and_reason():
    """describe/decided_alias (they replaced decision_tags, whose mutants 1/3 wrote a missing
    value wrongly): a missing value reads 'none', and the alias reads back from the text."""
    from registry.gate import CHALLENGER, Candidate, decide, decided_alias, describe

    d = decide(Candidate("2", None, DIGEST), Candidate("1", 0.5, DIGEST), "i2t_R@5", 0.0)
    text = describe(d)
    assert text == "challenger (i2t_R@5 none): this version has no 'i2t_R@5' value"
    assert decided_alias(text) == CHALLENGER
    assert decided_alias("champions are made") is None and decided_alias(None) is None


def test_primary_direction_lists_exactly_the_ranking_metrics_allowed():
    """x_primary_direction__mutmut_3/4 (what is allowed), _18/_23 (the message)."""
    from registry.gate import GateError, primary_direction

    metrics = {"i2t_R@5": 0.5, "i2t_mean_rank": 3.0, "num_images": 10, "chance_i2t_R@5": 0.1,
               "zeroshot_top1": True, "mAP@10": "0.4"}
    with pytest.raises(GateError) as err:
        primary_direction("num_images", metrics)
    assert str(err.value) == ("register.primary_metric 'num_images' does not rank models (a count "
                              "or a chance level); allowed: i2t_R@5 (higher is better), "
                              "i2t_mean_rank (lower is better)")
    with pytest.raises(GateError, match="'zeroshot_top1' is not in the evaluation metrics"):
        primary_direction("zeroshot_top1", {"i2t_R@5": 0.5})
    with pytest.raises(GateError, match="allowed: i2t_R@5"):  # a bool is not a metric value
        primary_direction("zeroshot_top1", metrics)


def test_candidate_from_version_reads_the_metric_and_digest_tags():
    """x_candidate_from_version__mutmut_* (no fast test read a version: the gate against a real
    MLflow server is slow). A real MLflow ModelVersion entity, no server."""
    from mlflow.entities.model_registry import ModelVersion, ModelVersionTag

    from registry.gate import Candidate, candidate_from_version

    def version(tags):
        return ModelVersion("clip", 7, 0, tags=[ModelVersionTag(k, v) for k, v in tags.items()])

    tagged = version({"metric.i2t_R_at_5": "0.25", "lineage.val_digest": DIGEST})
    assert candidate_from_version(tagged, "i2t_R@5") == Candidate("7", 0.25, DIGEST)
    assert candidate_from_version(version({"metric.i2t_R_at_5": "", "lineage.val_digest": ""}),
                                  "i2t_R@5") == Candidate("7", None, None)
    assert candidate_from_version(version({}), "i2t_R@5") == Candidate("7", None, None)


@pytest.mark.slow  # a process, or a SQLite MLflow store
def test_a_version_without_the_metric_tag_is_read_from_its_logged_model(tmp_path, monkeypatch):
    """x_candidate_from_version__mutmut_12..21 (the fallback for a version registered while another
    metric was primary: no client, the wrong model, the wrong key, or the tag overwritten). A real
    MLflow SQLite store in tmp_path, the version registered as register_version registers it."""
    from mlflow import MlflowClient

    from registry.gate import Candidate, candidate_from_version
    from registry.registration import link_metrics

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the registry resolves models:/ through it
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.create_experiment("gate", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(experiment).info.run_id
    model = client.create_logged_model(experiment, source_run_id=run_id, name="clip")
    link_metrics(client, run_id, model.model_id, {"i2t_R@5": 0.25, "t2i_R@5": 0.5})
    client.create_registered_model("clip")
    version = client.create_model_version(
        "clip", source=f"models:/{model.model_id}", run_id=run_id,
        tags={"lineage.val_digest": DIGEST, "metric.t2i_R_at_5": "0.75"})  # t2i was primary
    assert candidate_from_version(version, "i2t_R@5", client) == Candidate("1", 0.25, DIGEST)
    # the tag is the gate's input: the logged model's 0.5 does not replace it
    assert candidate_from_version(version, "t2i_R@5", client) == Candidate("1", 0.75, DIGEST)
    assert candidate_from_version(version, "i2t_R@5") == Candidate("1", None, DIGEST)
    assert candidate_from_version(version, "i2t_R@10", client) == Candidate("1", None, DIGEST)
