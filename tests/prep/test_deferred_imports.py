"""The packages img2dataset imports but the download stage does not use wait until first used
(prep.deferred_imports): a night's fixed cost, paid in every process img2dataset spawns."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prep import deferred_imports

ROOT = Path(__file__).resolve().parents[2]


def test_the_download_stage_imports_img2dataset_without_wandb_or_albumentations():
    # A fresh interpreter, as a spawned img2dataset worker starts: the stage's module first.
    code = ("import sys, stages.download; from img2dataset import download; "
            "import prep.img2dataset_guard; "
            "print(sorted(m for m in ('wandb.sdk', 'albumentations.augmentations') "
            "if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_ALBUMENTATIONS_UPDATE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package `deferred_probe` that records each time its body runs."""
    folder = tmp_path / "deferred_probe"
    folder.mkdir()
    (folder / "__init__.py").write_text(
        "import builtins\nbuiltins.deferred_probe_runs = getattr(builtins, "
        "'deferred_probe_runs', 0) + 1\nVALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins
    monkeypatch.setattr(builtins, "deferred_probe_runs", 0, raising=False)
    yield folder
    sys.modules.pop("deferred_probe", None)


def test_a_deferred_package_runs_on_its_first_use_and_is_then_the_real_one(package):
    import builtins

    assert deferred_imports.defer(("deferred_probe", "no_such_package_here")) == [
        "deferred_probe"]
    import deferred_probe  # what img2dataset's `import wandb` does: nothing runs

    assert builtins.deferred_probe_runs == 0
    assert importlib.util.find_spec("deferred_probe").origin == str(package / "__init__.py")
    assert deferred_probe.VALUE == 42 and builtins.deferred_probe_runs == 1
    assert sys.modules["deferred_probe"] is not deferred_probe  # the real module took its place
    assert sys.modules["deferred_probe"].VALUE == 42 and deferred_probe.VALUE == 42
    assert builtins.deferred_probe_runs == 1
    assert deferred_imports.defer(("deferred_probe",)) == []  # imported: left as it is


def test_a_deferred_package_that_fails_to_import_fails_where_it_is_used(package):
    (package / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    deferred_imports.defer(("deferred_probe",))
    import deferred_probe

    for _ in range(2):  # the stand-in stays: each use fails the same way
        with pytest.raises(ImportError, match="broken on purpose"):
            _ = deferred_probe.VALUE
    assert isinstance(sys.modules["deferred_probe"], deferred_imports.DeferredModule)
