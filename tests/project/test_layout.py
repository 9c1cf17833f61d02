"""Tests mirror the code: the test of `a/b/c.py` is `tests/a/b/test_c.py` (or `test_c_<aspect>.py`
beside it). A module without one says where it is tested (`# tested by: tests/...`, a file that
imports it) or why it is not (`# not unit-tested: <reason>`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGES = ("clipms", "pipeline", "prep", "tracking", "registry", "stages", "ops", "flows",
            "serving")
# Test folders that do not mirror one module: whole-project checks, tests across packages with
# real servers, whole-pipeline runs.
NOT_MIRRORED = {"project", "integration", "e2e", "data"}
TESTED_BY = re.compile(r"^# tested by: (tests/\S+\.py)", re.M)
NOT_TESTED = re.compile(r"^# not unit-tested: \S", re.M)


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if p.name not in {"__init__.py", "__main__.py"})


def mirror_tests(module: Path) -> list[Path]:
    folder = TESTS / module.parent.relative_to(ROOT)
    return sorted(folder.glob(f"test_{module.stem}.py")) + sorted(
        folder.glob(f"test_{module.stem}_*.py"))


def dotted(module: Path) -> str:
    return ".".join(module.relative_to(ROOT).with_suffix("").parts)


def imports(text: str, name: str) -> bool:
    """Whether a test's source imports (or runs, `python -m`) the module `name`."""
    package, _, stem = name.rpartition(".")
    return bool(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text)
                or re.search(rf"from {re.escape(package)} import [^\n]*\b{stem}\b", text))


def where_tested(module: Path) -> str | None:
    """None when the module is tested where its path says, or says where and why not."""
    if mirror_tests(module):
        return None
    text = module.read_text()
    if NOT_TESTED.search(text):
        return None
    if match := TESTED_BY.search(text):
        named = ROOT / match.group(1)
        if named.is_file() and imports(named.read_text(), dotted(module)):
            return None
        return f"{module.relative_to(ROOT)}: `# tested by: {match.group(1)}` names no test of it"
    return f"{module.relative_to(ROOT)}: no tests/.../test_{module.stem}.py and no reason given"


def test_the_rule_sees_a_module_without_a_test(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "TESTS", tmp_path / "tests")
    lonely = tmp_path / "prep" / "lonely.py"
    lonely.parent.mkdir()
    lonely.write_text("x = 1\n")
    assert "no reason given" in where_tested(lonely)
    lonely.write_text("# not unit-tested: a thin wrapper over img2dataset\n")
    assert where_tested(lonely) is None
    (tmp_path / "tests" / "prep").mkdir(parents=True)
    lonely.write_text("x = 1\n")
    (tmp_path / "tests" / "prep" / "test_lonely_edge.py").write_text("")
    assert where_tested(lonely) is None


@pytest.mark.parametrize("module", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_has_its_test_or_says_where(module: Path):
    assert where_tested(module) is None, where_tested(module)


def test_every_mirrored_test_names_a_module():
    orphans = []
    for test in TESTS.rglob("test_*.py"):
        parts = test.relative_to(TESTS).parts
        if len(parts) == 1 or parts[0] in NOT_MIRRORED:
            continue
        folder = ROOT.joinpath(*parts[:-1])
        stem = test.stem.removeprefix("test_")
        names = {p.name.split(".")[0] for p in folder.iterdir()} if folder.is_dir() else set()
        if not any(stem == n or stem.startswith(n + "_") for n in names):
            orphans.append(str(test.relative_to(ROOT)))
    assert not orphans


def test_no_test_file_is_left_at_the_top():
    assert not sorted(p.name for p in TESTS.glob("test_*.py"))
