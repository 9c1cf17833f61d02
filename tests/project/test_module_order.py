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
    atomic, mindir = "clipms/utils/test_atomic.py", "clipms/deploy/test_mindir.py"
    index = "clipms/deploy/test_searchindex.py"
    items = [Item(atomic, "a1"), Item(mindir, "e1"), Item(mindir, "e2", slow=True),
             Item("e2e/test_kill_recovery.py", "k", True), Item(atomic, "a2"),
             Item("flows/test_pipeline_nightly.py", "n", True), Item(index, "i1", slow=True),
             Item(index, "i2", slow=True), Item(mindir, "e3")]
    conftest.pytest_collection_modifyitems(None, items)
    # the listed longest in their order; then most slow tests first (index: 2, export: 1)
    assert [i.name for i in items] == ["n", "k", "i1", "i2", "e1", "e2", "e3", "a1", "a2"]


def test_the_flows_modules_keep_their_order_on_a_shared_prefect_server():
    flows = [name for name in conftest.LONGEST_MODULES if name.startswith("flows/")]
    assert flows == sorted(flows)


def test_every_listed_longest_module_exists_and_is_marked_slow():
    for name in conftest.LONGEST_MODULES:
        text = (TESTS / name).read_text()
        assert "pytest.mark.slow" in text, name


@pytest.mark.parametrize("xdist", [True, False])
def test_xdist_keeps_the_collection_order(xdist):
    option = SimpleNamespace(loadscopereorder=True) if xdist else SimpleNamespace()
    conftest.pytest_configure(SimpleNamespace(option=option))
    assert getattr(option, "loadscopereorder", False) is False
