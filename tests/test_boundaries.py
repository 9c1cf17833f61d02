"""The library boundary of the design: clipms/ imports nothing from DVC, Prefect, MLflow or the
pipeline packages, so it can be used (and ported) on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.packages import imported_roots

LIBRARY = Path(__file__).resolve().parents[1] / "clipms"
FORBIDDEN = {"dvc", "prefect", "mlflow", "stages", "registry", "flows", "serving", "pipeline"}
SERVICE = LIBRARY.parent / "serving"  # the service: clipms and registry, never the pipeline


def test_the_checker_sees_forbidden_imports():
    source = "import mlflow.pyfunc\nfrom prefect import flow\nfrom . import model\n"
    assert imported_roots(source) == {"mlflow", "prefect"}


@pytest.mark.parametrize("module", sorted(LIBRARY.rglob("*.py")), ids=lambda p: p.name)
def test_library_module_imports_no_pipeline_code(module: Path):
    assert not imported_roots(module.read_text()) & FORBIDDEN


@pytest.mark.parametrize("module", sorted(SERVICE.rglob("*.py")), ids=lambda p: p.name)
def test_service_imports_no_stage_or_flow_code(module: Path):
    assert not imported_roots(module.read_text()) & {"stages", "flows", "dvc", "prefect"}
