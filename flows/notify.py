"""Failure notices for the pipeline flow: always logged, and POSTed to a webhook when one is set.

The webhook URL is a setting: the `CLIPMS_FAILURE_WEBHOOK` environment variable of the worker (or
serve process), else the Prefect Variable `clipms_failure_webhook`; neither set means log only.
Its path is usually its secret (Slack/Teams/Mattermost), so it is logged by host only, and the
notice's message has its URLs redacted (`clipms.utils.redact`).
The body is JSON with a `text` field, which Slack/Teams/Mattermost incoming webhooks accept.
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


def failure_notice(flow_name: str, run_name: str, run_id: str, message: str) -> dict[str, Any]:
    """The notice as a JSON-able dict: who failed, where to look, and the error message."""
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    url = f"{ui.rstrip('/')}/runs/flow-run/{run_id}" if ui else None
    message = redact_text(message)  # an error may quote a URL with its token
    text = f"Prefect flow run {flow_name}/{run_name} failed: {message}"
    return {"text": text + (f"\n{url}" if url else ""), "flow": flow_name, "flow_run": run_name,
            "flow_run_id": run_id, "message": message, "url": url}


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
    notice = failure_notice(flow.name, flow_run.name, str(flow_run.id), state.message or state.name)
    logger.error("FAILURE NOTICE: %s", notice["text"])
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
