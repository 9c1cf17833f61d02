"""`clip-pipeline`: the DVC pipeline as a Prefect flow, one task per stage, in dependency order.

The flow orchestrates and does no ML: each task is `dvc repro --single-item <stage>`, so DVC decides
whether a stage is stale and the UI shows every stage with its own state, duration and logs. Stages
run one at a time (DVC is not safe to run in parallel) and whole runs never overlap on one workspace
(a global concurrency limit keyed by the workspace path).

Parameters (all optional):
  stages     only these stages (pipeline order kept), default all
  force      rerun the selected stages even if DVC says they are up to date
  refresh    stages forced every run (the nightly deployment refreshes `metadata`; when its output
             hash is unchanged DVC skips everything downstream)
  overrides  {"train.epochs": 3}: params applied with DVC's `-S` code path in a private worktree
             of the checkout (flows/worktree.py: the checkout's files are never written), saved
             as DVC experiment `clip-<flow run id>`
  dry_run    show what DVC would run (`dvc status`, `dvc repro --dry`), change nothing
  train_without_new_data
             false (the nightly deployment): when no input of `train` under data/ changed since
             the last trained night, train and the stages after it do not run, and one notice
             says so; true (the default for a run a person starts): DVC alone decides

A night that fails puts the workspace back as the last good night left it and sends one notice
naming the stage, the reason and what to do (flows/night.py, flows/notify.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.tasks import exponential_backoff

from clipms.utils.redact import redact_text
from flows import dvc_cli, night, summary, worktree
from flows.notify import notify_failure, notify_night
from registry.prefect_limits import ensure_one_slot_limit

ARTIFACT_KEY = "clip-pipeline-summary"
NIGHT_ARTIFACT_KEY = "clip-night"  # the night's page (registry/nightlog.py)
# Network-bound stages get retries with exponential backoff (10 s, 20 s, 40 s, +-50% jitter).
# Every other stage fails fast: training resumes from its own checkpoint on the next run instead.
NETWORK_RETRIES = {"metadata": 3, "download": 3}
RETRY_BACKOFF_SECONDS = float(os.environ.get("CLIPMS_RETRY_BACKOFF_SECONDS", "10"))
LOCK_LIMIT_PREFIX = "clip-pipeline-workspace"
LOCK_TIMEOUT_SECONDS = float(os.environ.get("CLIPMS_LOCK_TIMEOUT_SECONDS", str(6 * 3600)))
# The lock's lease is renewed while the run lives; a crashed worker's slot frees itself this long
# after the crash (Prefect's default, 300 s, would block the next run for five minutes).
LOCK_LEASE_SECONDS = float(os.environ.get("CLIPMS_LOCK_LEASE_SECONDS", "60"))


def _logger() -> Any:
    """The Prefect run logger inside a run; a plain logger when `.fn` is called directly."""
    try:
        return get_run_logger()
    except Exception:  # MissingContextError outside a run (e.g. unit tests of `.fn`)
        import logging

        return logging.getLogger("clipms.flows")


def _retry_unless_config_error(task: Any, task_run: Any, state: Any) -> bool:
    """Retry transient failures only: a params validation error fails at once."""
    error = state.result(raise_on_failure=False)
    return not (isinstance(error, dvc_cli.DvcError) and error.is_config_error)


@task(name="plan", cache_policy=NO_CACHE)
def plan_stages(workdir: Path, stages: list[str] | None) -> list[str]:
    """The stages to run, in the order DVC would run them (read from dvc.yaml, never hard-coded)."""
    order = dvc_cli.select(dvc_cli.stage_order(workdir), stages)
    _logger().info("pipeline order: %s", " -> ".join(order))
    return order


@task(name="dvc-status", cache_policy=NO_CACHE)
def stale_stages(workdir: Path) -> list[str]:
    """Stages `dvc status` reports as changed before anything runs."""
    changed = dvc_cli.changed_stages(workdir)
    _logger().info("dvc status: %s", ", ".join(changed) if changed else "everything up to date")
    return list(changed)


@task(name="stage", task_run_name="{stage}", cache_policy=NO_CACHE)
def run_stage(workdir: Path, stage: str, force: bool = False, known_up_to_date: bool = False,
              tracking_uri: str | None = None) -> dict[str, Any]:
    """One DVC stage: `dvc repro --single-item [--force] <stage>`, its output streamed to the log.

    `known_up_to_date` is set when `dvc status` found the stage clean and nothing upstream changed
    in this run: then there is nothing to ask DVC, and the task records the skip at no cost.
    `tracking_uri` (a run in a private workspace) keeps MLflow on the checkout's own store.
    """
    logger = _logger()
    if known_up_to_date and not force:
        logger.info("stage '%s' is up to date (dvc status), skipping", stage)
        return {"stage": stage, "outcome": "up to date", "seconds": 0.0, "changed": False}
    env = {"MLFLOW_TRACKING_URI": tracking_uri} if tracking_uri else None
    result = dvc_cli.repro_stage(workdir, stage, force=force, on_line=logger.info, env=env)
    outcome = "up to date"
    if result.restored:
        outcome = summary.RESTORED
    elif result.ran:
        # A forced rerun that reproduced the same outputs (the nightly metadata refresh of an
        # unchanged source) changed nothing; a stage DVC itself found stale did real work.
        outcome = "ran (forced), outputs unchanged" if force and not result.changed else "ran"
    logger.info("stage '%s': %s in %.1f s", stage, outcome, result.seconds)
    return {"stage": stage, "outcome": outcome, "seconds": result.seconds,
            "changed": result.changed}


def stage_task(stage: str) -> Any:
    """`run_stage` with the retry policy of this stage."""
    retries = NETWORK_RETRIES.get(stage, 0)
    if not retries:
        return run_stage
    return run_stage.with_options(
        retries=retries, retry_delay_seconds=exponential_backoff(RETRY_BACKOFF_SECONDS),
        retry_jitter_factor=0.5, retry_condition_fn=_retry_unless_config_error)


@task(name="apply-overrides", cache_policy=NO_CACHE)
def apply_overrides(workdir: Path, overrides: dict[str, Any]) -> None:
    """Apply param overrides as `dvc exp run -S` would, to the run's private worktree."""
    dvc_cli.apply_overrides(workdir, overrides)
    _logger().info("params overridden for this run: %s",
                   redact_text(" ".join(dvc_cli.override_args(overrides))))


@task(name="save-experiment", cache_policy=NO_CACHE)
def save_experiment(workdir: Path, name: str) -> str | None:
    """Record the run as DVC experiment `name`; a failure here is reported, not fatal."""
    try:
        dvc_cli.save_experiment(workdir, name)
    except dvc_cli.DvcError as err:
        _logger().warning("could not save DVC experiment '%s': %s", name, err)
        return None
    _logger().info("saved as DVC experiment '%s' (dvc exp show; dvc exp apply %s)", name, name)
    return name


@task(name="dry-run", cache_policy=NO_CACHE)
def preview(workdir: Path, stages: list[str], force: bool) -> summary.RunReport:
    """What DVC would run, without running it."""
    status, text = dvc_cli.dry_run(workdir, stages, force)
    rows = [{"stage": s, "outcome": "would run" if force or s in status else "up to date"}
            for s in stages]
    stale = [r["stage"] for r in rows if r["outcome"] == "would run"]
    headline = "dry run: " + (f"would run {', '.join(stale)}" if stale else summary.UP_TO_DATE)
    notes = ["Stages downstream of a stage that runs also run if its outputs change."]
    return summary.RunReport(headline=headline, stages=rows, notes=notes, details=text)


@task(name="publish-summary", cache_policy=NO_CACHE)
def publish_summary(workdir: Path, report: summary.RunReport, run_name: str) -> str:
    """The markdown artifact (stable key, so the UI shows its history across runs)."""
    markdown = summary.render(report, workdir, run_name)
    create_markdown_artifact(key=ARTIFACT_KEY, markdown=markdown,
                             description=f"clip-pipeline: {report.headline}")
    return markdown


@task(name="night-report", cache_policy=NO_CACHE)
def publish_night(workdir: Path, run_name: str, started: float, headline: str, outcome: str,
                  outcomes: list[dict[str, Any]], diagnosis: night.Diagnosis | None = None,
                  tracking_uri: str | None = None) -> str:
    """The night's page: a markdown artifact, and a run of MLflow's nights experiment (plus the
    training run's copy). Never fails the night: a page that cannot be made is a warning."""
    logger = _logger()
    try:
        from registry import nightlog

        record = nightlog.read_night(workdir, run_name, started, headline, outcome, outcomes,
                                     dataclasses.asdict(diagnosis) if diagnosis else None)
        page = redact_text(nightlog.render(record))
        create_markdown_artifact(key=NIGHT_ARTIFACT_KEY, markdown=page,
                                 description=f"night: {headline}")
    except Exception as err:  # noqa: BLE001 - the night's outcome stands without its page
        logger.warning("the night's page could not be made: %s", redact_text(str(err)))
        return ""
    try:
        from tracking.settings import client

        run_id = nightlog.log_to_mlflow(workdir, record, page, client(tracking_uri))
        logger.info("the night's page is in MLflow run %s (%s)", run_id, nightlog.NIGHTS_EXPERIMENT)
    except Exception as err:  # noqa: BLE001 - e.g. the registry is the outage
        logger.warning("the night's page could not be logged to MLflow: %s",
                       redact_text(str(err))[:500])
    return page


def lock_name(workdir: Path) -> str:
    """The concurrency limit for this workspace: one slot, so runs on it never overlap."""
    digest = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:10]
    return f"{LOCK_LIMIT_PREFIX}-{digest}"


@contextmanager
def workspace_lock(workdir: Path) -> Iterator[None]:
    """Hold the workspace's 1-slot global concurrency limit (created on first use)."""
    from prefect.concurrency.sync import concurrency

    name = lock_name(workdir)
    ensure_one_slot_limit(name)  # race-safe: two workers may start runs on it at once
    _logger().info("waiting for the workspace lock '%s' (%s)", name, workdir)
    with concurrency(name, occupy=1, strict=True, timeout_seconds=LOCK_TIMEOUT_SECONDS,
                     lease_duration=LOCK_LEASE_SECONDS):
        _logger().info("workspace lock acquired")
        yield


@task(name="new-data", cache_policy=NO_CACHE)
def has_new_data(workdir: Path) -> bool:
    """Whether `train` has data it did not train on (`dvc status train`: a changed input under
    data/, or no training yet)."""
    status = dvc_cli.changed_stages(workdir, [night.TRAIN_STAGE])
    found = night.new_data_for_training(status, workdir)
    _logger().info("new data for train: %s", "yes" if found else "no")
    return found


def _run_stages(workdir: Path, order: list[str], force: bool, refresh: set[str],
                outcomes: list[dict[str, Any]], tracking_uri: str | None = None,
                train_without_new_data: bool = True,
                snapshot: night.Snapshot | None = None) -> bool:
    """Run the stages one after another into `outcomes`; the first failure raises, later stages
    do not run. False when the night stopped before train for want of new data."""
    stale = set(stale_stages(workdir))
    upstream_changed = False
    for position, stage in enumerate(order):
        if (stage == night.TRAIN_STAGE and not train_without_new_data and not force
                and not has_new_data(workdir)):
            outcomes += [{"stage": s, "outcome": summary.SKIPPED_NO_DATA, "seconds": 0.0,
                          "changed": False} for s in order[position:]]
            return False
        clean = stage not in stale and not upstream_changed
        outcomes.append({"stage": stage, "outcome": "FAILED", "seconds": 0.0, "changed": False})
        if snapshot is not None:
            snapshot.at_stage(stage)
        began = time.monotonic()
        try:
            outcome = stage_task(stage)(workdir, stage, force=force or stage in refresh,
                                        known_up_to_date=clean, tracking_uri=tracking_uri)
        finally:  # a failed stage's time counts in the night's page too
            outcomes[-1]["seconds"] = time.monotonic() - began
        upstream_changed = upstream_changed or outcome["changed"]
        outcomes[-1] = outcome
    return True


@flow(name="clip-pipeline", on_failure=[notify_failure], on_crashed=[notify_failure])
def clip_pipeline(stages: list[str] | None = None, force: bool = False,
                  refresh: list[str] | None = None, overrides: dict[str, Any] | None = None,
                  dry_run: bool = False, train_without_new_data: bool = True) -> dict[str, Any]:
    """Run the DVC pipeline in the current directory (the deployment's working directory)."""
    from prefect.runtime import flow_run

    workdir = Path.cwd()
    dvc_cli.check_no_interpolation(overrides or {})  # refused before any work starts
    run_name = flow_run.get_name() or "local"
    run_id = flow_run.get_id() or run_name
    order = plan_stages(workdir, stages)
    with workspace_lock(workdir):
        if dry_run:
            report = preview(workdir, order, force)
            publish_summary(workdir, report, run_name)
        elif overrides:
            report = _run_experiment(workdir, order, force, set(refresh or []), overrides,
                                     run_name, f"clip-{run_id}", train_without_new_data)
        else:
            report = _run(workdir, order, force, set(refresh or []), run_name,
                          [f"workspace `{workdir}`"], restore=True,
                          train_without_new_data=train_without_new_data)
    return {"headline": report.headline, "stages": report.stages}


def _run(workdir: Path, order: list[str], force: bool, refresh: set[str], run_name: str,
         notes: list[str], tracking_uri: str | None = None, experiment: str | None = None,
         restore: bool = False, train_without_new_data: bool = True) -> summary.RunReport:
    """Run the stages in `workdir` and publish the summary (a failure too, then raised as
    NightFailed); with `experiment`, save the result as that DVC experiment; with `restore`, a
    failure puts the workspace back as it was before the first stage."""
    outcomes: list[dict[str, Any]] = []
    if restore:
        _after_a_killed_night(workdir)
    snapshot = night.Snapshot.take(workdir, run_name) if restore else None
    started = time.time() - 1.0  # file times are coarser than the clock on some file systems
    try:
        trained = _run_stages(workdir, order, force, refresh, outcomes, tracking_uri,
                              train_without_new_data, snapshot)
        if not trained:
            report = _no_new_data(workdir, outcomes, notes, run_name)
            publish_night(workdir, run_name, started, report.headline, night.NO_NEW_DATA,
                          outcomes, night.no_new_data_diagnosis(), tracking_uri)
            _discard(snapshot)
            return report
        if experiment:
            name = save_experiment(workdir, experiment)
            notes.append(f"DVC experiment `{name}` (reproduce: `dvc exp apply {name}`)" if name
                         else "DVC experiment not saved (see the logs)")
    except Exception as err:
        failed = [o["stage"] for o in outcomes if o["outcome"] == "FAILED"]
        where = f"at stage '{failed[0]}'" if failed else "before the first stage"
        diagnosis = night.diagnose(failed[0] if failed else "plan",
                                   getattr(err, "output", "") or str(err))
        headline = f"failed {where}: {diagnosis.kind}"
        # The page first: it reads tonight's files, which putting the workspace back replaces.
        publish_night(workdir, run_name, started, headline, "failed", outcomes, diagnosis,
                      tracking_uri)
        if snapshot is not None:
            notes.append(_put_back(snapshot))
            snapshot.discard()
        publish_summary(workdir, summary.RunReport(
            headline=headline, stages=outcomes, notes=notes,
            details=f"{diagnosis.text()}\n\n{err}"), run_name)
        raise night.NightFailed(diagnosis, str(err)) from err
    report = summary.RunReport(headline=summary.headline_for(outcomes), stages=outcomes,
                               notes=notes)
    publish_summary(workdir, report, run_name)
    _discard(snapshot)
    publish_night(workdir, run_name, started, report.headline, "completed", outcomes,
                  tracking_uri=tracking_uri)
    return report


def _discard(snapshot: night.Snapshot | None) -> None:
    if snapshot is not None:
        snapshot.discard()


def _after_a_killed_night(workdir: Path) -> None:
    """A night whose process died left its snapshot: put the workspace back as the last good
    night left it, and send the notice that night could not send."""
    found = night.Snapshot.left_behind(workdir)
    if found is None:
        return
    snapshot, manifest = found
    diagnosis = night.killed_night_diagnosis(manifest)
    _logger().warning("%s", diagnosis.text())
    _put_back(snapshot)
    snapshot.discard()
    notify_night(diagnosis, verb="found an earlier night killed")


def _put_back(snapshot: night.Snapshot) -> str:
    """Restore the last good night's outputs; the note says what happened (a failure to restore
    is reported, never hides the night's own failure)."""
    try:
        changed = snapshot.restore(dvc_cli.dvc)
    except Exception as err:  # noqa: BLE001 - the notice must still go out
        _logger().error("could not put the workspace back: %s", err)
        return f"the workspace could NOT be put back: {redact_text(str(err))}"
    _logger().info("workspace put back as the last good night left it (%d files)", len(changed))
    return "the workspace was put back as the last good night left it"


def _no_new_data(workdir: Path, outcomes: list[dict[str, Any]], notes: list[str],
                 run_name: str) -> summary.RunReport:
    """The night that found nothing to train on: its summary, and its one notice."""
    diagnosis = night.no_new_data_diagnosis()
    report = summary.RunReport(headline=f"{night.NO_NEW_DATA}: nothing trained",
                               stages=outcomes, notes=notes, details=diagnosis.text())
    publish_summary(workdir, report, run_name)
    notify_night(diagnosis)
    return report


def _run_experiment(checkout: Path, order: list[str], force: bool, refresh: set[str],
                    overrides: dict[str, Any], run_name: str, name: str,
                    train_without_new_data: bool = True) -> summary.RunReport:
    """A run with param overrides: in a private worktree of the checkout (the checkout's files
    are never written), saved as DVC experiment `name` (the flow run's id)."""
    notes = [f"workspace `{checkout}` (a private copy: overrides never touch its files)",
             f"overrides `{redact_text(' '.join(dvc_cli.override_args(overrides)))}`"]
    with worktree.experiment_workspace(checkout, name, dvc=dvc_cli.dvc) as private:
        apply_overrides(private, overrides)
        return _run(private, order, force, refresh, run_name, notes,
                    tracking_uri=checkout_tracking_uri(checkout), experiment=name,
                    train_without_new_data=train_without_new_data)


def checkout_tracking_uri(checkout: Path) -> str | None:
    """The tracking URI that keeps a private workspace's runs in the checkout's store: its
    `mlflow.db` by default, a relative SQLite path made absolute; None to keep the environment's
    (a server)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return f"sqlite:///{(checkout / 'mlflow.db').resolve()}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{(checkout / uri.removeprefix('sqlite:///')).resolve()}"
    return None
