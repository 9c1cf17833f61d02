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
<name>/<version>`, and every JSON answer names the model. The answer to each error is
serving.errors' (error_answer).
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from clipms.deploy.inputs import RequestLimits
from serving.errors import HANDLED, error_answer
from serving.guard import Guard
from serving.routes import ROUTES, direct_embeddings
from serving.state import ServiceState

# FastAPI's own OpenTelemetry spans, metrics and logs: the service configures no OpenTelemetry
# provider and has its Prometheus metrics (/metrics), so they would only cost time per request.
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


def create_app(state: ServiceState, limits: RequestLimits, token: str | None = None,
               lifespan: Any = None) -> Guard:
    """The service's ASGI app: serving.guard's Guard in front of the FastAPI app (`.app`).
    `token`: the bearer token every protected request needs (the guard checks it), None for
    none. POST /v1/embeddings, the hot path, is answered by the guard itself
    (serving.routes.direct_embeddings), past FastAPI's middleware, router and request objects;
    every other request goes on to FastAPI."""
    app = FastAPI(title="clipms search", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan, telemetry=NO_TELEMETRY, routes=ROUTES)
    app.state.service = state
    app.state.limits = limits
    app.state.auth_required = token is not None
    _add_error_handlers(app)
    return Guard(app, state=state, max_body=limits.max_bytes + 65536, token=token,
                 direct={"/v1/embeddings": functools.partial(direct_embeddings, state, limits)})


def _add_error_handlers(app: FastAPI) -> None:
    async def answer(_: Request, err: Exception) -> JSONResponse:
        status, message, headers = error_answer(err)
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    for kind in HANDLED:
        app.add_exception_handler(kind, answer)
