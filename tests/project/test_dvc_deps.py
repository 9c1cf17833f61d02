"""dvc.yaml's code dependencies are checked against the code, never trusted.

For every stage, the project modules its entry point imports (transitively, read from the source by
clipms.utils.codehash) must be exactly the `.py` deps dvc.yaml lists for it: a missing one means
`dvc repro` would call stale results "up to date"; an extra one reruns a stage for nothing.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import yaml

from clipms.utils.codehash import code_digest, module_closure
from harness.packages import PROJECT_PACKAGES

ROOT = Path(__file__).resolve().parents[2]

# Modules a stage runs without importing them, each with the reason; their closures count too.
RUN_WITHOUT_IMPORT = {
    # logged as MLflow "models from code": the file is the served model's code, run by the server
    "register": ["registry.pyfunc_model"],
}


def stage_code_problems(root: Path) -> dict[str, dict[str, list[str]]]:
    """{stage: {"missing": [...], "extra": [...]}} for every stage whose .py deps are wrong."""
    pipeline = yaml.safe_load((root / "dvc.yaml").read_text())
    problems = {}
    for name, stage in pipeline["stages"].items():
        entry = re.match(r"python -m ([\w.]+)", stage["cmd"])
        assert entry, f"stage {name}: cmd {stage['cmd']!r} is not `python -m <module> ...`"
        listed = {d for d in _dep_paths(stage) if d.endswith(".py")}
        imported = {str(path) for module in [entry.group(1), *RUN_WITHOUT_IMPORT.get(name, [])]
                    for path in module_closure(module, root, PROJECT_PACKAGES)}
        missing, extra = sorted(imported - listed), sorted(listed - imported)
        if missing or extra:
            problems[name] = {"missing": missing, "extra": extra}
    return problems


def _dep_paths(stage: dict) -> list[str]:
    return [next(iter(d)) if isinstance(d, dict) else d for d in stage.get("deps", [])]


def test_every_stage_lists_exactly_the_code_it_imports():
    assert stage_code_problems(ROOT) == {}


def test_a_new_import_without_a_dvc_yaml_entry_fails(tmp_path):
    """A temporary project: a stage whose library module gains a (lazy) import of another module."""
    for package in ("stages", "clipms"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text('"""Docstring only: runs nothing."""\n')
    (tmp_path / "clipms" / "__init__.py").write_text("import os\n")
    (tmp_path / "stages" / "fit.py").write_text("from clipms import model\n")
    (tmp_path / "clipms" / "model.py").write_text("X = 1\n")
    (tmp_path / "clipms" / "fusion.py").write_text("Y = 2\n")
    (tmp_path / "dvc.yaml").write_text(textwrap.dedent("""\
        stages:
          fit:
            cmd: python -m stages.fit
            deps: [stages/fit.py, clipms/__init__.py, clipms/model.py, data]
        """))
    assert stage_code_problems(tmp_path) == {}
    (tmp_path / "clipms" / "model.py").write_text(
        "X = 1\n\n\ndef build():\n    from clipms.fusion import Y  # lazy\n    return Y\n")
    assert stage_code_problems(tmp_path) == {
        "fit": {"missing": ["clipms/fusion.py"], "extra": []}}


def test_closure_follows_relative_and_package_imports(tmp_path):
    (tmp_path / "clipms" / "data").mkdir(parents=True)
    (tmp_path / "clipms" / "__init__.py").write_text("import os\n")
    (tmp_path / "clipms" / "data" / "__init__.py").write_text("")
    (tmp_path / "clipms" / "data" / "a.py").write_text("from . import b\nfrom ..c import z\n")
    (tmp_path / "clipms" / "data" / "b.py").write_text("import numpy\n")
    (tmp_path / "clipms" / "c.py").write_text("z = 0\n")
    assert [str(p) for p in module_closure("clipms.data.a", tmp_path)] == [
        "clipms/__init__.py", "clipms/c.py", "clipms/data/a.py", "clipms/data/b.py"]


def test_code_digest_ignores_comments_and_docstrings_but_not_code(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Doc."""\n\ndef f():\n    """Doc."""\n    return 1  # one\n')
    before = code_digest(["m.py"], tmp_path)
    module.write_text('"""Other doc, 2x faster."""\n# a comment\n\ndef f():\n    return 1\n')
    assert code_digest(["m.py"], tmp_path) == before
    module.write_text('"""Doc."""\n\ndef f():\n    return 2\n')
    assert code_digest(["m.py"], tmp_path) != before
