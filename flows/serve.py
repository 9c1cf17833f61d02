"""Single-process alternative to a work pool + worker: `python -m flows.serve` from the checkout.

It serves the same deployments as prefect.yaml (`clip-pipeline/manual` and `clip-pipeline/nightly`,
with the same parameters and schedule, read from that file so there is one place to change them)
and runs their flow runs in this process's working directory. Stop it with Ctrl-C (SIGINT); note
that a SIGTERM to a serve process pauses its deployments' schedules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

PREFECT_YAML = Path("prefect.yaml")


def deployment_specs(path: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    """The deployments of prefect.yaml (anchors resolved by the YAML loader)."""
    return list((yaml.safe_load(path.read_text()) or {}).get("deployments") or [])


def to_deployment_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """`Flow.to_deployment` arguments for one prefect.yaml deployment."""
    from prefect.schedules import Cron

    schedules = [Cron(s["cron"], timezone=s.get("timezone") or "UTC", active=s.get("active", True))
                 for s in spec.get("schedules") or []]
    return {"name": spec["name"], "description": spec.get("description"),
            "tags": spec.get("tags") or [], "parameters": spec.get("parameters") or {},
            "schedules": schedules}


def main() -> None:
    from prefect import serve

    from flows.pipeline import clip_pipeline

    deployments = [clip_pipeline.to_deployment(**to_deployment_kwargs(spec))
                   for spec in deployment_specs()]
    serve(*deployments)


if __name__ == "__main__":
    main()
