"""Failure notices for the pipeline flow: always logged, and POSTed to a webhook when one is set.

The webhook URL is a setting: the `CLIPMS_FAILURE_WEBHOOK` environment variable of the worker (or
serve process), else the Prefect Variable `clipms_failure_webhook`; neither set means log only.
Its path is usually its secret (Slack/Teams/Mattermost), so it is logged by host only, and the
notice's message has its URLs redacted (`clipms.utils.redact`).
The body is JSON with a `text` field, which Slack/Teams/Mattermost incoming webhooks accept.

A night sends one notice: a failed night's names the stage, the kind of failure, the reason and
what to do (`stage`, `kind`, `reason`, `advice` fields, from flows/night.py's diagnosis); a night
with no new data says so the same way, from inside the run.
"""

# tested by: tests/flows/test_pipeline.py

from __future__ import annotations

import json
import logging
import os
import urllib.request
from typing import Any

from clipms.utils.redact import host_only, redact_text

WEBHOOK_ENV = "CLIPMS_FAILURE_WEBHOOK"
WEBHOOK_VARIABLE = "clipms_failure_webhook"
TIMEOUT_SECONDS = 10

log = logging.getLogger("clipms.notify")


def webhook_url() -> str | None:
    """The configured webhook, or None (log-only)."""
    if url := os.environ.get(WEBHOOK_ENV, "").strip():
        return url
    try:
        from prefect.variables import Variable

        value = Variable.get(WEBHOOK_VARIABLE, default=None)
    except Exception:  # no API reachable (e.g. a bare unit test): log-only
        return None
    text = str(value).strip() if value else ""
    return text or None


def failure_notice(flow_name: str, run_name: str, run_id: str, message: str,
                   diagnosis: Any = None, verb: str = "failed") -> dict[str, Any]:
    """The notice as a JSON-able dict: who failed, where to look, and the error message; with a
    `diagnosis` (flows.night.Diagnosis) also the stage, the kind, the reason and what to do."""
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    url = f"{ui.rstrip('/')}/runs/flow-run/{run_id}" if ui else None
    message = redact_text(message)  # an error may quote a URL with its token
    text = f"Prefect flow run {flow_name}/{run_name} {verb}: {message}"
    notice = {"text": text + (f"\n{url}" if url else ""), "flow": flow_name,
              "flow_run": run_name, "flow_run_id": run_id, "message": message, "url": url}
    if diagnosis is not None:
        notice.update(stage=diagnosis.stage, kind=diagnosis.kind,
                      reason=redact_text(diagnosis.reason), advice=diagnosis.advice)
    return notice


def post(url: str, payload: dict[str, Any]) -> int:
    """POST the payload as JSON; return the HTTP status."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
        return int(response.status)


def notify_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """on_failure/on_crashed hook. Never raises: a broken webhook must not hide the failure."""
    from prefect.logging.loggers import flow_run_logger

    logger = flow_run_logger(flow_run, flow)
    error = _exception(state)
    diagnosis = getattr(error, "diagnosis", None)  # flows.night.NightFailed
    message = str(error) if diagnosis is not None else state.message or state.name
    notice = failure_notice(flow.name, flow_run.name, str(flow_run.id), message, diagnosis)
    logger.error("FAILURE NOTICE: %s", notice["text"])
    send(notice, logger)


def notify_night(diagnosis: Any, verb: str = "did nothing") -> None:
    """The one notice of a night that did not fail but did nothing (e.g. no new data); sent from
    inside the flow run. Never raises."""
    from prefect.logging import get_run_logger
    from prefect.runtime import flow_run

    logger = get_run_logger()
    notice = failure_notice(flow_run.get_flow_name() or "clip-pipeline",
                            flow_run.get_name() or "local", str(flow_run.get_id()),
                            diagnosis.text(), diagnosis, verb=verb)
    logger.warning("NIGHT NOTICE: %s", notice["text"])
    send(notice, logger)


def _exception(state: Any) -> BaseException | None:
    try:
        result = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - a result that cannot be read: fall back to the message
        return None
    return result if isinstance(result, BaseException) else None


def send(notice: dict[str, Any], logger: Any) -> None:
    """POST the notice to the webhook when one is set. Never raises."""
    url = webhook_url()
    if not url:
        return
    where = host_only(url)  # a webhook URL's path is its secret: logged by host only
    try:
        status = post(url, notice)
        logger.info("failure notice POSTed to the webhook at %s (HTTP %s)", where, status)
    except Exception as err:  # noqa: BLE001 - report and carry on
        reason = redact_text(str(err)).replace(url, where)
        logger.warning("failure webhook at %s did not accept the notice: %s", where, reason)
