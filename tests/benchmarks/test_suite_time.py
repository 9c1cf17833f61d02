"""benchmarks/suite_time.py: the tiers' commands come from the Makefile, the counts from pytest."""

import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import suite_time  # noqa: E402 - benchmarks/suite_time.py


def test_each_tier_runs_the_makefiles_own_pytest_command():
    recipes = [shlex.split(line) for line in (ROOT / "Makefile").read_text().splitlines()
               if line.startswith("\tpytest")]
    for target in suite_time.TIERS:
        assert suite_time.tier_command(target) in recipes
    assert "not slow" in " ".join(suite_time.tier_command("test-fast"))
    assert "not slow" not in " ".join(suite_time.tier_command("test"))


def test_a_target_without_pytest_is_refused(tmp_path):
    makefile = tmp_path / "Makefile"
    makefile.write_text("test: env\n\techo hello\n\nother: env\n\tpytest -q\n")
    with pytest.raises(SystemExit, match="runs no pytest command"):
        suite_time.tier_command("test", makefile)
    with pytest.raises(SystemExit, match="no target 'missing: env'"):
        suite_time.tier_command("missing", makefile)


def test_the_summary_line_gives_the_counts():
    out = "....\n= 1,0 =\n3 failed, 1096 passed, 4 skipped, 2 errors in 88.21s (0:01:28)\n"
    assert suite_time.counts(out) == {"failed": 3, "passed": 1096, "skipped": 4, "error": 2}
    assert suite_time.counts("1 passed in 0.1s") == {"passed": 1}


def test_the_module_times_file_is_asked_for_by_the_name_the_suite_reads():
    from tests import conftest

    assert suite_time.MODULE_TIMES_ENV == conftest.MODULE_TIMES_ENV
