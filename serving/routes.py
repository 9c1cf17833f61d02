"""The routes of the service (ROUTES; serving.app builds the Starlette app around them), and
POST /v1/embeddings (`direct_embeddings`), which serving.guard answers itself, in front of the app.

The handlers are plain Starlette routes (`handler(request) -> Response`). Each reads the service
from `request.app.state` (`service`: the ServiceState, `limits`: the RequestLimits,
`auth_required`). A request body's shape is bounded on its bytes first (`check_shape`: at most
as many JSON values as `max_rows` rows can need) and its lists' lengths checked against
`max_rows` (`check_rows`), so no parser or validator ever builds an object or an error per item
of a huge list: pydantic builds one error per bad element, and 2 million of them took seconds of
the event loop. Then the body is parsed and validated in one step by pydantic from the raw bytes
(`model_validate_json`), and JSON answers are written by orjson, which writes numpy arrays
itself: an embedding row goes from the model's float32 array to JSON with no Python float per
value. A float32 is written as the shortest decimal that reads back as the same float32 (`0.1`,
not `0.10000000149011612`).

/v1/embeddings, the hot path, skips pydantic too when it can: `embeddings_body` takes a body that
orjson reads as what EmbeddingsBody plainly allows, and gives any other to pydantic, so what is
accepted, and the 400 of what is not, are EmbeddingsBody's.
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from clipms.data.preprocess import preprocess_image
from clipms.deploy.inputs import InputError, RequestLimits, image_bytes
from serving.engine import Engine
from serving.errors import ClientError, InvalidBody, error_answer
from serving.guard import BODY_SCOPE_KEY, MODEL_SCOPE_KEY, Headers, Scope
from serving.state import ServiceState

STATIC = Path(__file__).with_name("static")
MAX_K = 100


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingsBody(Strict):
    texts: list[str] | None = None
    images: list[str] | None = None
    # "base64": each embedding as the base64 of its little-endian float32 bytes (OpenAI's
    # embeddings API has the same option): a quarter of the size and no float parsing.
    encoding_format: Literal["float", "base64"] = "float"


class SearchBody(Strict):
    text: str | None = None
    image: str | None = None
    key: str | None = None
    k: int = Field(10, ge=1, le=MAX_K)


class RankBody(Strict):
    image: str
    texts: list[str] = Field(min_length=1)


Body = TypeVar("Body", bound=BaseModel)
Parsed = TypeVar("Parsed")


# The JSON values a body may hold beyond one per row: the object, its lists, its other fields.
SHAPE_MARGIN = 16
# The rest of a JSON string after its opening quote: through its closing quote, or to the end of
# a body whose last string never closes. Possessive, so the engine never backtracks and reads each
# byte once however quotes and backslashes fall: the plain pattern, run over a body whose string
# of escaped quotes never closes, read to the end of the body from every one of its quotes
# (quadratic: 8 KB took 0.10 s of the event loop, 16 KB 0.43 s).
STRING_REST = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\Z)', re.DOTALL)
# A body at least this large is bounded and parsed in a worker thread, not on the event loop:
# /healthz and every other connection keep being answered while it is read (a 16 MiB body
# takes tens of milliseconds; the common request, far smaller, is parsed where it is).
OFF_LOOP_BYTES = 64 * 1024


def _separators(data: bytes, start: int = 0, end: int | None = None) -> int:
    """Commas, list and object openers in data[start:end]: one per JSON value, give or take the
    first of each."""
    end = len(data) if end is None else end
    return data.count(b",", start, end) + data.count(b"[", start, end) + data.count(
        b"{", start, end)


@dataclass
class Shape:
    """What `scan_shape` found: separators outside strings, strings, and its own work (calls
    of its byte primitives, bytes they were given: each primitive is linear in its bytes)."""

    separators: int = 0
    strings: int = 0
    calls: int = 0
    examined: int = 0


def scan_shape(body: bytes, most_strings: int) -> Shape:
    """The separators outside JSON strings, in one pass that gives each byte to one primitive
    (find/count between strings, STRING_REST through a string), stopping after `most_strings`
    strings: linear in the body, and at most `most_strings` + 1 steps whatever it holds."""
    shape, pos, end = Shape(), 0, len(body)
    while pos < end:
        quote = body.find(b'"', pos)
        stop = end if quote < 0 else quote
        shape.separators += _separators(body, pos, stop)
        shape.calls, shape.examined = shape.calls + 2, shape.examined + stop - pos
        if quote < 0 or shape.strings == most_strings:
            break
        shape.strings += 1
        rest = STRING_REST.match(body, quote + 1)
        pos = end if rest is None else rest.end()  # None: a lone backslash ends the body
        shape.calls, shape.examined = shape.calls + 1, shape.examined + pos - quote
    return shape


def check_shape(body: bytes, limits: RequestLimits) -> None:
    """InputError when the body holds more JSON values than a request of `max_rows` rows needs,
    decided on the bytes, before a parser builds an object per value (a 16 MiB body of `[]`s is
    5 million lists). Separators counted over the raw bytes bound the values from above (strings
    may hold commas too); only when that bound is passed are the separators outside strings
    counted (`scan_shape`, linear), and a body of more strings than its values could be (a key
    and a value each) refused as it is read."""
    allowed = limits.max_rows + SHAPE_MARGIN
    if _separators(body) <= allowed:
        return
    shape = scan_shape(body, 2 * allowed + 1)
    if shape.strings > 2 * allowed or shape.separators > allowed:
        raise InputError(f"the request body holds more JSON values than a request of at most "
                         f"{limits.max_rows} rows can (the limit on rows per request)")


def check_rows(data: Any, limits: RequestLimits) -> None:
    """InputError when the lists of a parsed body hold more than `max_rows` items together, in
    the row limit's own words (RequestLimits.check counts the exact rows after validation)."""
    if type(data) is dict:
        rows = sum(len(value) for value in data.values() if type(value) is list)
        if rows > limits.max_rows:
            raise InputError(f"{rows} rows in one request, over the limit of {limits.max_rows}")


def read_json(body: bytes, limits: RequestLimits) -> Any:
    """The body as orjson reads it (None when it is not JSON), its shape and rows bounded."""
    check_shape(body, limits)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    check_rows(data, limits)
    return data


async def parse(request: Request, model: type[Body]) -> Body:
    """The request body as `model`, bounded (`read_json`), then parsed and checked by pydantic
    in one pass (400 otherwise)."""
    body = request.scope.get(BODY_SCOPE_KEY)  # serving.guard read it
    body = await request.body() if body is None else body
    return await off_loop(body, validated, model, body, request.app.state.limits)


async def off_loop(body: bytes, work: Callable[..., Parsed], *args: Any) -> Parsed:
    """`work(*args)`, which reads `body`: in a worker thread when the body is OFF_LOOP_BYTES or
    more (the event loop goes on answering other requests meanwhile), else here."""
    if len(body) < OFF_LOOP_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def validated(model: type[Body], body: bytes, limits: RequestLimits) -> Body:
    read_json(body, limits)
    return _pydantic(model, body)


def _pydantic(model: type[Body], body: bytes) -> Body:
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        raise InvalidBody(err.errors(include_url=False)) from None


EMBEDDINGS_FIELDS = frozenset(EmbeddingsBody.model_fields)


def _strings(value: Any) -> bool:
    return value is None or (type(value) is list and all(type(v) is str for v in value))


def embeddings_body(body: bytes, limits: RequestLimits) -> tuple[list[str], list[str], str]:
    """(texts, images, encoding_format) of a /v1/embeddings body, bounded (`read_json`). A body
    orjson reads as what EmbeddingsBody plainly allows (an object of those fields only, lists of
    strings, a known format) is taken as it is; any other goes to pydantic, which accepts it as
    EmbeddingsBody would or says what is wrong (400): the same answers, without pydantic on the
    common path."""
    data = read_json(body, limits)
    if type(data) is dict and data.keys() <= EMBEDDINGS_FIELDS and _strings(
            data.get("texts")) and _strings(data.get("images")) and data.get(
            "encoding_format", "float") in ("float", "base64"):
        return data.get("texts") or [], data.get("images") or [], data.get("encoding_format",
                                                                           "float")
    parsed = _pydantic(EmbeddingsBody, body)
    return parsed.texts or [], parsed.images or [], parsed.encoding_format


def _numpy_default(value: Any) -> Any:
    """What orjson does not write itself: a non-contiguous array, a numpy scalar."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, default=_numpy_default, option=orjson.OPT_SERIALIZE_NUMPY)


def json_response(content: Any, status: int = 200) -> Response:
    return Response(dumps(content), status_code=status, media_type="application/json")


def encoded(rows: list[np.ndarray], encoding: str) -> list[Any]:
    if encoding == "float":
        return rows  # orjson writes the float32 rows as they are
    return [base64.b64encode(np.asarray(row, "<f4").tobytes()).decode("ascii") for row in rows]


class Using:
    """`with Using(state, scope) as engine:` the current engine of `state`, kept alive until the
    block ends; the response's X-Model-Version names it (serving.guard reads it from `scope`).
    A route passes its request's (`Using(service(request), request.scope)`), the direct path the
    guard's."""

    def __init__(self, state: ServiceState, scope: Scope) -> None:
        self.engine = state.acquire()
        scope[MODEL_SCOPE_KEY] = self.engine.info

    def __enter__(self) -> Engine:
        return self.engine

    def __exit__(self, *exc: object) -> None:
        self.engine.release()


def service(request: Request) -> ServiceState:
    return request.app.state.service


async def embed(state: ServiceState, limits: RequestLimits, scope: Scope, body: bytes) -> bytes:
    """The JSON answer of a /v1/embeddings body (ClientError, InputError... for a bad one)."""
    texts, images, encoding = await off_loop(body, embeddings_body, body, limits)
    if not texts and not images:
        raise ClientError("give 'texts' and/or 'images' (base64), at least one item")
    limits.check(texts, images)
    with Using(state, scope) as engine:
        if images:
            arrays = await decode(state, engine, images, "images")
            text_rows, image_rows = await asyncio.gather(engine.text.submit(texts),
                                                         engine.image.submit(arrays))
        else:  # the common case, one tower: no tasks to gather
            text_rows, image_rows = await engine.text.submit(texts), []
        return dumps({"model": engine.info.public(),
                      "text_embeddings": encoded(text_rows, encoding),
                      "image_embeddings": encoded(image_rows, encoding)})


async def direct_embeddings(state: ServiceState, limits: RequestLimits, scope: Scope,
                            body: bytes) -> tuple[int, bytes, Headers]:
    """POST /v1/embeddings answered by serving.guard itself (its `direct` handler): the answer,
    or the error's, as the app's exception handlers would give it (serving.errors)."""
    try:
        return 200, await embed(state, limits, scope, body), []
    except Exception as err:
        status, message, headers = error_answer(err)
        return status, orjson.dumps({"error": message}), [
            (name.lower().encode(), value.encode()) for name, value in headers.items()]


async def search(request: Request) -> Response:
    body = await parse(request, SearchBody)
    given = [name for name in ("text", "image", "key") if getattr(body, name) is not None]
    if len(given) != 1:
        raise ClientError("give exactly one of 'text', 'image' (base64) or 'key'")
    request.app.state.limits.check([body.text] if body.text is not None else [],
                                   [body.image] if body.image is not None else [])
    with Using(service(request), request.scope) as engine:
        query, skip = await query_vector(service(request), engine, body)
        found = await asyncio.to_thread(engine.index.search, query, body.k + len(skip))
        index = engine.index
        results = [{"key": index.keys[row], "score": round(float(score), 6),
                    "caption": index.captions[row],
                    "thumbnail_url": f"/v1/thumbnails/{quote(index.keys[row])}"}
                   for row, score in found if row not in skip][:body.k]
        return json_response({"model": engine.info.public(), "results": results})


async def rank(request: Request) -> Response:
    body = await parse(request, RankBody)
    request.app.state.limits.check(body.texts, [body.image])
    with Using(service(request), request.scope) as engine:
        arrays = await decode(service(request), engine, [body.image], "image")
        image_rows, text_rows = await asyncio.gather(engine.image.submit(arrays),
                                                     engine.text.submit(body.texts))
        scores = np.asarray(text_rows) @ np.asarray(image_rows[0])
        probabilities = engine.encoder.match_probabilities(scores)  # softmax, or SigLIP's sigmoid
        return json_response({"model": engine.info.public(), "scores": scores.round(6).tolist(),
                              "probabilities": probabilities.round(6).tolist()})


async def thumbnail(request: Request) -> Response:
    with Using(service(request), request.scope) as engine:
        data = engine.index.thumbnail(request.path_params["key"])
        if data is None:
            raise ClientError("no such key in the index", status=404)
        return Response(data, media_type="image/jpeg",
                        headers={"Cache-Control": "private, max-age=3600"})


async def model(request: Request) -> Response:
    with Using(service(request), request.scope) as engine:
        return json_response({"model": engine.info.public(), **engine.describe(),
                              "auth_required": request.app.state.auth_required})


async def healthz(_: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    with Using(service(request), request.scope) as engine:
        return json_response({"status": "ready", "model": engine.info.public()})


async def metrics(request: Request) -> Response:
    state = service(request)
    for name in ("text", "image"):
        batcher = getattr(state.engine, name, None) if state.engine else None
        state.metrics.queue_depth.labels(name).set(batcher.depth if batcher else 0)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def page(_: Request) -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


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


ROUTES: list[BaseRoute] = [
    Route("/v1/search", search, methods=["POST"]),
    Route("/v1/rank", rank, methods=["POST"]),
    Route("/v1/thumbnails/{key}", thumbnail, methods=["GET"]),
    Route("/v1/model", model, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/", page, methods=["GET"]),
    Mount("/static", StaticFiles(directory=STATIC), name="static"),
]
