"""Shared fixtures. Servers that tests start listen on 127.0.0.1 and are stopped by the fixture.

Two tiers. `make test` runs every test (CI does). `make test-fast` runs the tests not marked slow
and must stay under two minutes on a 2-core machine, so mark a test `@pytest.mark.slow` (a whole
module: `pytestmark = pytest.mark.slow`) when it takes more than FAST_BUDGET_CPU_S of CPU, setup
included (a module fixture's cost goes to the first test that uses it), and whenever it starts a
server process (MLflow, Prefect, PostgreSQL, the search service) or runs `dvc` or `msrun`. A test
that compiles a MindSpore training step, exports or loads MindIR, compiles fused kernels or runs a
stage on data is always over the budget; one that starts a stage only to see it refuse bad
params, before anything heavy loads, usually is not, nor is a loopback server in a thread of the
test process (harness/image_site.py).
Every run ends by listing the unmarked tests over the budget, in CPU seconds (this process and the
children it waited for), which a loaded machine changes far less than wall time.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest

# Same offline defaults as the Makefile, for a bare `pytest` run too.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("GLOG_v", "3")

# CPU graph-kernel fusion (clipms.runtime): the commands tests start (stages, `dvc repro`, servers;
# harness/dvc_workspace.py's tool_env) run fused, as users run them, compiling into a kernel cache
# of
# their own that starts empty. This pytest process itself stays unfused: after ~80 tests had
# compiled hundreds of unrelated graphs in it, MindSpore's AKG kernel-build client was found closed
# ("Send request before Open()"), which no single stage or inference process ever showed.
# tests/clipms/test_runtime.py compares fused and unfused runs in processes of their own.
if "CLIPMS_KERNEL_CACHE" not in os.environ:
    os.environ["CLIPMS_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="clipms-test-kernels-")
    atexit.register(shutil.rmtree, os.environ["CLIPMS_KERNEL_CACHE"], True)
os.environ["CLIPMS_KERNEL_FUSION"] = "0"

# The promotion gate's machine-wide lock (registry.gatelock, for HTTP tracking servers) is keyed by
# model name only; `make test` runs two pytest workers whose MLflow servers both register "clip",
# so each pytest process keeps its locks apart (the processes a test starts inherit this folder).
if "CLIPMS_LOCK_DIR" not in os.environ:
    os.environ["CLIPMS_LOCK_DIR"] = tempfile.mkdtemp(prefix="clipms-test-locks-")
    atexit.register(shutil.rmtree, os.environ["CLIPMS_LOCK_DIR"], True)

# The CPU settings clipms.runtime.configure would make, set before any test imports MindSpore (some
# are read at `import mindspore`); the tests' own configure() calls then find them in place.
from clipms.runtime import RuntimeConfig, settings_for  # noqa: E402

_cpu = settings_for(RuntimeConfig(kernel_fusion=False))
os.environ.update({**_cpu.import_env, **_cpu.env})


@pytest.fixture(params=["graph", "pynative"])
def mode(request):
    """Run a MindSpore test in each execution mode (or the one it parametrizes), then restore.

    Imported lazily so that tests without MindSpore do not pay for it; the modules that use this
    fixture import clipms first, which sets MindSpore's environment.
    """
    import mindspore as ms

    modes = {"graph": ms.GRAPH_MODE, "pynative": ms.PYNATIVE_MODE}
    previous = ms.get_context("mode")
    ms.set_context(mode=modes[request.param])
    yield request.param
    ms.set_context(mode=previous)


# ---------------------------------------------------------------- the order of the modules

# `make test` runs two xdist workers, a whole module at a time each (--dist loadfile). xdist hands
# out the modules with the most tests first, which put the one-test modules last - the longest
# end-to-end runs of the suite - where one worker could be left running them while the other had
# nothing left to take. Here the modules go longest first, shortest last (the two workers then
# finish together, give or take the last fast module): these modules
# (the longest of a CI run, longest first; the table a run ends with gives their times), then the
# other
# modules with slow tests, most slow tests first (the best guess of their length there is before
# they run), then the rest; pytest_configure below makes xdist keep this order.
LONGEST_MODULES = (
    "e2e/test_nights.py", "ops/test_smoke.py", "flows/test_deploy.py",
    "integration/test_registry_server.py", "registry/test_gate_mlflow.py",
    "clipms/deploy/test_mindir.py", "flows/test_pipeline_nights.py",
    "integration/test_retention_store.py", "e2e/test_kill_recovery.py", "clipms/train/test_loop.py",
    "benchmarks/test_rehearsal.py", "flows/test_pipeline_secrets.py",
    "clipms/parallel/test_launch.py", "clipms/train/test_step.py", "registry/test_carryover.py",
    "prep/test_engines.py", "integration/test_registry_training.py", "stages/test_train.py",
    "integration/test_registry_postgres.py",
)
TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    """xdist's loadfile order is the collection order (`--no-loadscope-reorder`, always)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Modules longest first (above); a module's tests stay together and in their order."""
    def module(item) -> str:
        return item.path.relative_to(TESTS).as_posix()

    slow_tests = Counter(module(item) for item in items if item.get_closest_marker("slow"))

    def rank(item) -> tuple[int, int]:
        name = module(item)
        if name in LONGEST_MODULES:
            return (0, LONGEST_MODULES.index(name))
        return (1, -slow_tests[name]) if slow_tests[name] else (2, 0)

    items.sort(key=rank)  # stable: collection order within each rank


# ---------------------------------------------------------------- the fast tier's budget

FAST_BUDGET_CPU_S = 2.0
_CPU_KEY = pytest.StashKey[float]()
_over_budget: list[tuple[float, str]] = []


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    start = _cpu_s()
    yield
    item.stash[_CPU_KEY] = _cpu_s() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = _cpu_s()
    yield
    item.stash[_CPU_KEY] = item.stash.get(_CPU_KEY, 0.0) + _cpu_s() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    start = _cpu_s()
    yield
    # Before another module's test (or none), module and session fixtures end too: the servers
    # they stop are reaped here, and their CPU is not this test's.
    ends_wider_fixtures = nextitem is None or nextitem.path != item.path
    teardown = 0.0 if ends_wider_fixtures else _cpu_s() - start
    # user_properties reach the teardown report, which pytest-xdist sends to the controller
    item.user_properties.append(("cpu_s", item.stash.get(_CPU_KEY, 0.0) + teardown))
    item.user_properties.append(("slow", item.get_closest_marker("slow") is not None))


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    _add_module_time(report, props)
    if report.when == "teardown" and not props.get("slow", True) and \
            props.get("cpu_s", 0.0) > FAST_BUDGET_CPU_S:
        _over_budget.append((props["cpu_s"], report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _over_budget:
        terminalreporter.write_sep("-", f"not marked slow, over {FAST_BUDGET_CPU_S:g} CPU-s "
                                        "(tests/conftest.py says when to mark a test slow)")
        for cpu_s, nodeid in sorted(_over_budget, reverse=True):
            terminalreporter.write_line(f"{cpu_s:6.1f} CPU-s  {nodeid}")
    _write_module_times(terminalreporter)


# ---------------------------------------------------------------- where the time goes

# Per module: seconds (its tests' setup, call and teardown, module fixtures included), CPU-s (as
# above), tests, slow tests; the end of a run lists the longest modules and each tier's total,
# summed over the workers, so that a slow `make test` says where its time went.
_module_times: dict[str, list[float]] = {}
LONGEST_SHOWN = 15
# Where a run writes every module's figures as JSON, when set (benchmarks/suite_time.py sets it).
MODULE_TIMES_ENV = "CLIP_SUITE_MODULE_TIMES"


def _add_module_time(report, props) -> None:
    entry = _module_times.setdefault(report.nodeid.split("::")[0], [0.0, 0.0, 0, 0])
    entry[0] += report.duration
    if report.when == "teardown":
        entry[1] += props.get("cpu_s", 0.0)
        entry[2] += 1
        entry[3] += bool(props.get("slow"))


def _write_module_times(terminalreporter) -> None:
    if not _module_times:
        return
    longest = sorted(_module_times.items(), key=lambda kv: kv[1][0], reverse=True)
    if os.environ.get(MODULE_TIMES_ENV):
        Path(os.environ[MODULE_TIMES_ENV]).write_text(json.dumps(
            [{"module": module, "seconds": round(seconds, 1), "cpu_s": round(cpu_s, 1),
              "tests": tests, "slow": slow} for module, (seconds, cpu_s, tests, slow) in longest],
            indent=1))
    terminalreporter.write_sep("-", f"the {LONGEST_SHOWN} longest modules (test seconds summed "
                                    "over the workers, CPU-s, slow tests / tests)")
    for module, (seconds, cpu_s, tests, slow) in longest[:LONGEST_SHOWN]:
        terminalreporter.write_line(f"{seconds:7.1f} s {cpu_s:7.1f} CPU-s {slow:3d}/{tests:<3d} "
                                    f"{module}")
    # a module is in the slow tier's total when any of its tests is slow (its fixtures with it)
    tiers = {True: [0.0, 0], False: [0.0, 0]}
    for seconds, _, _, slow in _module_times.values():
        tiers[slow > 0][0] += seconds
        tiers[slow > 0][1] += 1
    terminalreporter.write_line(
        f"modules with slow tests: {tiers[True][1]}, {tiers[True][0]:.0f} s; the others: "
        f"{tiers[False][1]}, {tiers[False][0]:.0f} s")
