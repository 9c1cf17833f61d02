"""The layers of ARCHITECTURE.md: imports run down its table only, the library imports nothing of
the application (nor DVC, Prefect, MLflow), and no two modules share a file name."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from harness.packages import imported_roots

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| (\d+|tools) \| (.+?) \| .+ \|$")
THIRD_PARTY_NEVER_IN_LIBRARY = {"dvc", "prefect", "mlflow"}


def layers(text: str) -> dict[str, int | None]:
    """{package: layer} from the table's rows; tools have no layer (they may import anything)."""
    table = {}
    for line in text.splitlines():
        if match := ROW.match(line):
            for package in re.findall(r"`(\w+)`", match.group(2)):
                table[package] = None if match.group(1) == "tools" else int(match.group(1))
    return table


LAYERS = layers((ROOT / "ARCHITECTURE.md").read_text())
LAYERED = sorted(p for p, layer in LAYERS.items() if layer is not None)


def wrong_way(package: str, source: str) -> set[str]:
    """The project packages `source` (a module of `package`) imports at its layer or above."""
    own = LAYERS[package]
    return {root for root in imported_roots(source) & LAYERS.keys()
            if root != package and (LAYERS[root] is None or LAYERS[root] >= own)}


def test_the_table_names_every_package_once():
    assert LAYERS["clipms"] == 0 and LAYERS["stages"] > LAYERS["registry"] > LAYERS["tracking"]
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert on_disk <= LAYERS.keys(), on_disk - LAYERS.keys()


def test_the_check_sees_an_import_up_or_across():
    assert wrong_way("tracking", "from registry import gate\nfrom clipms import runtime\n") == {
        "registry"}
    assert wrong_way("prep", "import tracking.run\n") == {"tracking"}
    assert wrong_way("stages", "from harness import processes\nfrom prep import shards\n") == {
        "harness"}
    assert wrong_way("flows", "import registry.gate\nimport pipeline.params\n") == set()


@pytest.mark.parametrize("module", sorted(p for pkg in LAYERED for p in (ROOT / pkg).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_down_the_layers(module: Path):
    package = module.relative_to(ROOT).parts[0]
    assert not wrong_way(package, module.read_text())


@pytest.mark.parametrize("module", sorted((ROOT / "clipms").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_imports_no_dvc_prefect_or_mlflow(module: Path):
    assert not imported_roots(module.read_text()) & THIRD_PARTY_NEVER_IN_LIBRARY


def test_no_two_modules_share_a_file_name():
    names = Counter(p.name for pkg in [*LAYERED, "harness"] for p in (ROOT / pkg).rglob("*.py")
                    if p.name not in {"__init__.py", "__main__.py"})
    assert not [name for name, count in names.items() if count > 1]


@pytest.mark.parametrize("module", sorted((ROOT / "serving").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_service_runs_without_the_pipeline_machinery(module: Path):
    # The service follows the registry; it never runs a stage, DVC or Prefect.
    assert not imported_roots(module.read_text()) & {"stages", "dvc", "prefect"}
