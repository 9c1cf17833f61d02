"""pyproject.toml's dependency lists against what the code imports.

A runtime pin is a promise that `pip install clipms` needs it: every one is imported by the
installed packages (clipms, pipeline, stages, flows, registry, serving) or says on its line why it
is pinned anyway (a transitive dependency held at a version, a plugin loaded by another library).
What only the tests and benchmarks import belongs to the `dev` extra, and the installed packages
never import something only `dev` pins.
"""

from __future__ import annotations

import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions

from harness.packages import PROJECT_PACKAGES, ROOT, imported_roots

PYPROJECT = ROOT / "pyproject.toml"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """"moto[s3]==5.2.5" -> "moto"."""
    found = _NAME.match(requirement.strip())
    assert found, f"pyproject.toml: cannot read the requirement {requirement!r}"
    return canonical(found.group(0))



@cache  # reading every installed distribution's file list takes seconds
def distributions_imported_by(packages: tuple[str, ...]) -> set[str]:
    """The installed distributions whose modules the packages' code imports."""
    modules = set()
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            modules |= imported_roots(path.read_text())
    third_party = modules - set(sys.stdlib_module_names) - set(PROJECT_PACKAGES) - {"__future__"}
    providers = packages_distributions()
    return {canonical(dist) for module in third_party for dist in providers.get(module, [])}


def pinned_lines(requirements: list[str]) -> dict[str, str]:
    """{distribution: its line in pyproject.toml} for the given requirement strings."""
    lines = PYPROJECT.read_text().splitlines()
    found = {}
    for requirement in requirements:
        [line] = [ln for ln in lines if ln.strip().startswith(f'"{requirement}"')]
        found[requirement_name(requirement)] = line
    return found


def test_the_checker_reads_names_and_imports():
    assert requirement_name('moto[s3]==5.2.5') == "moto"
    assert requirement_name("PyYAML==6.0.2") == canonical("pyyaml")
    assert imported_roots("import a.b\nfrom c.d import e\nfrom . import f\n"
                              "def g():\n    import h\n") == {"a", "c", "h"}


def test_every_runtime_pin_is_imported_by_the_package_or_says_why():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    imported = distributions_imported_by(PROJECT_PACKAGES)
    unexplained = {name: line.strip()
                   for name, line in pinned_lines(project["dependencies"]).items()
                   if name not in imported and "#" not in line}
    assert not unexplained, (
        f"runtime dependencies that {', '.join(PROJECT_PACKAGES)} never import: {unexplained}; "
        "move each to the extra whose code imports it (tests, benchmarks: dev), or say on its "
        "line why the installed package needs it")


def test_the_package_imports_nothing_only_the_dev_extra_pins():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    elsewhere = {requirement_name(r) for r in project["dependencies"]}
    elsewhere |= {requirement_name(r) for name, reqs in extras.items() if name != "dev"
                  for r in reqs}
    dev_only = {requirement_name(r) for r in extras["dev"]} - elsewhere
    wrongly = dev_only & distributions_imported_by(PROJECT_PACKAGES)
    assert not wrongly, f"the installed packages import {sorted(wrongly)}, which only `dev` pins"
