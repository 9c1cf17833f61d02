"""A Prefect server alone (no deployment, no worker), for flows run in the caller's process: the
nights of tests/flows/test_pipeline_nights.py, tests/e2e/test_nights.py, benchmarks/nights.py."""

from __future__ import annotations

from pathlib import Path

from harness.dvc_workspace import tool_env
from harness.prefect_server import PrefectStack, WebhookReceiver
from harness.processes import free_port


class PrefectServer(PrefectStack):
    """Only the server of a stack: the flow runs in the test's process against it."""

    @classmethod
    def start(cls, workspace: Path, home: Path) -> PrefectServer:
        stack = cls(workspace=workspace, home=home, api_url=f"http://127.0.0.1:{free_port()}/api",
                    env={}, webhook=WebhookReceiver())
        stack.env = {**tool_env(), "PREFECT_HOME": str(home), "PREFECT_API_URL": stack.api_url,
                     "PREFECT_API_DATABASE_CONNECTION_URL":
                         f"sqlite+aiosqlite:///{home}/prefect.db",
                     "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"}
        try:
            stack.start_server(timeout=120)
        except BaseException:
            stack.stop()
            raise
        return stack
