"""The markdown summary a pipeline run publishes: stage outcomes, metrics, gate decision, MLflow.

It only reads files the stages wrote (metrics/changes.json, metrics/eval.json,
metrics/register.json, models/mlflow_run.json); each may be missing (stage not in the pipeline
yet, or not run) or malformed, and the summary says so instead of failing the run.
"""

# tested by: tests/flows/test_deploy.py

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clipms.utils.redact import redact_text

DATA_CHANGES = Path("metrics/changes.json")
EVAL_METRICS = Path("metrics/eval.json")
REGISTER_DECISION = Path("metrics/register.json")
MLFLOW_RUN = Path("models/mlflow_run.json")
UP_TO_DATE = "up to date"
RESTORED = "restored from the run cache"
SKIPPED_NO_DATA = "skipped: no new data"


@dataclass
class RunReport:
    """What one flow run did, in the words of the summary."""

    headline: str
    stages: list[dict[str, Any]] = field(default_factory=list)  # stage, outcome, seconds
    notes: list[str] = field(default_factory=list)
    details: str = ""                                          # e.g. dry-run output


def headline_for(stages: list[dict[str, Any]]) -> str:
    """"up to date" when no stage had work to do (forced reruns that reproduced the same outputs
    do not count), else the stages that ran or were restored from DVC's run cache."""
    changed = [s["stage"] for s in stages if s["outcome"] in ("ran", RESTORED)]
    return UP_TO_DATE if not changed else "updated " + ", ".join(changed)


def read_json(workdir: Path, rel: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(data, None) or (None, why it is unavailable)."""
    path = workdir / rel
    if not path.is_file():
        return None, f"`{rel}` not produced"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"`{rel}` unreadable: {err}"
    if not isinstance(data, dict):
        return None, f"`{rel}` is not a JSON object"
    return data, None


def render(report: RunReport, workdir: Path, run_name: str = "") -> str:
    """The whole markdown document."""
    parts = [f"# clip-pipeline{f' `{run_name}`' if run_name else ''}: {report.headline}", ""]
    parts += [f"- {note}" for note in report.notes]
    parts += ["", "## Stages", "", "| stage | outcome | seconds |", "|---|---|---:|"]
    parts += [f"| {s['stage']} | {s['outcome']} | {s.get('seconds', 0):.1f} |"
              for s in report.stages]
    if report.details:
        parts += ["", "```", report.details.strip(), "```"]
    parts += _section("Data changes", workdir, DATA_CHANGES, _change_rows)
    parts += _section("Evaluation metrics", workdir, EVAL_METRICS, _metric_rows)
    parts += _section("Registry decision", workdir, REGISTER_DECISION, _flat_rows)
    parts += _mlflow_section(workdir)
    return redact_text("\n".join(parts) + "\n")  # URLs from metrics or errors: no secrets


def _mlflow_section(workdir: Path) -> list[str]:
    """The run train opened (models/mlflow_run.json), else the run id the register stage used."""
    if (workdir / MLFLOW_RUN).is_file():
        return _section("MLflow run", workdir, MLFLOW_RUN, _flat_rows)
    decision, _ = read_json(workdir, REGISTER_DECISION)
    if decision and decision.get("run_id"):
        return ["", "## MLflow run", "", f"run id `{decision['run_id']}` "
                f"(from `{REGISTER_DECISION}`; `{MLFLOW_RUN}` not produced)"]
    return _section("MLflow run", workdir, MLFLOW_RUN, _flat_rows)


def _section(title: str, workdir: Path, rel: Path, rows: Any) -> list[str]:
    data, problem = read_json(workdir, rel)
    lines = ["", f"## {title}", ""]
    if data is None:
        return [*lines, f"_{problem}_"]
    return [*lines, f"From `{rel}`:", "", "| key | value |", "|---|---|", *rows(data)]


def _change_rows(data: dict[str, Any]) -> list[str]:
    """The data-change report in a few rows: what is new, what did not arrive, what failed."""
    get = _getter(data)
    baseline = ("first run: everything is new" if get("baseline.first_run") is True
                else f"the last accepted run ({get('baseline.images')} images)")
    failures = data.get("failures")
    checks = ("; ".join(map(str, failures)) or "passed") if isinstance(failures, list) else "?"
    cells = [
        ("compared with", baseline),
        ("images new / removed / total",
         f"{get('images.new')} / {get('images.removed')} / {get('images.total')}"),
        ("kept images whose captions changed", get("images.captions_changed")),
        ("caption rows new (empty) / removed",
         f"{get('rows.new')} ({get('rows.new_empty')}) / {get('rows.removed')}"),
        ("new images failed / refused",
         f"{get('download.new_failed')} / {get('download.new_refused')} of "
         f"{get('download.new')}"),
        ("new captions' words without a token",
         f"{_fmt(get('tokens.new_unknown_word_share'))} (kept captions: "
         f"{_fmt(get('tokens.kept_unknown_word_share'))})"),
        ("image short side, median new / kept",
         f"{_fmt(get('image_size.new_short_side_p50'))} / "
         f"{_fmt(get('image_size.kept_short_side_p50'))}"),
        ("schema", "; ".join(map(str, get("schema.changed") or [])) or "unchanged"),
        ("checks", checks),
    ]
    return [f"| {name} | {_fmt(value)} |" for name, value in cells]


def _getter(data: dict[str, Any]) -> Any:
    """`get("a.b")`: data["a"]["b"], or "?" when the report lacks it."""
    def get(dotted: str) -> Any:
        node: Any = data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return "?"
            node = node[part]
        return node
    return get


def _metric_rows(data: dict[str, Any]) -> list[str]:
    return [f"| {k} | {_fmt(v)} |" for k, v in data.items() if not isinstance(v, dict | list)]


def _flat_rows(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Nested keys flattened (champion.value); URLs become links."""
    rows: list[str] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += _flat_rows(value, prefix=f"{name}.")
        else:
            rows.append(f"| {name} | {_fmt(value)} |")
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return f"[{value}]({value})"
    return str(value).replace("|", "\\|")
