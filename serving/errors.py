"""What an error answers: one mapping from an exception to (status, message, headers), used by the
Starlette app's exception handlers (serving.app) and by the direct /v1/embeddings path
(serving.routes.direct_embeddings), so both answer a mistake with the same status and words.

4xx for client mistakes, 503 when overloaded or not ready, 500 with no detail (logged with its
stack) for a fault of the service: no answer carries a stack trace or a path of the service.
"""

# tested by: tests/serving/test_routes.py

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException

from clipms.data.preprocess import PreprocessError
from clipms.deploy.inputs import InputError
from serving.batcher import Overloaded
from serving.state import NotReady

log = logging.getLogger("clipms.serving")
INTERNAL = "internal error (see the service log)"


class ClientError(ValueError):
    """A mistake in a request that no limit or parser names (e.g. nothing to embed, a missing
    key); `status`: 400 unless said otherwise."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class InvalidBody(ClientError):
    """A body that is not JSON, or not what the endpoint takes: pydantic's errors in one line."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(validation_message(errors))


def validation_message(errors: list[dict[str, Any]]) -> str:
    """One line from pydantic's errors: where and what, at most five of them."""
    problems = []
    for e in errors[:5]:
        if e["type"] == "json_invalid":
            problems.append("the request body is not valid JSON")
            continue
        where = "/".join(str(p) for p in e["loc"] if p != "body") or "request body"
        problems.append(f"{where}: {e['msg']}")
    return "; ".join(problems) or "invalid request body"


def error_answer(err: Exception) -> tuple[int, str, dict[str, str]]:
    """(HTTP status, message, extra headers) of `err`; an unexpected error is logged here."""
    if isinstance(err, HTTPException):
        return err.status_code, str(err.detail), {}
    if isinstance(err, ClientError):
        return err.status, str(err), {}
    if isinstance(err, InputError | PreprocessError):
        return 400, str(err), {}
    if isinstance(err, Overloaded):
        return 503, f"overloaded: {err}; retry later", {"Retry-After": "1"}
    if isinstance(err, NotReady):
        return 503, str(err), {"Retry-After": "5"}
    log.error("internal error: %s", err, exc_info=err)
    return 500, INTERNAL, {}


# The exceptions error_answer() tells apart (the app registers a handler for each).
HANDLED = (HTTPException, ClientError, InputError, PreprocessError, Overloaded, NotReady,
           Exception)
