"""The lock the promotion gate holds while it reads the champion and moves an alias.

Two registrations racing against one registry must not both compare against the same old champion
(the slower one would then overwrite a better model's alias). The gate therefore re-reads the
champion and moves the alias under one lock per registered model, held where the registry is
shared:

- a local SQLite store: an exclusive `flock` (the `filelock` package) on a file beside the
  database, so every process on the machine that writes to that database (any checkout, any
  worker) waits its turn;
- a remote tracking server with a Prefect API configured (`PREFECT_API_URL`, as on every Prefect
  worker): a Prefect global concurrency limit of one slot named after the model
  (`mlflow-gate-<model>`), which serialises registrations from every machine of the deployment; its
  lease expires if the holder dies, so a crashed registration never blocks the next one;
- a remote server without Prefect: a machine-wide `flock` (registrations from other machines are
  not serialised; the stage says so).
"""

# tested by: tests/registry/test_gate.py

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from registry.prefect_limits import ensure_one_slot_limit
from tracking.settings import sqlite_path

LIMIT_PREFIX = "mlflow-gate-"


class GateLockTimeout(TimeoutError):
    """Another registration held the gate's lock for longer than the timeout."""


def lock_kind(tracking_uri: str) -> str:
    """"file" (a local SQLite store), "prefect" (remote, a Prefect API configured), "machine"."""
    if sqlite_path(tracking_uri) is not None:
        return "file"
    return "prefect" if prefect_api_url() else "machine"


def prefect_api_url() -> str | None:
    """The Prefect API this process would talk to (environment or Prefect profile), if any."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    try:
        from prefect.settings import PREFECT_API_URL
    except ImportError:
        return None
    return PREFECT_API_URL.value() or None


def lock_file(tracking_uri: str, model_name: str) -> Path:
    """The lock file of a file lock: beside the SQLite database, else machine-wide."""
    db = sqlite_path(tracking_uri)
    if db is not None:
        return db.resolve().parent / f".{db.name}.gate-{model_name}.lock"
    key = hashlib.sha256(model_name.encode()).hexdigest()[:16]  # model names may hold any char
    folder = Path(os.environ.get("CLIPMS_LOCK_DIR") or Path(tempfile.gettempdir()) / "clipms-locks")
    return folder / f"gate-{key}.lock"


@contextmanager
def gate_lock(tracking_uri: str, model_name: str, timeout_s: float) -> Iterator[str]:
    """Hold the gate's lock for `model_name`; yields its kind (see `lock_kind`)."""
    kind = lock_kind(tracking_uri)
    if kind == "prefect":
        with _prefect_lock(LIMIT_PREFIX + model_name, timeout_s):
            yield kind
        return
    path = lock_file(tracking_uri, model_name)
    if kind == "machine":
        print(f"register: the tracking server is remote and no Prefect API is configured: the "
              f"gate's lock ({path}) serialises registrations on this machine only; set "
              "PREFECT_API_URL to serialise them across machines", file=sys.stderr)
    with _file_lock(path, timeout_s):
        yield kind


@contextmanager
def _file_lock(path: Path, timeout_s: float) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    # filelock's UnixFileLock is an flock, released by the kernel when its holder dies. No soft
    # fallback: on a filesystem without flock a soft lock (a marker file) would outlive a crashed
    # registration and block every later one; failing there is the safe answer.
    lock = FileLock(path, timeout=timeout_s, fallback_to_soft=False)
    try:
        lock.acquire()
    except Timeout:
        raise GateLockTimeout(
            f"another registration held the gate's lock {path} for more than {timeout_s:g} s "
            "(register.lock_timeout); no alias was moved") from None
    try:
        yield
    finally:
        lock.release()


@contextmanager
def _prefect_lock(name: str, timeout_s: float) -> Iterator[None]:
    from prefect.concurrency.sync import concurrency

    ensure_one_slot_limit(name)
    acquired = False
    try:
        with concurrency(name, occupy=1, strict=True, timeout_seconds=timeout_s):
            acquired = True
            yield
    except TimeoutError as err:
        if acquired:  # raised by the gate itself, not by the wait for the slot
            raise
        raise GateLockTimeout(f"another registration held the Prefect concurrency limit "
                              f"'{name}' for more than {timeout_s:g} s (register.lock_timeout); "
                              "no alias was moved") from err
