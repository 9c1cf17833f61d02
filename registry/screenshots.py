"""Screenshots of the MLflow UI for the docs: the registered model's page (versions, aliases, the
gate's decisions) and the experiment's Models view (the versions' logged models side by side, by
metric columns). Headless Chromium renders the React UI of a running tracking server:

    mlflow server --backend-store-uri sqlite:///mlflow.db --artifacts-destination mlartifacts \\
        --host 127.0.0.1 --port 5000 --workers 1 &
    python -m registry.screenshots --tracking-uri http://127.0.0.1:5000 --out docs/

Each page is first rendered to its DOM and checked for what it must show (the model's name and
its versions' aliases; the versions' logged models and a metric column), so a page that did not
finish rendering fails here instead of ending up in the docs as a blank picture.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from clipms.atomic import atomic_write

# No background networking: this machine (and CI) has no internet, Chromium's attempts would
# only be refused; a new empty profile per page.
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--hide-scrollbars")
RENDER_BUDGET_MS = 20000  # virtual time for the React UI to fetch and render
TIMEOUT_S = 180.0  # wall time for one Chromium run on a loaded machine


class ScreenshotError(RuntimeError):
    """A page did not render what it must show, or Chromium is missing or failed."""


@dataclass(frozen=True)
class Page:
    file: str  # PNG name in the output folder
    url: str
    must_show: tuple[str, ...]  # texts the rendered DOM must contain


def pages(base: str, model: str, experiment_id: str, versions: Sequence[Any],
          aliases: dict[str, list[str]], metric: str) -> list[Page]:
    """The registry page and the experiment's Models view of `versions` (two, usually)."""
    shown = [alias for v in versions for alias in aliases.get(str(v.version), [])]
    return [
        Page("mlflow-registry.png", f"{base}/#/models/{quote(model)}",
             (model, *(f"Version {v.version}" for v in versions), *shown)),
        Page("mlflow-compare.png", f"{base}/#/experiments/{experiment_id}/models",
             (metric, *(str(v.model_id) for v in versions))),
    ]


def chromium(*args: str, window: tuple[int, int], budget_ms: int) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise ScreenshotError("headless Chromium is needed: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="clipms-chromium-") as profile:
        command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                   f"--window-size={window[0]},{window[1]}",
                   f"--virtual-time-budget={budget_ms}", *args]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise ScreenshotError(f"chromium exited {proc.returncode}: {proc.stderr[-1500:]}")
    return proc


def shoot(page: Page, out_dir: Path, window: tuple[int, int], budget_ms: int) -> Path:
    """Check the rendered DOM, then take the screenshot (both after `budget_ms` virtual ms)."""
    dom = chromium("--dump-dom", page.url, window=window, budget_ms=budget_ms).stdout
    missing = [text for text in page.must_show if text not in dom]
    if missing:
        raise ScreenshotError(f"{page.url} did not render {missing} within {budget_ms} ms of "
                              "virtual time (raise --budget-ms, or check the server)")
    out = out_dir / page.file
    with atomic_write(out) as tmp:
        chromium(f"--screenshot={Path(tmp).resolve()}", page.url, window=window,
                 budget_ms=budget_ms)
        if not Path(tmp).exists() or Path(tmp).stat().st_size == 0:
            raise ScreenshotError(f"chromium wrote no screenshot of {page.url}")
    return out


def pick_versions(mlflow_client: Any, model: str, wanted: Sequence[str]) -> list[Any]:
    """The versions asked for, else the champion and the newest other version."""
    if wanted:
        return [mlflow_client.get_model_version(model, v) for v in wanted]
    versions = sorted(mlflow_client.search_model_versions(f"name = '{model}'"),
                      key=lambda v: int(v.version))
    if not versions:
        raise ScreenshotError(f"registered model '{model}' has no versions")
    aliases = mlflow_client.get_registered_model(model).aliases or {}
    champion = aliases.get("champion")
    first = next((v for v in versions if v.version == champion), versions[-1])
    other = [v for v in versions if v.version != first.version][-1:]
    return sorted([first, *other], key=lambda v: int(v.version))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry.screenshots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="http(s) URL of a running MLflow server (its UI is photographed)")
    parser.add_argument("--name", default=None,
                        help="registered model (default: register.model_name in params.yaml)")
    parser.add_argument("--versions", default="",
                        help="comma-separated versions (default: champion + newest other)")
    parser.add_argument("--metric", default=None,
                        help="a metric column the Models view must show (default: the "
                             "primary metric, register.primary_metric)")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--size", default="1600x900", help="window WIDTHxHEIGHT")
    parser.add_argument("--budget-ms", type=int, default=RENDER_BUDGET_MS)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    base = (args.tracking_uri or "").rstrip("/")
    if not base.startswith(("http://", "https://")):
        parser.error(f"--tracking-uri must be the http(s) URL of a running MLflow server "
                     f"(got {args.tracking_uri!r}); for the local store start `mlflow server "
                     "--backend-store-uri sqlite:///mlflow.db ...` first")
    width, height = (int(v) for v in args.size.split("x"))

    from mlflow import MlflowClient

    from registry.journal import mlflow_key
    from registry.settings import RegisterParams, register_params

    defaults = register_params(args.params) if args.params.exists() else RegisterParams()
    name = args.name or defaults.model_name
    metric = mlflow_key(args.metric or defaults.primary_metric)
    client = MlflowClient(tracking_uri=base, registry_uri=base)
    try:
        versions = pick_versions(client, name, [v for v in args.versions.split(",") if v])
        aliases: dict[str, list[str]] = {}
        for alias, version in (client.get_registered_model(name).aliases or {}).items():
            aliases.setdefault(str(version), []).append(alias)
        run = client.get_run(versions[-1].run_id)
        args.out.mkdir(parents=True, exist_ok=True)
        for page in pages(base, name, run.info.experiment_id, versions, aliases, metric):
            print(f"{shoot(page, args.out, (width, height), args.budget_ms)}: {page.url}")
    except ScreenshotError as err:
        print(f"screenshots: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps({"model": name, "versions": [v.version for v in versions]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
