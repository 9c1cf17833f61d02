"""Screenshots of the MLflow UI for docs/mlflow.md: the registered model's page (versions, aliases,
the gate's decisions) and the experiment's Models view (the versions' logged models side by side,
by metric columns). Headless Chromium (harness/webdriver.py) renders the UI of a running server:

    mlflow server --backend-store-uri sqlite:///mlflow.db --artifacts-destination mlartifacts \\
        --host 127.0.0.1 --port 5000 --workers 1 &
    python -m harness.mlflow_screenshots --tracking-uri http://127.0.0.1:5000 --out docs/

Each page is photographed only once its DOM shows what it must (the model's name, its versions
and their aliases; the versions' logged models and a metric column), so a page that did not finish
rendering fails here instead of ending up in the docs as a blank picture.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from clipms.utils.atomic import atomic_write
from harness.webdriver import Browser

RENDER_TIMEOUT_S = 60.0  # wall time for the React UI to fetch and render on a loaded machine
# MLflow 3.17 picks an experiment's view (GenAI: "Agent versions", traces; or model training: runs,
# models) by this URL parameter / the sidebar's switch, not by the experiment's kind tag.
MODEL_TRAINING_VIEW = "workflowType=machine_learning"
BODY_TEXT = "return document.body ? document.body.innerText.replace(/\\u00a0/g, ' ') : ''"
# Each poll: close the assistant panel (a third of the window) if it is open, and scroll the table
# (Models view) to a column, so that the table renders the columns after it (it renders only the
# columns in view). Both are idempotent.
TIDY = """
const close = document.querySelector('[data-component-id="mlflow.assistant.chat_panel.close"]');
if (close) close.click();
const column = arguments[0];
if (!column) return true;
const cell = [...document.querySelectorAll('.ag-header-cell')]
  .find(c => c.innerText.trim() === column);
const bar = document.querySelector('.ag-body-horizontal-scroll-viewport');
if (!cell || !bar) return false;
if (bar.scrollLeft !== cell.offsetLeft) {
  bar.scrollLeft = cell.offsetLeft;
  bar.dispatchEvent(new Event('scroll'));
}
return true;"""
FOLD_SIDEBAR = "mlflow_header.toggle_sidebar_button"


@dataclass(frozen=True)
class Page:
    file: str  # PNG name in the output folder
    url: str
    must_show: tuple[str, ...]  # texts the rendered page must contain
    scroll_to: str = ""  # a table column to scroll to before the picture


def pages(base: str, model: str, experiment: Any, versions: Sequence[Any],
          aliases: dict[str, list[str]], metric: str) -> list[Page]:
    """The registry page and the experiment's Models view of `versions` (two, usually). The
    Models view must show the experiment's name: its header loads after the table."""
    shown = [f"@ {alias}" for v in versions for alias in aliases.get(str(v.version), [])]
    return [
        Page("mlflow-registry.png", f"{base}/#/models/{quote(model)}",
             (model, *(f"Version {v.version}" for v in versions), *shown)),
        Page("mlflow-compare.png",
             f"{base}/#/experiments/{experiment.experiment_id}/models?{MODEL_TRAINING_VIEW}",
             (experiment.name, "Registered models", metric,
              *(f"{model}\nv{v.version}" for v in versions)),
             scroll_to="Registered models"),
    ]


def missing_texts(browser: Browser, page: Page) -> list[str]:
    text = browser.script(BODY_TEXT) or ""
    return [t for t in page.must_show if t not in text]


def shoot(browser: Browser, page: Page, out_dir: Path,
          timeout: float = RENDER_TIMEOUT_S) -> Path:
    """Open the page, tidy it and wait until it shows every text it must, then save its
    screenshot."""
    browser.get(page.url)
    if page.scroll_to:  # the Models view: fold the sidebar once, for the table's width
        browser.wait(lambda: browser.find_all(f'[data-component-id="{FOLD_SIDEBAR}"]'),
                     timeout=timeout, what=f"{page.url} to render")
        browser.click(browser.find(f'[data-component-id="{FOLD_SIDEBAR}"]'))

    def ready() -> bool:
        return bool(browser.script(TIDY, page.scroll_to)) and not missing_texts(browser, page)

    try:
        browser.wait(ready, timeout=timeout, what=f"{page.url} to show {list(page.must_show)}")
    except AssertionError as err:
        raise AssertionError(f"{err}; missing: {missing_texts(browser, page)}") from None
    time.sleep(1)  # let the last scroll's re-render paint
    out = out_dir / page.file
    with atomic_write(out) as tmp:
        browser.screenshot(tmp)
    return out


def pick_versions(mlflow_client: Any, model: str, wanted: Sequence[str]) -> list[Any]:
    """The versions asked for, else the champion and the newest other version."""
    if wanted:
        return [mlflow_client.get_model_version(model, v) for v in wanted]
    versions = sorted(mlflow_client.search_model_versions(f"name = '{model}'"),
                      key=lambda v: int(v.version))
    if not versions:
        raise SystemExit(f"registered model '{model}' has no versions")
    champion = (mlflow_client.get_registered_model(model).aliases or {}).get("champion")
    first = next((v for v in versions if v.version == champion), versions[-1])
    other = [v for v in versions if v.version != first.version][-1:]
    return sorted([first, *other], key=lambda v: int(v.version))


def take(mlflow_client: Any, base: str, model: str, metric: str, out_dir: Path,
         versions: Sequence[str] = (), window: tuple[int, int] = (1600, 900)) -> list[Path]:
    """Both screenshots of `model`'s versions (see `pick_versions`) into `out_dir`."""
    chosen = pick_versions(mlflow_client, model, versions)
    aliases: dict[str, list[str]] = {}
    for alias, version in (mlflow_client.get_registered_model(model).aliases or {}).items():
        aliases.setdefault(str(version), []).append(alias)
    experiment = mlflow_client.get_experiment(
        mlflow_client.get_run(chosen[-1].run_id).info.experiment_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Browser(window=window) as browser:
        return [shoot(browser, page, out_dir)
                for page in pages(base, model, experiment, chosen, aliases, metric)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.mlflow_screenshots",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="http(s) URL of a running MLflow server (its UI is photographed)")
    parser.add_argument("--name", default=None,
                        help="registered model (default: register.model_name in params.yaml)")
    parser.add_argument("--versions", default="",
                        help="comma-separated versions (default: champion + newest other)")
    parser.add_argument("--metric", default=None,
                        help="a metric column the Models view must show (default: "
                             "register.primary_metric)")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--size", default="1600x900", help="window WIDTHxHEIGHT")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    base = (args.tracking_uri or "").rstrip("/")
    if not base.startswith(("http://", "https://")):
        parser.error(f"--tracking-uri must be the http(s) URL of a running MLflow server "
                     f"(got {args.tracking_uri!r}); for the local store start `mlflow server "
                     "--backend-store-uri sqlite:///mlflow.db ...` first")
    width, height = (int(v) for v in args.size.split("x"))

    from mlflow import MlflowClient

    from tracking.journal import mlflow_key
    from tracking.settings import RegisterParams, register_params

    defaults = register_params(args.params) if args.params.exists() else RegisterParams()
    name = args.name or defaults.model_name
    metric = mlflow_key(args.metric or defaults.primary_metric)
    client = MlflowClient(tracking_uri=base, registry_uri=base)
    wanted = [v for v in args.versions.split(",") if v]
    for path in take(client, base, name, metric, args.out, wanted, (width, height)):
        print(path)
    print(json.dumps({"model": name, "versions": [v.version for v in
                                                  pick_versions(client, name, wanted)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
