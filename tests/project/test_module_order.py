"""The order `make test` hands modules to its two xdist workers (tests/conftest.py): the longest
modules first, then the other modules with slow tests (most slow tests first), then the fast
ones, each module's tests together; and xdist keeps that order instead of its own (most tests
first)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

TESTS = Path(__file__).resolve().parents[1]


class Item:
    """What the hook reads of a collected test: its module's path and its `slow` mark."""

    def __init__(self, module: str, name: str, slow: bool = False) -> None:
        self.path, self.name, self.slow = TESTS / module, name, slow

    def get_closest_marker(self, mark: str) -> object | None:
        return object() if mark == "slow" and self.slow else None


def test_modules_go_longest_first_then_slow_then_fast_each_module_together():
    atomic, checkpoint = "clipms/utils/test_atomic.py", "clipms/train/test_checkpoint.py"
    index = "clipms/deploy/test_searchindex.py"
    items = [Item(atomic, "a1"), Item(checkpoint, "e1"), Item(checkpoint, "e2", slow=True),
             Item("e2e/test_kill_recovery.py", "k", True), Item(atomic, "a2"),
             Item("flows/test_deploy.py", "n", True), Item(index, "i1", slow=True),
             Item(index, "i2", slow=True), Item(checkpoint, "e3")]
    conftest.pytest_collection_modifyitems(None, items)
    # the listed longest in their order; then most slow tests first (index: 2, checkpoint: 1)
    assert [i.name for i in items] == ["n", "k", "i1", "i2", "e1", "e2", "e3", "a1", "a2"]


def test_every_listed_longest_module_exists_and_is_marked_slow():
    for name in conftest.LONGEST_MODULES:
        text = (TESTS / name).read_text()
        assert "pytest.mark.slow" in text, name


@pytest.mark.parametrize("xdist", [True, False])
def test_xdist_keeps_the_collection_order(xdist):
    option = SimpleNamespace(loadscopereorder=True) if xdist else SimpleNamespace()
    conftest.pytest_configure(SimpleNamespace(option=option))
    assert getattr(option, "loadscopereorder", False) is False


def test_a_run_ends_with_its_longest_modules_and_the_time_of_each_tier(monkeypatch):
    """Where a slow `make test` spent its time: per module, the seconds of its tests' phases
    (module fixtures included), the CPU-s its teardown reports carry, slow tests / tests."""
    monkeypatch.setattr(conftest, "_module_times", {})

    def report(nodeid: str, when: str, seconds: float, cpu_s: float = 0.0, slow: bool = False):
        props = [("cpu_s", cpu_s), ("slow", slow)] if when == "teardown" else []
        return SimpleNamespace(nodeid=nodeid, when=when, duration=seconds, user_properties=props)

    for args in [("tests/test_b.py::t", "call", 2.0), ("tests/test_b.py::t", "teardown", 0.5, 0.3),
                 ("tests/test_a.py::t1", "setup", 10.0), ("tests/test_a.py::t1", "call", 5.0),
                 ("tests/test_a.py::t1", "teardown", 1.0, 4.0, True),
                 ("tests/test_a.py::t2", "call", 3.0), ("tests/test_a.py::t2", "teardown", 0.0)]:
        conftest.pytest_runtest_logreport(report(*args))
    lines: list[str] = []
    conftest._write_module_times(SimpleNamespace(write_sep=lambda _, text: lines.append(text),
                                                 write_line=lines.append))
    assert lines[1:] == ["   19.0 s     4.0 CPU-s   1/2   tests/test_a.py",
                         "    2.5 s     0.3 CPU-s   0/1   tests/test_b.py",
                         "modules with slow tests: 1, 19 s; the others: 1, 2 s"]
