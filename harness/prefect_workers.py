"""More of the real Prefect stack of harness/prefect_server.py: several named workers on the pool,
or a bare server (for code that only needs a Prefect API, such as the gate's concurrency limit).

`MultiWorkerStack.start(workspace, home, names)` is a `PrefectStack` whose one default worker is
replaced by one `prefect worker start --pool clipms --type process --name NAME --limit 1` per name:
with one flow run at a time per worker, runs submitted together spread over the workers, as they
would over several machines; `stop()` ends every worker. `start_server(home)` starts only
`prefect server start` (SQLite under `home`, loopback, free port); stop it with `.stop()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.dvc_workspace import tool_env
from harness.prefect_server import POOL, PrefectStack, WebhookReceiver
from harness.processes import free_port

WORKER_LIMIT = 1  # flow runs a worker runs at once


class MultiWorkerStack(PrefectStack):
    """A PrefectStack with the workers `names` (the first is `procs["worker"]`, which `wait()`
    watches; the others are `procs["worker-<name>"]`)."""

    worker_names: tuple[str, ...] = ()

    @classmethod
    def start(cls, workspace: Path, home: Path,  # type: ignore[override]
              names: Sequence[str] = ("worker-a", "worker-b")) -> MultiWorkerStack:
        stack = super().start(workspace, home)
        assert isinstance(stack, MultiWorkerStack)
        try:
            stack.procs.pop("worker").stop()  # the default worker: no name, no limit
            stack.worker_names = tuple(names)
            for i, name in enumerate(names):
                stack._start("worker" if i == 0 else f"worker-{name}",
                             ["prefect", "worker", "start", "--pool", POOL, "--type", "process",
                              "--name", name, "--limit", str(WORKER_LIMIT)])
        except BaseException:
            stack.stop()
            raise
        return stack


def start_server(home: Path) -> PrefectStack:
    """A bare Prefect server (no pool, deployment or worker); `.env` points a client at it."""
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = dict(tool_env(), PREFECT_HOME=str(home), PREFECT_API_URL=api_url,
               PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
    stack = PrefectStack(workspace=home, home=home, api_url=api_url, env=env,
                         webhook=WebhookReceiver())
    try:
        stack.start_server(timeout=120)
    except BaseException:
        stack.stop()
        raise
    return stack
