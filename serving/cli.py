"""`clipms-serve`: the search service on uvicorn (also `python -m serving`, `make serve`).

    clipms-serve --model models:/clip@champion --follow champion        # the registry's champion
    clipms-serve --model models/export --index models/index             # a local bundle

Binds 127.0.0.1 by default; any other address is refused unless a bearer token is configured
(CLIPMS_SERVE_TOKEN in the environment, or --token-file), because the API has no other protection.
Requests must name the service in `Host` (its bind address, or an --allowed-host name) and come
from its own page when they carry an `Origin` (serving.hosts); connections, request heads and
bodies are bounded in number, size and time (serving.protocol, serving.guard).
"""

# tested by: tests/serving/test_app.py

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import sys
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from clipms.deploy.inputs import RequestLimits
from serving.protocol import ConnectionLimits

TOKEN_VARIABLE = "CLIPMS_SERVE_TOKEN"
log = logging.getLogger("clipms.serving")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    limits, connections = RequestLimits(), ConnectionLimits()
    p = argparse.ArgumentParser(prog="clipms-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="models:/NAME@ALIAS, models:/NAME/VERSION or an export bundle "
                   "folder (default: models:/<params.yaml register.model_name>@champion)")
    p.add_argument("--index", type=Path, help="index folder of a local bundle (default: the "
                   "bundle's sibling 'index' folder; registry models bring their own)")
    p.add_argument("--follow", metavar="ALIAS", help="poll the registry and swap to the version "
                   "this alias points to whenever it moves (e.g. champion)")
    p.add_argument("--poll-s", type=float, default=30.0, help="seconds between registry polls")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, "
                   "else the project's sqlite:///mlflow.db)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token-file", type=Path, help=f"file holding the bearer token (else "
                   f"${TOKEN_VARIABLE}); required to bind a non-loopback address")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a host name clients (or a reverse proxy) use to reach the service, "
                   "accepted in Host and Origin besides the bind address (repeatable)")
    p.add_argument("--max-connections", type=int, default=connections.max_connections,
                   help="open connections; beyond, the longest-idle one is closed (503 when "
                   "none is idle)")
    p.add_argument("--max-header-bytes", type=int, default=connections.max_header_bytes,
                   help="request line + headers (431 beyond)")
    p.add_argument("--header-timeout-s", type=float, default=connections.head_timeout_s,
                   help="seconds for a request line + headers to arrive")
    p.add_argument("--keep-alive-s", type=int, default=connections.keep_alive_s,
                   help="seconds an idle keep-alive connection stays open")
    p.add_argument("--body-timeout-s", type=float, default=connections.body_timeout_s,
                   help="seconds for a request body to arrive (408 beyond)")
    p.add_argument("--send-timeout-s", type=float, default=connections.send_timeout_s,
                   help="seconds a client may take none of its unsent answers before the "
                   "connection is dropped")
    p.add_argument("--max-batch", type=int, default=32, help="items per model call")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="how long a batch waits for more items")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="items waiting per tower before requests get 503")
    p.add_argument("--max-rows", type=int, default=limits.max_rows,
                   help="texts + images per request")
    p.add_argument("--max-bytes", type=int, default=limits.max_bytes,
                   help="bytes of texts and base64 images per request")
    p.add_argument("--device", choices=("CPU", "GPU", "Ascend"), help="MindSpore device (default: "
                   "runtime.device_target of ./params.yaml, whose whole `runtime` section - mode, "
                   "jit_level, kernel_fusion - the service applies; CPU without one)")
    p.add_argument("--cache-dir", type=Path, help="where registry downloads go (default: temp)")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def read_token(args: argparse.Namespace) -> str | None:
    token = args.token_file.read_text().strip() if args.token_file else os.environ.get(
        TOKEN_VARIABLE, "").strip()
    return token or None


def check_bind(host: str, token: str | None) -> None:
    """SystemExit unless `host` is loopback or a token protects the API."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and token is None:
        raise SystemExit(f"clipms-serve: refusing to bind {host!r} without a bearer token: the "
                         f"API would be open to the network. Set {TOKEN_VARIABLE} (or "
                         f"--token-file), or bind 127.0.0.1 behind a reverse proxy.")


def default_model_name() -> str:
    """register.model_name of the project's params.yaml (the name the pipeline registers)."""
    from pipeline.params import PARAMS_FILE, ParamsError
    from tracking.settings import register_params

    try:
        return register_params(PARAMS_FILE).model_name
    except ParamsError:  # not in a project checkout: the pipeline's default name
        from tracking.settings import RegisterParams

        return RegisterParams().model_name


def runtime_config(args: argparse.Namespace) -> Any:
    """The `runtime` section of the project's params.yaml (defaults outside a project checkout),
    with --device over its device_target: the service runs MindSpore as the stages do."""
    from clipms.runtime import RuntimeConfig
    from pipeline.params import PARAMS_FILE, ParamsError, load_section

    try:
        config = load_section("runtime", RuntimeConfig) if PARAMS_FILE.is_file() else \
            RuntimeConfig()
    except ParamsError as err:
        raise SystemExit(f"clipms-serve: {err}") from None
    if args.device:
        config = RuntimeConfig(**{**config.model_dump(), "device_target": args.device})
    return config


def model_source(args: argparse.Namespace) -> tuple[Any, Any]:
    """(fetch() for the first load, the RegistrySource to follow or None)."""
    from serving.source import MODEL_URI, RegistrySource, SourceError, local_model

    if args.model is None:
        args.model = f"models:/{default_model_name()}@champion"
    if not args.model.startswith("models:/"):
        if args.follow:
            raise SystemExit("clipms-serve: --follow needs a registry model (models:/NAME@...)")
        return (lambda: local_model(args.model, args.index)), None
    match = MODEL_URI.match(args.model)
    if match is None:
        raise SystemExit(f"clipms-serve: {args.model!r}: expected models:/NAME@ALIAS or "
                         "models:/NAME/VERSION")
    uri = f"models:/{match['name']}@{args.follow}" if args.follow else args.model
    try:
        source = RegistrySource(uri, args.tracking_uri, args.cache_dir)
    except SourceError as err:
        raise SystemExit(f"clipms-serve: {err}") from None

    def first() -> Any:
        return source.fetch(*source.current())

    return first, source if args.follow else None


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    try:
        limits = ConnectionLimits(args.max_connections, args.max_header_bytes,
                                  args.header_timeout_s, args.keep_alive_s, args.body_timeout_s,
                                  args.send_timeout_s)
    except ValueError as err:
        raise SystemExit(f"clipms-serve: {err}") from None
    bounded = limits.within_open_files()
    if bounded != limits:
        log.warning("--max-connections %d lowered to %d: the process may open only that many "
                    "more files (ulimit -n)", limits.max_connections, bounded.max_connections)
    return bounded


def build(args: argparse.Namespace) -> Any:
    from clipms.runtime import configure
    from serving.app import create_app
    from serving.engine import BatchSettings
    from serving.hosts import HostPolicy
    from serving.prometheus import ServiceMetrics
    from serving.state import ServiceState

    token = read_token(args)
    check_bind(args.host, token)
    limits = RequestLimits(max_rows=args.max_rows, max_bytes=args.max_bytes)
    batching = BatchSettings(args.max_batch, args.max_wait_ms, args.max_queue)
    runtime = runtime_config(args)
    configure(runtime)  # before MindSpore is imported: some of its settings are read at import
    state = ServiceState(batching, ServiceMetrics(), runtime)
    first, follow = model_source(args)

    @asynccontextmanager
    async def lifespan(_app: Any):  # noqa: ANN202
        await state.load(first)  # a model that cannot be loaded stops the start, loudly
        follower = (asyncio.get_running_loop().create_task(state.follow(follow, args.poll_s))
                    if follow is not None else None)
        try:
            yield
        finally:
            if follower is not None:
                follower.cancel()
            await state.close()

    return create_app(state, limits, token, lifespan=lifespan,
                      hosts=HostPolicy.for_bind(args.host, tuple(args.allowed_host)))


def server_config(app: Any, args: argparse.Namespace, limits: ConnectionLimits) -> Any:
    """uvicorn's Config for `app` under `limits`: the bounded httptools protocol
    (serving.protocol), uvicorn's keep-alive timeout, and its limit_concurrency (503 past it) one
    above the protocol's connection bound: the protocol keeps open connections within that
    bound by closing idle ones first, and uvicorn counts idle connections too, so at the bound
    itself it would refuse requests that a closed idle connection made room for."""
    import uvicorn

    from serving.protocol import bounded_protocol

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          access_log=False, timeout_graceful_shutdown=5,
                          http=bounded_protocol(limits), limit_concurrency=limits.max_connections
                          + 1, timeout_keep_alive=limits.keep_alive_s)


def sequential_tokenizer() -> None:
    """Tokenize each batch in the model thread alone (`tokenizers` without its thread pool, unless
    the environment says otherwise): a batch is at most max_batch short texts, less work than
    handing parts of it to other threads and waiting for them, and the pool is sized for the CPUs
    at start, so a service later pinned to fewer CPUs would keep paying for threads it cannot
    run."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    sequential_tokenizer()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    limits = connection_limits(args)
    app = build(args)
    server = uvicorn.Server(server_config(app, args, limits))
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
