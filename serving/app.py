"""The HTTP API (FastAPI): embeddings, search, rank, thumbnails, health, metrics and the page.

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

import asyncio
import hmac
import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from clipms.inputs import InputError, RequestLimits, image_bytes
from clipms.preprocess import PreprocessError, preprocess_image
from serving.batcher import Overloaded
from serving.engine import Engine
from serving.guard import MODEL_SCOPE_KEY, Guard
from serving.state import NotReady, ServiceState

STATIC = Path(__file__).with_name("static")
MAX_K = 100
log = logging.getLogger("clipms.serving")


class ClientError(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingsBody(Strict):
    texts: list[str] | None = None
    images: list[str] | None = None


class SearchBody(Strict):
    text: str | None = None
    image: str | None = None
    key: str | None = None
    k: int = Field(10, ge=1, le=MAX_K)


class RankBody(Strict):
    image: str
    texts: list[str] = Field(min_length=1)


def create_app(state: ServiceState, limits: RequestLimits, token: str | None = None,
               lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="clipms search", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.service = state
    app.add_middleware(Guard, state=state, max_body=limits.max_bytes + 65536)
    _add_error_handlers(app)
    authorized = _auth(token)

    @app.post("/v1/embeddings", dependencies=[Depends(authorized)])
    async def embeddings(body: EmbeddingsBody, request: Request) -> dict[str, Any]:
        texts, images = body.texts or [], body.images or []
        if not texts and not images:
            raise ClientError("give 'texts' and/or 'images' (base64), at least one item")
        limits.check(texts, images)
        with Using(state, request) as engine:
            arrays = await decode(state, engine, images, "images")
            text_rows, image_rows = await asyncio.gather(engine.text.submit(texts),
                                                         engine.image.submit(arrays))
            return {"model": engine.info.public(),
                    "text_embeddings": np.asarray(text_rows).tolist(),
                    "image_embeddings": np.asarray(image_rows).tolist()}

    @app.post("/v1/search", dependencies=[Depends(authorized)])
    async def search(body: SearchBody, request: Request) -> dict[str, Any]:
        given = [name for name in ("text", "image", "key") if getattr(body, name) is not None]
        if len(given) != 1:
            raise ClientError("give exactly one of 'text', 'image' (base64) or 'key'")
        limits.check([body.text] if body.text is not None else [],
                     [body.image] if body.image is not None else [])
        with Using(state, request) as engine:
            query, skip = await query_vector(state, engine, body)
            found = await asyncio.to_thread(engine.index.search, query, body.k + len(skip))
            results = [{"key": engine.index.keys[row], "score": round(score, 6),
                        "caption": engine.index.captions[row],
                        "thumbnail_url": f"/v1/thumbnails/{quote(engine.index.keys[row])}"}
                       for row, score in found if row not in skip][:body.k]
            return {"model": engine.info.public(), "results": results}

    @app.post("/v1/rank", dependencies=[Depends(authorized)])
    async def rank(body: RankBody, request: Request) -> dict[str, Any]:
        limits.check(body.texts, [body.image])
        with Using(state, request) as engine:
            arrays = await decode(state, engine, [body.image], "image")
            image_rows, text_rows = await asyncio.gather(engine.image.submit(arrays),
                                                         engine.text.submit(body.texts))
            scores = np.asarray(text_rows) @ np.asarray(image_rows[0])
            logits = engine.encoder.logit_scale * scores
            probabilities = np.exp(logits - logits.max())
            probabilities /= probabilities.sum()
            return {"model": engine.info.public(), "scores": scores.round(6).tolist(),
                    "probabilities": probabilities.round(6).tolist()}

    @app.get("/v1/thumbnails/{key}", dependencies=[Depends(authorized)])
    async def thumbnail(key: str, request: Request) -> Response:
        with Using(state, request) as engine:
            data = engine.index.thumbnail(key)
            if data is None:
                raise ClientError("no such key in the index", status=404)
            return Response(data, media_type="image/jpeg",
                            headers={"Cache-Control": "private, max-age=3600"})

    @app.get("/v1/model")
    async def model(request: Request) -> dict[str, Any]:
        with Using(state, request) as engine:
            return {"model": engine.info.public(), **engine.describe(),
                    "auth_required": token is not None}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> dict[str, Any]:
        with Using(state, request) as engine:
            return {"status": "ready", "model": engine.info.public()}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics() -> Response:
        for name in ("text", "image"):
            batcher = getattr(state.engine, name, None) if state.engine else None
            state.metrics.queue_depth.labels(name).set(batcher.depth if batcher else 0)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


class Using:
    """`with Using(state, request) as engine:` the current engine, kept alive until the block
    ends; the response's X-Model-Version names it (serving.guard reads it from the scope)."""

    def __init__(self, state: ServiceState, request: Request) -> None:
        self.engine = state.acquire()
        request.scope[MODEL_SCOPE_KEY] = self.engine.info

    def __enter__(self) -> Engine:
        return self.engine

    def __exit__(self, *exc: object) -> None:
        self.engine.release()


async def decode(state: ServiceState, engine: Engine, images: list[str],
                 field: str) -> list[np.ndarray]:
    """Model-ready arrays of base64 images, decoded in the decode threads."""
    def one(i: int, value: str) -> np.ndarray:
        name = field if field == "image" else f"{field}[{i}]"
        return preprocess_image(image_bytes(value, name), engine.encoder.preprocess, name=name)

    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(loop.run_in_executor(state.decode_pool, one, i, v)
                                       for i, v in enumerate(images))))


async def query_vector(state: ServiceState, engine: Engine,
                       body: SearchBody) -> tuple[np.ndarray, set[int]]:
    """The query's unit vector, and the rows to leave out of its results (the query item)."""
    if body.text is not None:
        return (await engine.text.submit([body.text]))[0], set()
    if body.image is not None:
        arrays = await decode(state, engine, [body.image], "image")
        return (await engine.image.submit(arrays))[0], set()
    row = engine.index.position.get(body.key)
    if row is None:
        raise ClientError("no such key in the index", status=404)
    return engine.index.embeddings[row], {row}  # "more like this": not itself


def _auth(token: str | None) -> Any:
    expected = f"Bearer {token}".encode() if token else None

    async def authorized(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise ClientError("missing or wrong bearer token (Authorization: Bearer <token>)",
                              status=401)

    return authorized


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for e in err.errors()[:5]:
            if e["type"] == "json_invalid":
                problems.append("the request body is not valid JSON")
                continue
            where = "/".join(str(p) for p in e["loc"] if p != "body") or "request body"
            problems.append(f"{where}: {e['msg']}")
        return _error(400, "; ".join(problems) or "invalid request body")

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        return _error(err.status_code, str(err.detail))

    @app.exception_handler(ClientError)
    async def client_error(_: Request, err: ClientError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return _error(err.status, str(err), headers)

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
