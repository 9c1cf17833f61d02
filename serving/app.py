"""The HTTP API: the Starlette app, the guard in front of it and its error answers; the routes are
serving/routes.py's.

Starlette, not FastAPI: FastAPI adds parameter injection, response models and a generated OpenAPI
schema with its docs pages. The service uses none of them: it validates each body itself with
pydantic from the raw bytes, after bounding the body's size and shape (serving.routes), answers
its hot path in front of any framework (serving.guard), and documents its API in
docs/serving.md. With those additions off, FastAPI is Starlette plus its own router and request
handling, which cost CPU per request; what the service needs is Starlette's: plain routes,
static files, exception handlers and the lifespan.

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

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from clipms.deploy.inputs import RequestLimits
from serving.errors import HANDLED, error_answer
from serving.guard import Guard
from serving.hosts import HostPolicy
from serving.routes import ROUTES, direct_embeddings
from serving.state import ServiceState

BODY_MARGIN = 65536  # bytes of JSON around the texts and images that --max-bytes counts


def create_app(state: ServiceState, limits: RequestLimits, token: str | None = None,
               lifespan: Any = None, hosts: HostPolicy | None = None) -> Guard:
    """The service's ASGI app: serving.guard's Guard in front of the Starlette app (`.app`).
    `token`: the bearer token every protected request needs (the guard checks it), None for
    none; `hosts`: the Host and Origin names it answers (default: a 127.0.0.1 bind's). POST
    /v1/embeddings, the hot path, is answered by the guard itself
    (serving.routes.direct_embeddings), past Starlette's middleware, router and request objects;
    every other request goes on to Starlette."""
    async def answer(_: Request, err: Exception) -> JSONResponse:
        status, message, headers = error_answer(err)
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    app = Starlette(routes=ROUTES, lifespan=lifespan,
                    exception_handlers=dict.fromkeys(HANDLED, answer))
    app.state.service = state
    app.state.limits = limits
    app.state.auth_required = token is not None
    return Guard(app, state=state, max_body=limits.max_bytes + BODY_MARGIN, token=token,
                 direct={"/v1/embeddings": functools.partial(direct_embeddings, state, limits)},
                 hosts=hosts)
