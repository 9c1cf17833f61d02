"""The HTTP API (FastAPI): the app, its middleware and its error answers; the routes are
serving/routes.py's.

Contract (docs/serving.md):
  POST /v1/embeddings {"texts": [...], "images": [base64, ...]}
       -> {"model": {"name", "version"}, "text_embeddings": [[...]], "image_embeddings": [[...]]}
  POST /v1/search     {"text": "..."} | {"image": base64} | {"key": indexed key}, "k": 10
       -> {"model": {...}, "results": [{"key", "score", "caption", "thumbnail_url"}, ...]}
  POST /v1/rank       {"image": base64, "texts": [...]}
       -> {"model": {...}, "scores": [...], "probabilities": [...]}
  GET  /v1/thumbnails/{key}, /v1/model, /healthz, /readyz, /metrics, / (the search page)
Errors: {"error": "<message>"}, 4xx for client mistakes, 503 when overloaded or not ready, 500
(with no detail) for a fault of the service. Every response carries `X-Model-Version:
<name>/<version>`, and every JSON answer names the model.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from clipms.inputs import InputError, RequestLimits
from clipms.preprocess import PreprocessError
from serving.batcher import Overloaded
from serving.guard import Guard
from serving.routes import ROUTES, ClientError
from serving.state import NotReady, ServiceState

log = logging.getLogger("clipms.serving")
# FastAPI's own OpenTelemetry spans, metrics and logs: the service configures no OpenTelemetry
# provider and has its Prometheus metrics (/metrics), so they would only cost time per request.
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


def create_app(state: ServiceState, limits: RequestLimits, token: str | None = None,
               lifespan: Any = None) -> FastAPI:
    """The service's app; `token`: the bearer token every protected request needs (serving.guard
    checks it), None for none."""
    app = FastAPI(title="clipms search", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan, telemetry=NO_TELEMETRY, routes=ROUTES)
    app.state.service = state
    app.state.limits = limits
    app.state.auth_required = token is not None
    app.add_middleware(Guard, state=state, max_body=limits.max_bytes + 65536, token=token)
    _add_error_handlers(app)
    return app


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


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


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return _error(400, validation_message(list(err.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        return _error(err.status_code, str(err.detail))

    @app.exception_handler(ClientError)
    async def client_error(_: Request, err: ClientError) -> JSONResponse:
        return _error(err.status, str(err))

    @app.exception_handler(InputError)
    @app.exception_handler(PreprocessError)
    async def bad_input(_: Request, err: ValueError) -> JSONResponse:
        return _error(400, str(err))

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, err: Overloaded) -> JSONResponse:
        return _error(503, f"overloaded: {err}; retry later", {"Retry-After": "1"})

    @app.exception_handler(NotReady)
    async def not_ready(_: Request, err: NotReady) -> JSONResponse:
        return _error(503, str(err), {"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception) -> JSONResponse:
        log.error("internal error: %s", err, exc_info=err)
        return _error(500, "internal error (see the service log)")
