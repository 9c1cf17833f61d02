"""One page per night, and the list of the last nights (`python -m registry nights`).

The page is read in a minute: what came in (rows, new images, what was dropped and why, what was
fetched), how training went (steps, time, skipped steps), what the challenger was compared with
(both values, the set, where each came from) and what was decided, what retention added and
freed, and where the night's time went, stage by stage. It is made only from the files the stages
wrote (metrics/*.json) and the flow's stage outcomes; a file a stage did not write tonight (the
stage was up to date, or did not get that far) is named as such, never shown as tonight's.

The same text goes to the Prefect UI (a markdown artifact, flows/pipeline.py) and to MLflow: a run
per night in the `clip-nights` experiment (tags and metrics for the list, the page as
`night.md`), and the page again in the night's training run when there is one.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NIGHTS_EXPERIMENT = "clip-nights"
PAGE_ARTIFACT = "night.md"
# The stage files a page is made of (the stages own their paths: pipeline/paths.py names the same).
FILES = {
    "dedupe": Path("metrics/dedupe.json"),
    "download": Path("metrics/download.json"),
    "changes": Path("metrics/changes.json"),
    "shard": Path("metrics/shard.json"),
    "train": Path("metrics/train.json"),
    "register": Path("metrics/register.json"),
    "retain": Path("metrics/retain.json"),
}
MLFLOW_RUN = Path("models/mlflow_run.json")


@dataclass
class Night:
    """What one night did: its outcome, its stages, and the stage files it wrote."""

    run: str
    started: float                     # epoch seconds: a file older than this is not tonight's
    headline: str
    outcome: str                       # completed | failed | no new data
    stages: list[dict[str, Any]]       # stage, outcome, seconds
    files: dict[str, dict[str, Any]]   # name in FILES -> its JSON, written tonight
    stale: dict[str, str]              # name in FILES -> why it is not tonight's
    failure: dict[str, str] | None = None  # stage, kind, reason, advice

    @property
    def wall_s(self) -> float:
        return float(sum(float(s.get("seconds") or 0.0) for s in self.stages))


def read_night(workdir: Path, run: str, started: float, headline: str, outcome: str,
               stages: list[dict[str, Any]], failure: dict[str, str] | None = None) -> Night:
    """The night from the files in `workdir` written since `started`."""
    files: dict[str, dict[str, Any]] = {}
    stale: dict[str, str] = {}
    for name, rel in FILES.items():
        path = workdir / rel
        if not path.is_file():
            stale[name] = "not written"
            continue
        if path.stat().st_mtime < started:
            stale[name] = "not written tonight (the stage did not run)"
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            stale[name] = f"unreadable: {err}"
            continue
        if isinstance(data, dict):
            files[name] = data
        else:
            stale[name] = "not a JSON object"
    return Night(run, started, headline, outcome, stages, files, stale, failure)


def facts(night: Night) -> dict[str, Any]:
    """The figures of the night one line of `python -m registry nights` shows (and the benchmark
    records): None where the night has no such figure."""
    changes, download = night.files.get("changes", {}), night.files.get("download", {})
    train, register = night.files.get("train", {}), night.files.get("register", {})
    retain = night.files.get("retain", {})
    return {
        "outcome": night.outcome, "headline": night.headline, "wall_s": round(night.wall_s, 1),
        "images_new": _get(changes, "images.new"), "images_total": _get(changes, "images.total"),
        "fetched": download.get("fetched"), "steps": train.get("steps"),
        "skipped_steps": train.get("skipped_steps"), "train_s": train.get("wall_time_s"),
        "decision": register.get("alias"), "version": register.get("version"),
        "new_value": register.get("new_value"), "champion_value": register.get("champion_value"),
        "bytes_added": _first(retain, "bytes_added", "added_bytes"),
        "bytes_freed": _first(retain, "bytes_freed", "freed_bytes"),
        "failed_stage": (night.failure or {}).get("stage"),
        "failure_kind": (night.failure or {}).get("kind"),
        "stage_seconds": {s["stage"]: round(float(s.get("seconds") or 0.0), 1)
                          for s in night.stages},
    }


def render(night: Night) -> str:
    """The page, in markdown."""
    parts = [f"# Night `{night.run}`: {night.headline}", "",
             f"Started {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(night.started))}; "
             f"{night.wall_s:.0f} s in stages."]
    if night.failure:
        f = night.failure
        parts += ["", f"**Stopped at stage `{f['stage']}`: {f['kind']}.** {f['reason']}", "",
                  f"What to do: {f['advice']}"]
    parts += _data(night) + _training(night) + _decision(night) + _storage(night)
    parts += ["", "## Wall time by stage", "", "| stage | outcome | seconds |", "|---|---|---:|"]
    parts += [f"| {s['stage']} | {s['outcome']} | {float(s.get('seconds') or 0):.1f} |"
              for s in night.stages]
    return "\n".join(parts) + "\n"


def _data(night: Night) -> list[str]:
    lines = ["", "## Data", ""]
    dedupe, changes = night.files.get("dedupe"), night.files.get("changes")
    download, shard = night.files.get("download"), night.files.get("shard")
    if not (dedupe or changes or download or shard):
        return [*lines, "_No data stage wrote its report tonight: nothing new was read._"]
    if dedupe:
        lines.append(f"- rows in: {dedupe.get('rows_in')}, images after dedupe: "
                     f"{dedupe.get('images_out')}")
    if changes:
        lines.append(f"- images new / removed / total: {_get(changes, 'images.new')} / "
                     f"{_get(changes, 'images.removed')} / {_get(changes, 'images.total')}; "
                     f"caption rows new: {_get(changes, 'rows.new')}")
        failures = changes.get("failures") or []
        lines.append("- change checks: " + ("; ".join(map(str, failures)) or "passed"))
    if download:
        lines.append(f"- images fetched: {download.get('fetched')} (reused from earlier nights: "
                     f"{download.get('reused_images')}, failed: "
                     f"{download.get('failed_to_download')})")
    dropped = _why(dedupe, "removed") + _why(shard, "dropped") + _why(download, "failure_reasons")
    lines.append("- dropped, and why: " + (", ".join(dropped) or "nothing"))
    lines += [f"- `{FILES[n]}`: {night.stale[n]}" for n in ("dedupe", "changes", "download")
              if n in night.stale]
    return lines


def _training(night: Night) -> list[str]:
    train = night.files.get("train")
    if not train:
        return ["", "## Training", "", f"_Nothing trained tonight (`{FILES['train']}`: "
                f"{night.stale.get('train', '?')})._"]
    line = (f"- steps: {_fmt(train.get('steps'))}, time: {_fmt(train.get('wall_time_s'))} s, "
            f"final loss: {_fmt(train.get('final_loss'))}")
    skipped = train.get("skipped_steps")
    skipped_line = (f"- skipped steps: {skipped}" if skipped is not None else
                    "- skipped steps: not reported by this trainer")
    if train.get("loss_scale") is not None:
        skipped_line += f", final loss scale: {_fmt(train['loss_scale'])}"
    return ["", "## Training", "", line, skipped_line]


def _decision(night: Night) -> list[str]:
    reg = night.files.get("register")
    if not reg:
        return ["", "## Comparison and decision", "",
                f"_No registration tonight (`{FILES['register']}`: "
                f"{night.stale.get('register', '?')})._"]
    metric = reg.get("primary_metric", "?")
    lines = ["", "## Comparison and decision", "",
             f"- on {reg.get('eval_set_name')} (digest `{reg.get('eval_set')}`), {metric}:",
             f"  - tonight's model: {_fmt(reg.get('new_value'))} ({reg.get('new_source')})"]
    if reg.get("compared"):
        lines.append(f"  - champion v{reg.get('champion_version')}: "
                     f"{_fmt(reg.get('champion_value'))} ({reg.get('champion_source')})")
    lines.append(f"- decision: version {reg.get('version')} is **{reg.get('alias')}** "
                 f"(margin {_fmt(reg.get('margin'))}): {reg.get('reason')}")
    return lines


def _storage(night: Night) -> list[str]:
    retain = night.files.get("retain")
    if not retain:
        return ["", "## Storage", "", f"_No retention report tonight (`{FILES['retain']}`: "
                f"{night.stale.get('retain', '?')})._"]
    rows = [f"- {key}: {_bytes(key, value)}" for key, value in _flat(retain)]
    return ["", "## Storage", "", *rows[:20]]


def _why(data: dict[str, Any] | None, key: str) -> list[str]:
    counts = (data or {}).get(key) or {}
    return [f"{n} {why}" for why, n in counts.items() if isinstance(n, int | float) and n]


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _first(data: dict[str, Any], *keys: str) -> Any:
    return next((data[k] for k in keys if k in data), None)


def _flat(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            rows += _flat(value, f"{prefix}{key}.")
        elif not isinstance(value, list):
            rows.append((f"{prefix}{key}", value))
        else:
            rows.append((f"{prefix}{key}", f"{len(value)} entries"))
    return rows


def _bytes(key: str, value: Any) -> str:
    if "bytes" in key and isinstance(value, int | float):
        return f"{value / 1e6:.1f} MB"
    return _fmt(value)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "?" if value is None else str(value)


def log_to_mlflow(workdir: Path, night: Night, page: str, client: Any = None) -> str:
    """A run in the `clip-nights` experiment with the night's figures and its page; the page
    also goes to tonight's training run, when train ran. Returns the night's run id."""
    from tracking.settings import client as make_client
    from tracking.settings import ensure_experiment

    mlflow = client or make_client()
    experiment = ensure_experiment(mlflow, NIGHTS_EXPERIMENT)
    figures = facts(night)
    tags = {"night.outcome": night.outcome, "night.headline": night.headline[:250],
            "night.figures": json.dumps(figures)[:4000]}
    run = mlflow.create_run(experiment, start_time=int(night.started * 1000), tags=tags,
                            run_name=night.run)
    run_id = run.info.run_id
    for key in ("wall_s", "images_new", "fetched", "steps", "skipped_steps", "bytes_added",
                "bytes_freed"):
        if isinstance(figures.get(key), int | float):
            mlflow.log_metric(run_id, f"night.{key}", float(figures[key]))
    mlflow.log_text(run_id, page, PAGE_ARTIFACT)
    mlflow.set_terminated(run_id, "FAILED" if night.outcome == "failed" else "FINISHED")
    training = _training_run(workdir, night)
    if training:
        mlflow.log_text(training, page, PAGE_ARTIFACT)
    return str(run_id)


def _training_run(workdir: Path, night: Night) -> str | None:
    """The MLflow run train opened tonight (models/mlflow_run.json written since the start)."""
    path = workdir / MLFLOW_RUN
    if "train" not in night.files or not path.is_file() or path.stat().st_mtime < night.started:
        return None
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_nights(client: Any, limit: int = 14) -> list[str]:
    """The last `limit` nights, newest first, one line each."""
    experiment = client.get_experiment_by_name(NIGHTS_EXPERIMENT)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"],
                              max_results=limit)
    return [line(run.info.start_time / 1000, run.info.run_name or run.info.run_id,
                 json.loads(run.data.tags.get("night.figures") or "{}")) for run in runs]


def line(started: float, run: str, figures: dict[str, Any]) -> str:
    """One night in one line: when, which run, what happened, and its main figures."""
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(started))
    outcome = figures.get("outcome", "?")
    if outcome == "failed":
        what = f"FAILED at {figures.get('failed_stage')}: {figures.get('failure_kind')}"
    elif figures.get("decision"):
        version = figures.get("version")
        what = f"v{version} {figures['decision']}" if version else str(figures["decision"])
        if figures.get("champion_value") is not None:
            what += f" ({_fmt(figures.get('new_value'))} vs {_fmt(figures['champion_value'])})"
    else:
        what = outcome if outcome != "completed" else figures.get("headline", "completed")
    parts = [when, run, what, f"new {_fmt(figures.get('images_new'))}",
             f"steps {_fmt(figures.get('steps'))}"]
    if figures.get("skipped_steps"):
        parts.append(f"skipped {figures['skipped_steps']}")
    parts.append(f"{_fmt(figures.get('wall_s'))} s")
    return "  ".join(parts)


def add_command(sub: Any) -> None:
    """`python -m registry nights [--limit N]`."""
    nights = sub.add_parser("nights", help="the last nights, one line each")
    nights.add_argument("--limit", type=int, default=14, help="newest N nights")


def main(args: argparse.Namespace) -> int:
    from tracking.settings import client

    lines = list_nights(client(), args.limit)
    print("\n".join(lines) if lines else f"no nights recorded (experiment {NIGHTS_EXPERIMENT})")
    return 0
