"""A real PostgreSQL server for tests, from the `pgserver` wheel's binaries (the `postgres` extra).

`PostgresServer().start()` runs `initdb` in a fresh temporary folder, starts `postgres` listening on
127.0.0.1 only (a free port; its Unix socket in the same folder, not /var/run), waits (bounded)
until it accepts connections and creates the database. TCP clients must give the password
(scram-sha-256), as on a production server; the password is never in a URL or a command line:
clients read it from a libpq password file (`PGPASSFILE`, `client_env()`), which psycopg (libpq)
and psql read by themselves; `.stop()` always ends it (SIGINT = "fast shutdown", then SIGKILL) and
`.remove()` deletes the folder. `restart()` lets a test take the database away and back (the shape
of every test server: harness.processes.ServerProcess). Only
pgserver's binaries are used, not its `get_server()`, which listens on a
Unix socket only and, as root, adds a system user and widens permissions up the path.

PostgreSQL refuses to run as root. When the tests run as root (as CI does here), initdb and postgres
run as the unprivileged `nobody` user, so the data folder is made outside pytest's tmp_path (which
is private to root) and given to that user.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import processes
from harness.mlflow_server import MlflowServer
from harness.processes import free_port

STARTUP_TIMEOUT_S = 60.0
UNPRIVILEGED_USER = "nobody"  # who runs PostgreSQL when the tests run as root


def bin_dir() -> Path:
    """The PostgreSQL binaries shipped in the pgserver wheel (found without importing pgserver,
    whose import sets up lock files and process bookkeeping we do not use)."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pgserver is not installed: `pip install -e '.[postgres]'` (make env)")
    return Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"


class PostgresServer(processes.ServerProcess):
    """One `postgres` process with its data folder, on 127.0.0.1:`port`, password auth over TCP."""

    what = "postgres"
    startup_timeout_s = STARTUP_TIMEOUT_S
    poll_interval_s = 0.3
    stop_signal = signal.SIGINT  # "fast shutdown": roll back open transactions, end sessions
    stop_timeout_s = 30.0

    def __init__(self, database: str = "mlflow", port: int | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="clipms-postgres-"))
        super().__init__(self.root / "postgres.log")
        self.data = self.root / "data"
        self.database = database
        self.port = port or free_port()
        self.password = secrets.token_urlsafe(18)
        self.passfile = self.root / "client.pgpass"  # the clients' (root's) copy, mode 0600
        self.passfile.write_text(f"127.0.0.1:{self.port}:*:postgres:{self.password}\n")
        self.passfile.chmod(0o600)  # libpq ignores a password file others can read
        self._run_as: dict[str, object] = {}
        if os.geteuid() == 0:
            user = pwd.getpwnam(UNPRIVILEGED_USER)
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def url(self, driver: str = "postgresql") -> str:
        """The SQLAlchemy URL of the database (SQLAlchemy 2.1 reads `postgresql://` with psycopg 3),
        without the password (`client_env()` supplies it)."""
        return f"{driver}://postgres@127.0.0.1:{self.port}/{self.database}"

    def client_env(self) -> dict[str, str]:
        """What a client process needs to log in: the password file, no password itself."""
        return {"PGPASSFILE": str(self.passfile)}

    def _owner(self) -> tuple[int, int]:
        if not self._run_as:
            return os.getuid(), os.getgid()
        return int(self._run_as["user"]), int(self._run_as["group"])  # type: ignore[call-overload]

    def _tool(self, name: str, *args: str, timeout: float = 120) -> str:
        proc = subprocess.run([str(bin_dir() / name), *args], capture_output=True, text=True,
                              timeout=timeout, cwd=self.root, **self._run_as)  # type: ignore[arg-type]
        if proc.returncode != 0:
            raise RuntimeError(f"{name} {' '.join(args)} exited {proc.returncode}:\n"
                               f"{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def prepare(self) -> None:
        """initdb, the first time only (a restart keeps the data)."""
        if (self.data / "PG_VERSION").exists():
            return
        # The superuser's password, for initdb only (a file postgres' user can read, removed).
        pwfile = self.root / "initdb.pw"
        pwfile.write_text(self.password + "\n")
        shutil.chown(pwfile, *self._owner())
        try:
            # TCP (every client here) needs the password; the Unix socket in our private folder
            # stays trust, as initdb's default.
            self._tool("initdb", "-D", str(self.data), "-U", "postgres", "--encoding=UTF8",
                       "--no-sync", "--auth-local=trust", "--auth-host=scram-sha-256",
                       f"--pwfile={pwfile}")
        finally:
            pwfile.unlink(missing_ok=True)

    def command(self) -> list[str]:
        # -h: TCP on loopback only; -k: the Unix socket in our own folder. fsync off: the data is
        # thrown away, and the machine is shared (a stop is still a clean shutdown).
        return [str(bin_dir() / "postgres"), "-D", str(self.data), "-h", "127.0.0.1",
                "-p", str(self.port), "-k", str(self.root), "-c", "fsync=off",
                "-c", "max_connections=50"]

    def popen_options(self) -> dict[str, Any]:
        return {"cwd": self.root, **self._run_as}

    def ready(self) -> bool:
        ready = subprocess.run([str(bin_dir() / "pg_isready"), "-h", "127.0.0.1", "-p",
                                str(self.port), "-U", "postgres", "-t", "2"],
                               capture_output=True, timeout=30,
                               env={**os.environ, **self.client_env()})
        return ready.returncode == 0

    def on_ready(self) -> None:
        """Create the database (a restart finds it there)."""
        exists = self.sql(f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'",
                          database="postgres")
        if not exists.strip():
            self.sql(f'CREATE DATABASE "{self.database}"', database="postgres")

    def sql(self, query: str, database: str | None = None) -> str:
        """Run `query` with psql; its rows as `a|b` lines (no header)."""
        proc = subprocess.run(
            [str(bin_dir() / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
             "-d", database or self.database, "-tA", "-v", "ON_ERROR_STOP=1", "-w", "-c", query],
            capture_output=True, text=True, timeout=60, env={**os.environ, **self.client_env()})
        if proc.returncode != 0:
            raise RuntimeError(f"psql {query!r} exited {proc.returncode}: {proc.stderr}")
        return proc.stdout

    def remove(self) -> None:
        """Stop, then delete the data folder."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class MlflowOnPostgres(MlflowServer):
    """`mlflow server` with its tracking and registry store in `postgres` and its artifacts
    proxied (`--serve-artifacts`): clients see only `mlflow-artifacts:` URIs, never the folder
    (a stand-in for an S3/MinIO bucket) that `--artifacts-destination` names."""

    def __init__(self, root: Path, postgres: PostgresServer) -> None:
        super().__init__(root)
        self.postgres = postgres

    def environment(self) -> dict[str, str]:
        return self.postgres.client_env()  # the database password: a file, not the command line

    def command(self) -> list[str]:
        mlflow = str(Path(sys.executable).parent / "mlflow")
        return [
            mlflow, "server",
            "--backend-store-uri", self.postgres.url(),
            "--artifacts-destination", str(self.artifacts), "--serve-artifacts",
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]
