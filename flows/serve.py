"""Single-process alternative to a work pool + worker: `python -m flows.serve` from the checkout.

It serves the same deployments as prefect.yaml (`clip-pipeline/manual` and `clip-pipeline/nightly`,
with the same parameters and schedule, read from that file so there is one place to change them)
and runs their flow runs in this process's working directory. Stop it with Ctrl-C (SIGINT); note
that a SIGTERM to a serve process pauses its deployments' schedules.
"""

# tested by: tests/flows/test_deploy.py

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


def pool_deployments(names: list[str]) -> list[str]:
    """Those of `clip-pipeline/<name>` that already exist on a work pool (from flows/deploy.sh).

    Serving over them would keep their work pool and drop their pull step, and their runs would
    crash looking for the flow code; they must be deleted first.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    taken = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                deployment = client.read_deployment_by_name(f"clip-pipeline/{name}")
            except ObjectNotFound:
                continue
            if deployment.work_pool_name:
                taken.append(f"clip-pipeline/{name}")
    return taken


def main() -> None:
    from prefect import serve

    from flows.pipeline import clip_pipeline

    specs = deployment_specs()
    if taken := pool_deployments([spec["name"] for spec in specs]):
        raise SystemExit(
            f"{', '.join(taken)} already deployed to a work pool (flows/deploy.sh); serve "
            "replaces them only after `prefect deployment delete " + " ".join(
                f"'{name}'" for name in taken) + "`")
    serve(*[clip_pipeline.to_deployment(**to_deployment_kwargs(spec)) for spec in specs])


if __name__ == "__main__":
    main()
