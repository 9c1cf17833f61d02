"""Unit tests of the pipeline flow's tasks (through `.fn()`) on a toy DVC project in a git repo.

The toy pipeline has the shape that matters to the flow: stages declared out of dependency order,
an independent stage, a stage that fails with a message, a params section per stage.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prefect.states import Failed

from flows import dvc_cli, summary
from flows.notify import failure_notice, post
from flows.pipeline import (
    NETWORK_RETRIES,
    _retry_unless_config_error,
    apply_overrides,
    lock_name,
    plan_stages,
    preview,
    run_stage,
    save_experiment,
    stage_task,
)
from harness.dvc_workspace import run
from harness.prefect_server import WebhookReceiver

PY = sys.executable
TOY_PARAMS = {"first": {"x": 1}, "second": {"y": 2}, "lone": {"z": 3}}
# Declared out of order on purpose: the flow must follow dependencies, not the file.
TOY_STAGES = {
    "third": {"cmd": "cat b.txt > c.txt", "deps": ["b.txt"], "outs": ["c.txt"]},
    "second": {"cmd": f"{PY} -c \"open('b.txt','w').write(open('a.txt').read() + "
                      "'${second.y}')\"",
               "deps": ["a.txt"], "params": ["second"], "outs": ["b.txt"]},
    "first": {"cmd": "echo ${first.x} > a.txt && echo '{\"x\": ${first.x}}' > m.json",
              "params": ["first"], "outs": ["a.txt"], "metrics": [{"m.json": {"cache": False}}]},
    "lone": {"cmd": f"{PY} -c \"import sys; z = ${{lone.z}}; "
                    "sys.exit(f'lone: invalid z = {z}: must be positive') if z < 0 else "
                    "open('lone.txt', 'w').write(str(z))\"",
             "params": ["lone"], "outs": ["lone.txt"]},
}


@pytest.fixture(scope="module")
def toy_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed git + DVC project with the toy pipeline (nothing reproduced yet)."""
    repo = tmp_path_factory.mktemp("toy")
    (repo / "params.yaml").write_text(yaml.safe_dump(TOY_PARAMS, sort_keys=False))
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": TOY_STAGES}, sort_keys=False))
    run(["git", "init", "-q", "-b", "main"], repo)
    run([PY, "-m", "dvc", "init", "-q"], repo)
    _commit(repo, "toy")
    return repo


@pytest.fixture()
def toy(toy_template: Path, tmp_path: Path) -> Path:
    """A fresh copy of the toy project for one test."""
    return Path(shutil.copytree(toy_template, tmp_path / "toy", symlinks=True))


def _commit(repo: Path, message: str) -> None:
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=t@clipms", "-c", "user.name=t", "commit", "-qm", message], repo)


@pytest.mark.slow  # runs dvc in a temporary repository
def test_plan_follows_dependencies_and_keeps_declared_order_for_ties(toy: Path) -> None:
    # ready first: `first` and `lone`; `first` is declared before `lone`, and so on
    assert plan_stages.fn(toy, None) == ["first", "second", "third", "lone"]
    assert plan_stages.fn(toy, ["third", "first"]) == ["first", "third"]


@pytest.mark.slow  # runs dvc in a temporary repository
def test_plan_rejects_unknown_stage_naming_the_pipeline(toy: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['trian'\].*'first'"):
        plan_stages.fn(toy, ["trian"])


def test_topological_order_is_deterministic() -> None:
    rank = {"c": 0, "b": 1, "a": 2, "d": 3}
    order = dvc_cli.topological(["a", "b", "c", "d"], [("a", "b"), ("b", "c")], key=rank.get)
    assert order == ["a", "b", "c", "d"]  # c waits for b waits for a; d comes after ready ones
    with pytest.raises(ValueError, match="cycle"):
        dvc_cli.topological(["a", "b"], [("a", "b"), ("b", "a")], key=rank.get)


@pytest.mark.slow  # runs dvc in a temporary repository
def test_run_stage_runs_then_skips_then_forces(toy: Path) -> None:
    first = run_stage.fn(toy, "first")
    assert (first["outcome"], first["changed"]) == ("ran", True)
    assert (toy / "a.txt").read_text().strip() == "1"
    again = run_stage.fn(toy, "first")
    assert (again["outcome"], again["changed"]) == ("up to date", False)
    forced = run_stage.fn(toy, "first", force=True)
    assert (forced["outcome"], forced["changed"]) == ("ran (forced), outputs unchanged", False)
    assert summary.headline_for([forced]) == summary.UP_TO_DATE  # the nightly refresh case
    # known clean (from `dvc status`): no dvc call at all
    assert run_stage.fn(toy, "second", known_up_to_date=True)["outcome"] == "up to date"
    assert not (toy / "b.txt").exists()


@pytest.mark.slow  # runs dvc in a temporary repository
def test_failing_stage_raises_with_the_stage_own_message(toy: Path) -> None:
    (toy / "params.yaml").write_text(yaml.safe_dump({**TOY_PARAMS, "lone": {"z": -4}}))
    with pytest.raises(dvc_cli.DvcError, match="lone: invalid z = -4: must be positive") as err:
        run_stage.fn(toy, "lone")
    assert not err.value.is_config_error
    assert dvc_cli.DvcError("x", "stages.params.ParamsError: bad").is_config_error
    assert not dvc_cli.DvcError("x", "invalid 'url'").is_config_error


def test_retry_policy_network_stages_only() -> None:
    assert NETWORK_RETRIES == {"metadata": 3, "download": 3}
    assert stage_task("metadata").retries == 3 and stage_task("download").retries == 3
    assert stage_task("train").retries == 0  # training resumes from its checkpoint instead
    assert stage_task("evaluate").retries == 0
    # a transient failure is retried, a params validation error is not
    params_error = "metadata: error: params.yaml: invalid 'metadata' params:\n  metadata.x = 1"
    assert _retry_unless_config_error(None, None, Failed(data=dvc_cli.DvcError("x", "HTTP 503")))
    assert not _retry_unless_config_error(None, None,
                                          Failed(data=dvc_cli.DvcError("x", params_error)))


def test_overrides_use_dvc_set_param_syntax(toy: Path) -> None:
    assert dvc_cli.override_args({"a.b": 3, "a.c": "x y", "a.d": True, "a.e": [1, 2],
                                  "a.f": None, "a.g": "bpe"}) == [
        "a.b=3", 'a.c="x y"', "a.d=true", "a.e=[1,2]", "a.f=null", "a.g=bpe"]
    apply_overrides.fn(toy, {"second.y": 5})
    assert yaml.safe_load((toy / "params.yaml").read_text())["second"] == {"y": 5}
    with pytest.raises(ValueError, match="no section 'secnd'"):
        apply_overrides.fn(toy, {"secnd.y": 1})
    with pytest.raises(ValueError, match="second.nope"):
        apply_overrides.fn(toy, {"second.nope": 1})  # DVC/Hydra refuse new keys without '+'
    assert yaml.safe_load((toy / "params.yaml").read_text())["second"] == {"y": 5}


@pytest.mark.parametrize("value", ["${oc.env:HOME}", "a ${oc.env:SECRET_TOKEN} b",
                                   ["x", "${second.y}"], {"k": "${oc.env:HOME}"}])
def test_an_override_holding_an_interpolation_is_refused(toy: Path, monkeypatch,
                                                          value) -> None:
    """Hydra (DVC's `-S` code) resolves `${oc.env:NAME}` on the worker that runs the flow: an
    override would copy the worker's environment into params.yaml, the logs and the experiment.
    Refused, naming the override and why, and nothing is written."""
    monkeypatch.setenv("SECRET_TOKEN", "tok-from-the-worker")
    before = (toy / "params.yaml").read_text()
    for refuse in (lambda: apply_overrides.fn(toy, {"first.x": value}),
                   lambda: dvc_cli.override_args({"first.x": value})):
        with pytest.raises(ValueError, match=r"override 'first.x' = .*: '\$\{' starts an "
                                             r"interpolation .*give the value itself") as err:
            refuse()
        assert "tok-from-the-worker" not in str(err.value)
    with pytest.raises(ValueError, match="interpolation"):
        apply_overrides.fn(toy, {"${oc.env:HOME}": 1})
    assert (toy / "params.yaml").read_text() == before
    apply_overrides.fn(toy, {"first.x": "$HOME {literal}"})  # no `${`: a plain string
    assert yaml.safe_load((toy / "params.yaml").read_text())["first"]["x"] == "$HOME {literal}"


@pytest.mark.slow  # runs dvc in a temporary repository
def test_experiment_is_saved_and_listed(toy: Path) -> None:
    for stage in ("first", "second", "third", "lone"):
        run_stage.fn(toy, stage)
    run(["git", "add", "dvc.lock", ".gitignore"], toy)  # m.json stays untracked, as in a checkout
    run(["git", "-c", "user.email=t@clipms", "-c", "user.name=t", "commit", "-qm", "lock"], toy)
    apply_overrides.fn(toy, {"first.x": 9})
    run_stage.fn(toy, "first")
    assert save_experiment.fn(toy, "clip-test-run") == "clip-test-run"
    shown = json.loads(run([PY, "-m", "dvc", "exp", "show", "--no-pager", "--json"], toy).stdout)
    [exp] = [e for row in shown for e in row.get("experiments") or []
             if e.get("name") == "clip-test-run"]
    metrics = exp["revs"][0]["data"]["metrics"]["m.json"]["data"]
    assert metrics == {"x": 9}  # the untracked metrics file is part of the experiment


@pytest.mark.slow  # runs dvc in a temporary repository
def test_an_override_run_never_writes_the_checkout(toy: Path) -> None:
    """The overrides, the stages and the experiment happen in a private worktree; the
    user's uncommitted edit is part of it, and an edit made during the run is left alone."""
    from flows.worktree import PREFIX, experiment_workspace

    for stage in ("first", "second", "third", "lone"):
        run_stage.fn(toy, stage)
    with (toy / ".gitignore").open("a") as ignore:  # an uncached output git ignores, like
        ignore.write("/m.json\n")                   # models/checkpoints: linked, not copied
    _commit(toy, "outputs")
    uncommitted = yaml.safe_dump({**TOY_PARAMS, "lone": {"z": 4}})
    (toy / "params.yaml").write_text(uncommitted)
    run(["git", "add", "params.yaml"], toy)  # staged, not committed (as DVC's autostage does)
    before = {p: (toy / p).read_bytes() for p in ("params.yaml", "a.txt", "m.json", "dvc.lock")}
    with experiment_workspace(toy, "clip-0000-run-id", dvc=dvc_cli.dvc) as private:
        assert private != toy and private.parent.name.startswith(PREFIX + "clip-0000-run-id")
        assert (private / "params.yaml").read_bytes() == before["params.yaml"]
        assert (private / "m.json").read_bytes() == before["m.json"]
        assert (private / "m.json").stat().st_ino == (toy / "m.json").stat().st_ino  # linked
        assert dvc_cli.changed_stages(private).keys() == {"lone"}  # only the user's edit
        apply_overrides.fn(private, {"first.x": 9})
        (toy / "params.yaml").write_text("edited: during the run\n")  # the user, meanwhile
        for stage in ("first", "second", "third"):
            run_stage.fn(private, stage)
        assert (private / "a.txt").read_text().strip() == "9"
        assert save_experiment.fn(private, "clip-0000-run-id") == "clip-0000-run-id"
    assert not private.exists()
    assert (toy / "params.yaml").read_text() == "edited: during the run\n"
    assert all((toy / p).read_bytes() == before[p] for p in ("a.txt", "m.json", "dvc.lock"))
    assert run(["git", "worktree", "list"], toy).stdout.count("\n") == 1
    shown = json.loads(run([PY, "-m", "dvc", "exp", "show", "--no-pager", "--json"], toy).stdout)
    [exp] = [e for row in shown for e in row.get("experiments") or []
             if e.get("name") == "clip-0000-run-id"]
    assert exp["revs"][0]["data"]["metrics"]["m.json"]["data"] == {"x": 9}


def test_a_worktree_left_by_a_crashed_run_is_removed(toy: Path, tmp_path: Path) -> None:
    from flows.worktree import PREFIX, remove_stale

    left = tmp_path / f"{PREFIX}clip-crashed-abc" / "workspace"
    run(["git", "worktree", "add", "--detach", str(left), "HEAD"], toy)
    assert remove_stale(toy) == [left]
    assert not left.parent.exists()
    assert run(["git", "worktree", "list"], toy).stdout.count("\n") == 1


@pytest.mark.slow  # runs dvc in a temporary repository
def test_dry_run_reports_stale_stages_without_running(toy: Path) -> None:
    report = preview.fn(toy, ["first", "second", "third", "lone"], force=False)
    assert {s["stage"]: s["outcome"] for s in report.stages}["first"] == "would run"
    assert "Running stage 'first'" in report.details
    assert not (toy / "a.txt").exists() and not (toy / "dvc.lock").exists()


def test_summary_holds_metrics_decision_and_mlflow_run(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "metrics/eval.json").write_text(json.dumps({"i2t_R@5": 0.8125, "count": 16}))
    (tmp_path / "metrics/register.json").write_text(json.dumps(
        {"decision": "challenger", "champion": {"version": 1, "i2t_R@5": 0.9}, "run_id": "abc123"}))
    (tmp_path / "models/mlflow_run.json").write_text("{not json")
    stages = [{"stage": "train", "outcome": "ran", "seconds": 3.0, "changed": True}]
    text = summary.render(summary.RunReport(summary.headline_for(stages), stages), tmp_path, "r1")
    assert text.startswith("# clip-pipeline `r1`: updated train")
    assert "| i2t_R@5 | 0.8125 |" in text and "| champion.i2t_R@5 | 0.9000 |" in text
    assert "| decision | challenger |" in text and "`models/mlflow_run.json` unreadable" in text
    (tmp_path / "models/mlflow_run.json").unlink()
    text = summary.render(summary.RunReport("x", stages), tmp_path)
    assert "run id `abc123`" in text.split("## MLflow run")[1]
    clean = [{"stage": "train", "outcome": "up to date", "seconds": 0.0, "changed": False}]
    assert summary.headline_for(clean) == summary.UP_TO_DATE


def test_failure_notice_is_posted_to_the_webhook() -> None:
    receiver = WebhookReceiver()
    try:
        notice = failure_notice("clip-pipeline", "brave-owl", "1234", "stage 'train' failed")
        assert post(receiver.url, notice) == 204
    finally:
        receiver.stop()
    assert receiver.received[0]["flow_run"] == "brave-owl"
    assert "stage 'train' failed" in receiver.received[0]["text"]


def test_lock_name_is_per_workspace(tmp_path: Path) -> None:
    assert lock_name(tmp_path / "a") != lock_name(tmp_path / "b")
    assert lock_name(tmp_path / "a") == lock_name(tmp_path / "a" / ".." / "a")


def test_flow_module_imports_nothing_heavy() -> None:
    # clipms.utils.redact (stdlib only) is the one library module the flows use (with its package)
    code = ("import sys, flows.pipeline; heavy = {'mindspore', 'mlflow', 'dvc'}"
            " & set(m.split('.')[0] for m in sys.modules); assert not heavy, heavy; "
            "lib = {m for m in sys.modules if m.startswith('clipms')}; "
            "assert lib <= {'clipms', 'clipms.utils', 'clipms.utils.redact'}, lib")
    subprocess.run([PY, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_serve_builds_the_prefect_yaml_deployments() -> None:
    from flows.serve import deployment_specs, to_deployment_kwargs

    root = Path(__file__).resolve().parents[2]
    kwargs = {spec["name"]: to_deployment_kwargs(spec)
              for spec in deployment_specs(root / "prefect.yaml")}
    assert set(kwargs) == {"manual", "nightly"}
    [nightly] = kwargs["nightly"]["schedules"]
    assert (nightly.cron, nightly.timezone) == ("0 2 * * *", "UTC")
    assert kwargs["nightly"]["parameters"] == {"refresh": ["metadata"],
                                               "train_without_new_data": False}
    assert kwargs["manual"]["schedules"] == []


def test_a_diamond_runs_each_stage_after_all_it_needs_ties_by_key() -> None:
    rank = {"right": 0, "left": 1, "prep": 2, "join": 3, "lone": 4}
    edges = [("prep", "left"), ("prep", "right"), ("left", "join"), ("right", "join")]
    order = dvc_cli.topological(["prep", "left", "right", "join", "lone"], edges, key=rank.get)
    assert order == ["prep", "right", "left", "join", "lone"]


def test_a_dependency_cycle_is_named_stage_by_stage() -> None:
    """The error shows the loop itself (upstream -> downstream), not just the stages left over."""
    edges = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
    with pytest.raises(ValueError, match=r"dependency cycle: (a -> b -> c -> a|b -> c -> a -> b|"
                                         r"c -> a -> b -> c)$"):
        dvc_cli.topological(["a", "b", "c", "d"], edges, key=str)
