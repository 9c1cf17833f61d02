"""Only stages name files: each stage declares what it reads and writes (from pipeline.paths), and
dvc.yaml's deps and outs must be exactly that declaration."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from harness.packages import PROJECT_PACKAGES
from pipeline import paths

ROOT = Path(__file__).resolve().parents[2]
CODE_ROOTS = tuple(f"{package}/" for package in PROJECT_PACKAGES)  # code deps: test_dvc_deps
OUT_KINDS = ("outs", "metrics", "plots")


def _names(entries: list) -> set[str]:
    return {next(iter(e)) if isinstance(e, dict) else e for e in entries}


def _pipeline() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())


def test_dvc_yaml_deps_and_outs_are_what_each_stage_declares():
    for name, stage in _pipeline()["stages"].items():
        module = importlib.import_module(stage["cmd"].split()[2])
        data_deps = {d for d in _names(stage.get("deps", [])) if not d.startswith(CODE_ROOTS)}
        written = set().union(*(_names(stage.get(kind, [])) for kind in OUT_KINDS))
        assert data_deps == {str(p) for p in module.READS}, f"stage {name}: deps"
        assert written == {str(p) for p in module.WRITES}, f"stage {name}: outs/metrics/plots"


def test_every_plot_and_path_belongs_to_the_paths_module():
    declared = {str(v) for v in vars(paths).values() if isinstance(v, Path)}
    pipeline = _pipeline()
    for plot in _names(pipeline.get("plots", [])):
        assert plot in declared, plot
    for stage in pipeline["stages"].values():
        for path in _names(stage.get("deps", [])) | _names(stage.get("outs", [])):
            assert path.startswith(CODE_ROOTS) or path in declared, path
