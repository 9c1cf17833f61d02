"""`dvc plots show` draws its plots offline: the page template of ops/plots_page.py carries
vega, vega-lite and vega-embed inline (from the npm packages `make env` installs in build/vega/),
so the page loads nothing from the internet. Checked on the project's own plot definitions
(dvc.yaml's `plots:` and train's loss curve) rendered by the real `dvc plots show`, in headless
Chromium with every host unresolvable; DVC's default page, drawn the same way, stays blank."""

from __future__ import annotations

import contextlib
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from harness.webdriver import OFFLINE_FLAGS, Browser
from ops import plots_page

ROOT = Path(__file__).resolve().parents[2]
NODE_MODULES = plots_page.BUILD / "node_modules"
EXTERNAL = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.IGNORECASE)


# ---- the template, from stand-in library files (fast) -----------------------------------------


def fake_libraries(folder: Path) -> Path:
    for name in plots_page.LIBRARIES:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"var {path.stem.replace('-', '_').replace('.', '_')} = '</script>';\n"
                        f"//# sourceMappingURL={path.name}.map\n")
    return folder


def test_the_template_carries_the_libraries_and_no_cdn_placeholder(tmp_path):
    page = plots_page.page(fake_libraries(tmp_path))
    assert "{scripts}" not in page  # where DVC would put its CDN <script src> tags
    assert "{plot_divs}" in page and "{refresh_tag}" in page
    positions = [page.index(f"var {Path(n).stem.replace('-', '_').replace('.', '_')}")
                 for n in plots_page.LIBRARIES]
    assert positions == sorted(positions)  # vega, then vega-lite, then vega-embed
    assert "sourceMappingURL" not in page and "'<\\/script>'" in page
    assert not EXTERNAL.search(page)


def test_without_the_packages_the_template_says_it_is_online_only(tmp_path):
    page = plots_page.page(tmp_path / "missing")
    assert "{scripts}" in page and "offline this page stays blank" in page


def test_the_project_points_dvc_at_the_template():
    config = (ROOT / ".dvc" / "config").read_text()
    configured = re.search(r"html_template\s*=\s*(\S+)", config)[1]
    assert (ROOT / ".dvc" / configured).resolve() == plots_page.TEMPLATE.resolve()
    assert subprocess.run(["git", "check-ignore", "-q", str(plots_page.TEMPLATE)],
                          cwd=ROOT).returncode == 0  # never committed (vendored JS)


# ---- the real page in a browser with no network (slow: dvc + Chromium) ------------------------


def plots_workspace(folder: Path) -> Path:
    """A DVC project with dvc.yaml's own plot definitions and small data of the same columns."""
    project = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    train_plot = next(entry for entry in project["stages"]["train"]["plots"])
    plots = [p for p in project["plots"] if isinstance(p, dict)] + [train_plot]
    for entry in plots:
        for settings in entry.values():
            settings.pop("cache", None)
    (folder / "plots").mkdir(parents=True)
    (folder / "plots/recall_at_k.csv").write_text(
        "k,i2t,t2i\n" + "".join(f"{k},{min(1, k / 10)},{min(1, k / 12)}\n" for k in range(1, 11)))
    (folder / "plots/confusion_matrix.csv").write_text(
        "actual,predicted\n" + "".join(f"{a},{p}\n" for a in "abc" for p in "abca"))
    (folder / "plots/train.csv").write_text(
        "step,loss\n" + "".join(f"{s},{4 - 0.1 * s}\n" for s in range(30)))
    (folder / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}))
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=folder, check=True)
    return folder


def dvc_plots_show(project: Path, out: str, *template: str) -> Path:
    subprocess.run(["dvc", "plots", "show", "-o", out, *template], cwd=project, check=True,
                   capture_output=True)
    return project / out / "index.html"


def drawn_plots(browser: Browser, page: Path) -> tuple[int, int]:
    """(vega plots on the page, vega plots drawn), once drawing has settled. vega-embed replaces
    each plot's <div> content, its <script> included, so the plots are counted in the file."""
    plots = page.read_text().count("vegaEmbed('#")
    browser.get(page.as_uri())
    drawn = ("return document.querySelectorAll("
             "'.vega-embed canvas, .vega-embed svg.marks').length")
    # a page that does not draw is the failure being looked for: counted below, not raised here
    with contextlib.suppress(AssertionError):
        browser.wait(lambda: browser.script(drawn) >= plots, timeout=20, what="the plots")
    return plots, browser.script(drawn)


@pytest.mark.slow
def test_dvc_plots_show_draws_every_plot_with_the_network_off(tmp_path):
    if not all((NODE_MODULES / name).is_file() for name in plots_page.LIBRARIES):
        pytest.fail(f"vega's npm packages are not in {NODE_MODULES}: `make env` installs them")
    template = tmp_path / "dvc-plots.html"
    plots_page.main(["--out", str(template)])
    project = plots_workspace(tmp_path / "project")
    offline = dvc_plots_show(project, "offline", "--html-template", str(template))
    default = dvc_plots_show(project, "default")
    assert not EXTERNAL.search(offline.read_text())
    assert EXTERNAL.search(default.read_text())  # DVC's own page: vega from cdn.jsdelivr.net
    with Browser(extra_args=tuple(OFFLINE_FLAGS)) as browser:
        plots, drawn = drawn_plots(browser, offline)
        assert plots == 3 and drawn == plots
        plots, drawn = drawn_plots(browser, default)
        assert plots == 3 and drawn == 0  # the same plots from DVC's page: blank offline
